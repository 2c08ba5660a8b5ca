"""OpenTelemetry traces: one trace per request across router, prefill and decode processes.

Lifecycle of a traced request:

1. Each process calls ``setup_tracing(service_name)`` once at start. With no exporter configured
   (the default) nothing is installed and every span below is a cheap non-recording span.
   ``trace_file=PATH`` / env ``PDENGINE_TRACE_FILE`` appends every finished span as one JSON line
   (several processes may share the file); OTLP is added when
   ``opentelemetry-exporter-otlp`` is importable and ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.
2. The router opens the root span with ``start_request_span("text_completion", "tiny", ...)``
   (GenAI semantic conventions), makes it current in the request's task with ``activate``,
   and adds ``inject_headers(headers)`` (W3C ``traceparent``) to its calls to the workers.
3. A worker's HTTP handler opens ``start_worker_span("prefill", headers, room_id=...)`` (child of
   the extracted context) and calls ``RoomTracer.bind(room_id, span)`` before the room exists.
4. ``RoomTracer.on_transition`` is the room FSM's transition hook: it adds one span event per
   transition (from, to, trigger, late) to the room's span and ends the span when the room
   reaches a terminal state. Late events after the end become a short child span, marked late.
5. The handler ends its span in ``finally`` with ``end_span`` and calls ``RoomTracer.finish``,
   which closes a room span the FSM never terminated (e.g. the request was refused first).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdengine.telemetry.metrics import state_name

log = logging.getLogger(__name__)

TRACE_FILE_ENV = "PDENGINE_TRACE_FILE"
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACER_NAME = "pdengine"
TERMINAL_STATES = frozenset({"SUCCESS", "FAILED"})

# W3C trace context only: the wire format between our own processes is fixed, whatever
# OTEL_PROPAGATORS says.
_PROPAGATOR: TextMapPropagator = TraceContextTextMapPropagator()
_installed: TracerProvider | None = None
_install_lock = threading.Lock()


# ---------------------------------------------------------------- exporters and set-up


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as a plain JSON-able dict (the trace-file line format)."""
    ctx = span.get_span_context()
    resource = span.resource.attributes if span.resource else {}
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": resource.get("service.name"),
        "pid": resource.get("process.pid"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line to `path`.

    The file is opened with O_APPEND and every line is one ``os.write``, so several processes
    can append to the same file without interleaving lines.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._fd is None:
            return SpanExportResult.FAILURE
        for span in spans:
            line = json.dumps(span_to_dict(span), default=str, separators=(",", ":")) + "\n"
            os.write(self._fd, line.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _otlp_exporter() -> SpanExporter | None:
    """The OTLP exporter if its optional package is installed (grpc first, then http)."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTLP requested but opentelemetry-exporter-otlp is not installed")
            return None
    return OTLPSpanExporter()


def build_provider(
    service_name: str, trace_file: str | None = None, otlp: bool | None = None
) -> TracerProvider | None:
    """A TracerProvider with the configured exporters, or None when none is configured."""
    path = trace_file or os.environ.get(TRACE_FILE_ENV) or None
    want_otlp = bool(os.environ.get(OTLP_ENDPOINT_ENV)) if otlp is None else otlp
    processors = []
    if path:
        processors.append(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    if want_otlp and (exporter := _otlp_exporter()) is not None:
        processors.append(BatchSpanProcessor(exporter))
    if not processors:
        return None
    resource = Resource.create({"service.name": service_name, "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def setup_tracing(
    service_name: str, trace_file: str | None = None, otlp: bool | None = None
) -> TracerProvider | None:
    """Install this process's TracerProvider (once; later calls return the first one).

    `otlp=None` means: OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set. Returns None (and installs
    nothing) when no exporter is configured, so tracing costs nothing by default.
    """
    global _installed
    with _install_lock:
        if _installed is not None:
            return _installed
        provider = build_provider(service_name, trace_file, otlp)
        if provider is not None:
            trace.set_tracer_provider(provider)
            _installed = provider
        return provider


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME, tracer_provider=provider)


# ---------------------------------------------------------------- propagation


def activate(span: Span) -> None:
    """Make `span` current for the rest of this task and the tasks it starts.

    For a per-request task (as a server runs each request): nothing detaches it, the task's
    context dies with the task. Outgoing calls then carry it via `inject_headers`.
    """
    otel_context.attach(trace.set_span_in_context(span))


def inject_headers(
    headers: MutableMapping[str, str] | None = None, span: Span | None = None
) -> MutableMapping[str, str]:
    """Add `traceparent` for `span` (default: the current span) to `headers` and return them."""
    headers = {} if headers is None else headers
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(headers, context=ctx)
    return headers


def extract_context(headers: Mapping[str, str]) -> otel_context.Context:
    """The remote parent context carried by `headers` (empty context when there is none)."""
    return _PROPAGATOR.extract({k.lower(): v for k, v in headers.items()})


# ---------------------------------------------------------------- request spans


_OPERATIONS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat"}


def operation_for_path(path: str) -> str:
    """GenAI operation name of a public endpoint: text_completion, chat, or generate."""
    return _OPERATIONS.get(path.rstrip("/"), "generate")


def start_request_span(
    operation: str,
    model: str,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    input_tokens: int | None = None,
    headers: Mapping[str, str] | None = None,
    tracer: trace.Tracer | None = None,
) -> Span:
    """The router's root span, named "{operation} {model}" (GenAI semantic conventions).

    `operation` is "text_completion", "chat" or "generate". A `traceparent` in the client's
    `headers` makes the span its child. The caller ends it with `end_span`.
    """
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.provider.name": "pdengine",
    }
    if max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = max_tokens
    if temperature is not None:
        attributes["gen_ai.request.temperature"] = float(temperature)
    if input_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = input_tokens
    parent = extract_context(headers) if headers else None
    return (tracer or get_tracer()).start_span(
        f"{operation} {model}", context=parent, kind=SpanKind.SERVER, attributes=attributes
    )


def record_usage(
    span: Span,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    finish_reason: str | None = None,
) -> None:
    if input_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
    if output_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    if finish_reason is not None:
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])


def start_worker_span(
    role: str,
    headers: Mapping[str, str],
    *,
    room_id: int | None = None,
    tracer: trace.Tracer | None = None,
    **attributes: Any,
) -> Span:
    """A worker's span for one request, child of the router's span carried in `headers`."""
    attrs: dict[str, Any] = {"pdengine.role": role}
    if room_id is not None:
        attrs["pdengine.room.id"] = str(room_id)
    attrs.update({f"pdengine.{k}": v for k, v in attributes.items() if v is not None})
    return (tracer or get_tracer()).start_span(
        f"{role} request", context=extract_context(headers), kind=SpanKind.SERVER, attributes=attrs
    )


def end_span(span: Span, error: BaseException | str | None = None) -> None:
    """End `span`, marking it failed with `error`'s message when given."""
    if error is not None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        span.set_status(Status(StatusCode.ERROR, message))
        if isinstance(error, BaseException):
            span.record_exception(error)
    span.end()


# ---------------------------------------------------------------- room spans


def room_attributes(room: Any) -> dict[str, Any]:
    """What a room (pdengine.fsm.Room or look-alike) says about itself, as span attributes."""
    out: dict[str, Any] = {}
    for field, key in (("num_tokens", "tokens"), ("nbytes", "bytes"), ("peer", "peer")):
        value = getattr(room, field, None)
        if isinstance(value, int | float | str) and value != "":
            out[key] = value
    for field, key in (("pages", "pages"), ("dst_pages", "dst_pages"), ("chunks_done", "chunks")):
        value = getattr(room, field, None)
        if isinstance(value, tuple | list | set | frozenset) and value:
            out[key] = len(value)
    reason = str(getattr(room, "reason", "") or "")
    if reason:
        out["failure_reason"] = reason
    if "checksum" in reason.lower():
        out["checksum"] = "mismatch"
    elif getattr(room, "role", "") == "decode" and state_name(getattr(room, "state", "")) == "SUCCESS":
        out["checksum"] = "verified"  # a receiver only succeeds once every chunk verified
    aux = getattr(room, "aux", None)
    if isinstance(aux, dict):
        out.update({f"aux.{k}": v for k, v in aux.items() if isinstance(v, int | float | str)})
    return out


class RoomTracer:
    """One span per room on a worker, with a span event per FSM transition.

    Install `on_transition` as (or inside) the FSM's transition hook. `bind` is called from the
    request handler with the worker span as parent before the room is created; a room the hook
    reports without a binding gets a root span of its own. Ended rooms are remembered (bounded)
    so a late event can still be traced as a child of its room.
    """

    def __init__(
        self,
        role: str,
        tracer: trace.Tracer | None = None,
        *,
        page_nbytes: int = 0,
        remember_ended: int = 4096,
    ) -> None:
        self.role = role
        self.page_nbytes = page_nbytes  # KV bytes per page: a room's bytes = pages x this
        self._tracer = tracer
        self._live: dict[int, Span] = {}
        self._ended: OrderedDict[int, Span] = OrderedDict()
        self._remember_ended = remember_ended

    @property
    def tracer(self) -> trace.Tracer:
        return self._tracer or get_tracer()

    @property
    def live_rooms(self) -> int:
        return len(self._live)

    def bind(self, room_id: int, parent: Span | otel_context.Context | None = None, **attrs: Any) -> Span:
        """Open the room's span now, as a child of `parent` (a span or a context)."""
        if room_id in self._live:
            return self._live[room_id]
        ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
        span = self.tracer.start_span(
            f"room {self.role}",
            context=ctx,
            attributes={"pdengine.room.id": str(room_id), "pdengine.role": self.role},
        )
        if span.is_recording():  # no exporter configured: keep no bookkeeping
            self._live[room_id] = span
            self.set(room_id, **attrs)
        return span

    def set(self, room_id: int, **attrs: Any) -> None:
        """Set `pdengine.room.<key>` attributes (tokens, pages, bytes, checksum_ok, ...)."""
        span = self._live.get(room_id)
        if span is None:
            return
        for key, value in attrs.items():
            if value is not None:
                span.set_attribute(f"pdengine.room.{key}", value)

    def on_transition(self, room: Any, trigger: str, src: Any, dst: Any, absorbed: bool) -> None:
        """The FSM hook: one span event per transition; the span ends at a terminal state."""
        try:
            self._on_transition(room, trigger, src, dst, absorbed)
        except Exception:  # tracing must never break the room actor's loop
            log.exception("room tracing failed for trigger %s", trigger)

    def _on_transition(self, room: Any, trigger: str, src: Any, dst: Any, absorbed: bool) -> None:
        room_id = int(getattr(room, "room_id", getattr(room, "id", -1)))
        src_name, dst_name = state_name(src), state_name(dst)
        event: dict[str, Any] = {"from": src_name, "to": dst_name, "trigger": trigger}
        # The FSM reports absorbed events with dst == src: late on a terminal room (I1),
        # invalid (duplicate / out of order) on a live one.
        event["late"] = absorbed and src_name in TERMINAL_STATES
        if absorbed and not event["late"]:
            event["absorbed"] = True
        span = self._live.get(room_id)
        if span is None and event["late"] and room_id in self._ended:
            self._trace_late(room_id, event)
            return
        if span is None:
            span = self.bind(room_id)
            if room_id not in self._live:
                return
        span.add_event("transition", event)
        if dst_name in TERMINAL_STATES and not absorbed:
            attrs = room_attributes(room)
            if self.page_nbytes and "pages" in attrs:
                attrs["bytes"] = attrs["pages"] * self.page_nbytes
            self.set(room_id, **attrs)
            self._end(room_id, dst_name, trigger)

    def finish(self, room_id: int, error: BaseException | str | None = None) -> None:
        """Close the room's span if the FSM never terminated it (the request ended first)."""
        span = self._live.get(room_id)
        if span is None:
            return
        if error is not None:
            self.set(room_id, failure_reason=str(error))
        span.set_attribute("pdengine.room.closed_by", "request")
        self._end(room_id, None, None)

    def _end(self, room_id: int, state: str | None, trigger: str | None) -> None:
        span = self._live.pop(room_id)
        if state is not None:
            span.set_attribute("pdengine.room.final_state", state)
        if state == "FAILED":
            reason = (getattr(span, "attributes", None) or {}).get("pdengine.room.failure_reason")
            span.set_status(Status(StatusCode.ERROR, str(reason or trigger)))
        span.end()
        self._ended[room_id] = span
        while len(self._ended) > self._remember_ended:
            self._ended.popitem(last=False)

    def _trace_late(self, room_id: int, event: dict[str, Any]) -> None:
        parent = trace.set_span_in_context(self._ended[room_id])
        span = self.tracer.start_span(
            f"room {self.role} late event",
            context=parent,
            attributes={"pdengine.room.id": str(room_id), "pdengine.room.late": True},
        )
        span.add_event("transition", event)
        span.end()


def compose_hooks(*hooks: Callable[..., None] | None) -> Callable[..., None]:
    """One FSM transition hook that calls each given hook in order (None entries skipped)."""
    active = [h for h in hooks if h is not None]

    def hook(room: Any, trigger: str, src: Any, dst: Any, absorbed: bool) -> None:
        for h in active:
            h(room, trigger, src, dst, absorbed)

    return hook
