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
3. A worker's HTTP handler opens its span (``start_worker_span``, child of the extracted
   context) and the room's span; the room span gets one event per FSM transition and ends
   when the room is terminal (``pdengine.telemetry.tracing_rooms``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, MutableMapping, Sequence
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

from pdengine.types import PDEngineError

log = logging.getLogger(__name__)

TRACE_FILE_ENV = "PDENGINE_TRACE_FILE"
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACER_NAME = "pdengine"

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


def is_enabled() -> bool:
    """Whether `setup_tracing` installed a provider in this process (spans are recorded)."""
    return _installed is not None


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
    """End `span`, marking it failed with `error`'s message when given.

    pdengine's own typed errors (a failed room, a refused request) are expected outcomes: they
    get `error.type` and the message; anything else is recorded with its stack trace.
    """
    if error is not None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        span.set_status(Status(StatusCode.ERROR, message))
        if isinstance(error, PDEngineError):
            span.set_attribute("error.type", type(error).__name__)
        elif isinstance(error, BaseException):
            span.record_exception(error)
    span.end()
