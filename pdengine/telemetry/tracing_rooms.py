"""Room spans on a worker: one span per room, one span event per FSM transition.

Lifecycle on a worker, per request:

1. The HTTP handler opens a `WorkerRequestTrace(role, headers, room_id, room_tracer)`: the
   worker's request span (child of the router's, from ``traceparent``) and, bound under it,
   the room's span — opened before the room exists.
2. `RoomTracer.on_transition` is (part of) the FSM's transition hook: every transition adds a
   ``transition`` event (from, to, trigger, late) to the room's span; at SUCCESS or FAILED the
   room's attributes (pages, bytes, chunks, peer, checksum, failure reason) are copied on and
   the span ends. An event absorbed after that becomes a short child span marked late (I1).
3. The handler (or, for a stream, the end of the stream) calls `WorkerRequestTrace.close`,
   which ends the request span. A room span still open then is left to the FSM for
   `request_grace_s` (a disconnect's abort arrives milliseconds later); a room that never
   reaches the FSM (the request was refused first) is closed when the grace runs out.
   Transitions of a room whose span already ended become short child spans, never a new root.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import Tracer as SDKTracer
from opentelemetry.trace import Span, Status, StatusCode

from pdengine.telemetry.metrics import state_name
from pdengine.telemetry.tracing import end_span, get_tracer, is_enabled, start_worker_span

log = logging.getLogger(__name__)

TERMINAL_STATES = frozenset({"SUCCESS", "FAILED"})


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
        out["checksum"] = "verified"  # a receiver succeeds only once every chunk verified
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
        request_grace_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.role = role
        self.page_nbytes = page_nbytes  # KV bytes per page: a room's bytes = pages x this
        self._tracer = tracer
        self._given_sdk_tracer = isinstance(tracer, SDKTracer)
        self._live: dict[int, Span] = {}
        self._ended: OrderedDict[int, Span] = OrderedDict()
        self._remember_ended = remember_ended
        self._grace_s = request_grace_s
        self._clock = clock
        self._closing: OrderedDict[int, float] = OrderedDict()  # room -> when to give up on it

    @property
    def tracer(self) -> trace.Tracer:
        return self._tracer or get_tracer()

    @property
    def recording(self) -> bool:
        """Whether spans are recorded: an SDK tracer was given, or `setup_tracing` installed one."""
        return self._given_sdk_tracer or is_enabled()

    @property
    def live_rooms(self) -> int:
        return len(self._live)

    def bind(
        self, room_id: int, parent: Span | otel_context.Context | None = None, **attrs: Any
    ) -> Span:
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
        if not self._live and not self._ended and not self.recording:
            return  # tracing off (the default): cost one check per transition
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
        if span is None and room_id in self._ended:
            self._trace_after_end(room_id, event)
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
        self.sweep()

    def finish(self, room_id: int, error: BaseException | str | None = None) -> None:
        """The room's request ended: leave a still-open room span to the FSM for the grace."""
        span = self._live.get(room_id)
        if span is not None:
            if error is not None:
                self.set(room_id, failure_reason=str(error))
            span.set_attribute("pdengine.room.request_ended", True)
            self._closing[room_id] = self._clock() + self._grace_s
        self.sweep()

    def sweep(self, now: float | None = None) -> None:
        """End the spans of rooms the FSM never terminated within the grace after their request."""
        now = self._clock() if now is None else now
        while self._closing:
            room_id, due = next(iter(self._closing.items()))
            if due > now:
                return
            del self._closing[room_id]
            if room_id in self._live:
                self._live[room_id].set_attribute("pdengine.room.closed_by", "request")
                self._end(room_id, None, None)

    def _end(self, room_id: int, state: str | None, trigger: str | None) -> None:
        self._closing.pop(room_id, None)
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

    def _trace_after_end(self, room_id: int, event: dict[str, Any]) -> None:
        """A transition after the room's span ended: a short child span of it."""
        parent = trace.set_span_in_context(self._ended[room_id])
        what = "late event" if event["late"] else "after request"
        span = self.tracer.start_span(
            f"room {self.role} {what}",
            context=parent,
            attributes={"pdengine.room.id": str(room_id), "pdengine.room.late": event["late"]},
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


class WorkerRequestTrace:
    """A worker's span for one request plus its room's span; `close` ends both (idempotent)."""

    def __init__(
        self,
        role: str,
        headers: Mapping[str, str],
        room_id: int,
        rooms: RoomTracer,
        **attrs: Any,
    ) -> None:
        self.room_id = room_id
        self.rooms = rooms
        self.span = start_worker_span(role, headers, room_id=room_id, tracer=rooms.tracer)
        rooms.bind(room_id, self.span, **attrs)
        self._open = True

    def close(self, error: BaseException | str | None = None) -> None:
        if not self._open:
            return
        self._open = False
        self.rooms.finish(self.room_id, error)
        end_span(self.span, error)

    def __enter__(self) -> WorkerRequestTrace:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)
