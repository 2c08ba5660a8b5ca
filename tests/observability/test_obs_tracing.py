"""Tracing helpers with the real OTel SDK: span tree, GenAI attributes, room events, trace file."""

from __future__ import annotations

import json
import multiprocessing
import os
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdengine.fsm import RoomActor, RoomState
from pdengine.fsm.events import Abort, Bootstrapped, ChunkDone, ChunkSent, CreateRoom
from pdengine.telemetry import tracing
from pdengine.telemetry.tracing_rooms import RoomTracer, WorkerRequestTrace, compose_hooks

State = RoomState


@pytest.fixture
def otel():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield SimpleNamespace(exporter=exporter, tracer=tracing.get_tracer(provider))
    provider.shutdown()


def _by_name(exporter: InMemorySpanExporter) -> dict[str, object]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_router_span_follows_genai_conventions(otel) -> None:
    span = tracing.start_request_span(
        "text_completion", "tiny", max_tokens=8, temperature=0.0, tracer=otel.tracer
    )
    tracing.record_usage(span, input_tokens=5, output_tokens=8, finish_reason="length")
    tracing.end_span(span)
    (finished,) = otel.exporter.get_finished_spans()
    assert finished.name == "text_completion tiny"
    attrs = finished.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.input_tokens"] == 5
    assert attrs["gen_ai.usage.output_tokens"] == 8
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert finished.parent is None


def test_traceparent_round_trip_builds_one_tree(otel) -> None:
    root = tracing.start_request_span("chat", "tiny", tracer=otel.tracer)
    headers = tracing.inject_headers({}, root)
    assert headers["traceparent"].split("-")[1] == f"{root.get_span_context().trace_id:032x}"
    # The worker sees the headers as HTTP delivers them (any case).
    worker = tracing.start_worker_span(
        "prefill", {"Traceparent": headers["traceparent"]}, room_id=7, tracer=otel.tracer
    )
    rooms = RoomTracer("prefill", tracer=otel.tracer)
    rooms.bind(7, worker, tokens=40)
    rooms.on_transition(SimpleNamespace(room_id=7), "succeed", State.TRANSFERRING, State.SUCCESS, False)
    tracing.end_span(worker)
    tracing.end_span(root)
    spans = _by_name(otel.exporter)
    trace_ids = {s.context.trace_id for s in spans.values()}
    assert len(trace_ids) == 1
    assert spans["prefill request"].parent.span_id == spans["chat tiny"].context.span_id
    assert spans["room prefill"].parent.span_id == spans["prefill request"].context.span_id
    assert spans["room prefill"].attributes["pdengine.room.tokens"] == 40


def test_client_traceparent_becomes_the_routers_parent(otel) -> None:
    outer = otel.tracer.start_span("client")
    headers = tracing.inject_headers(None, outer)
    root = tracing.start_request_span("generate", "tiny", headers=headers, tracer=otel.tracer)
    tracing.end_span(root)
    outer.end()
    spans = _by_name(otel.exporter)
    assert spans["generate tiny"].parent.span_id == outer.get_span_context().span_id


def _actor_with(rooms: RoomTracer) -> tuple[RoomActor, list[float]]:
    now = [0.0]
    return RoomActor(clock=lambda: now[0], hook=rooms.on_transition), now


def test_real_room_transitions_in_order_and_span_ends_at_terminal(otel) -> None:
    rooms = RoomTracer("decode", tracer=otel.tracer)
    actor, _ = _actor_with(rooms)
    rooms.bind(11, tokens=40)
    actor.apply(CreateRoom(11, "decode", peer="p0", pages=(3, 4, 5)))
    actor.apply(Bootstrapped(11, peer="p0"))
    actor.apply(ChunkDone(11, chunk=0))
    actor.apply(ChunkDone(11, chunk=0))  # duplicate delivery: absorbed, not late
    assert otel.exporter.get_finished_spans() == ()  # not terminal yet
    assert rooms.live_rooms == 1
    actor.apply(ChunkDone(11, chunk=1, is_last=True, aux={"first_token": 42}))
    (span,) = otel.exporter.get_finished_spans()
    assert rooms.live_rooms == 0
    seen = [(e.attributes["trigger"], e.attributes["from"], e.attributes["to"]) for e in span.events]
    assert seen == [
        ("bootstrap", "BOOTSTRAPPING", "WAITING_FOR_INPUT"),
        ("chunk_done", "WAITING_FOR_INPUT", "TRANSFERRING"),
        ("chunk_done", "TRANSFERRING", "TRANSFERRING"),
        ("chunk_done", "TRANSFERRING", "TRANSFERRING"),
        ("succeed", "TRANSFERRING", "SUCCESS"),
    ]
    assert [e.attributes.get("absorbed", False) for e in span.events] == [0, 0, 1, 0, 0]
    assert not any(e.attributes["late"] for e in span.events)
    attrs = span.attributes
    assert attrs["pdengine.room.pages"] == 3 and attrs["pdengine.room.tokens"] == 40
    assert attrs["pdengine.room.chunks"] == 2
    assert attrs["pdengine.room.checksum"] == "verified"
    assert attrs["pdengine.room.aux.first_token"] == 42
    assert attrs["pdengine.room.final_state"] == "SUCCESS"


def test_checksum_failure_and_late_event_on_a_real_room(otel) -> None:
    rooms = RoomTracer("decode", tracer=otel.tracer)
    actor, _ = _actor_with(rooms)
    actor.apply(CreateRoom(5, "decode", peer="p0", pages=(1,)))  # unbound: a root span
    actor.apply(ChunkSent(5, chunk=0))
    actor.apply(ChunkDone(5, chunk=0, checksum_ok=False))
    actor.apply(Abort(5, reason="client gone"))  # absorbed by the FAILED room: late
    spans = _by_name(otel.exporter)
    failed, late = spans["room decode"], spans["room decode late event"]
    assert failed.parent is None
    assert failed.status.status_code.name == "ERROR"
    assert "checksum mismatch in chunk 0" in failed.status.description
    assert failed.attributes["pdengine.room.checksum"] == "mismatch"
    assert failed.events[-1].attributes["to"] == "FAILED"
    assert late.parent.span_id == failed.context.span_id
    (event,) = late.events
    assert event.attributes["late"] is True and event.attributes["trigger"] == "abort"


def test_a_room_that_never_reaches_the_fsm_closes_after_the_grace(otel) -> None:
    now = [100.0]
    rooms = RoomTracer("decode", tracer=otel.tracer, request_grace_s=10.0, clock=lambda: now[0])
    rooms.bind(9)
    rooms.finish(9, error=ValueError("prompt too long"))
    rooms.finish(9)  # a second close changes nothing
    assert otel.exporter.get_finished_spans() == ()  # an abort may still be on its way
    now[0] += 10.5
    rooms.sweep()
    (span,) = otel.exporter.get_finished_spans()
    assert span.attributes["pdengine.room.closed_by"] == "request"
    assert "prompt too long" in span.attributes["pdengine.room.failure_reason"]
    assert rooms.live_rooms == 0


def test_a_disconnect_then_the_abort_stays_one_room_span(otel) -> None:
    now = [0.0]
    rooms = RoomTracer("decode", tracer=otel.tracer, clock=lambda: now[0])
    actor = RoomActor(clock=lambda: now[0], hook=rooms.on_transition)
    rooms.bind(4)
    actor.apply(CreateRoom(4, "decode", peer="p0", pages=(1, 2)))
    actor.apply(Bootstrapped(4, peer="p0"))
    rooms.finish(4)  # the client went away: the stream closed before the abort was applied
    now[0] += 0.002
    actor.apply(Abort(4, reason="client disconnected"))
    (span,) = otel.exporter.get_finished_spans()
    assert [e.attributes["trigger"] for e in span.events] == ["bootstrap", "abort"]
    assert span.attributes["pdengine.room.final_state"] == "FAILED"
    assert span.attributes["pdengine.room.request_ended"] is True
    assert "pdengine.room.closed_by" not in span.attributes


def test_transitions_after_a_closed_span_are_children_not_new_roots(otel) -> None:
    now = [0.0]
    rooms = RoomTracer("prefill", tracer=otel.tracer, request_grace_s=1.0, clock=lambda: now[0])
    actor = RoomActor(clock=lambda: now[0], hook=rooms.on_transition)
    rooms.bind(6)
    rooms.finish(6, "router disconnected")
    now[0] += 2.0
    rooms.sweep()
    actor.apply(CreateRoom(6, "prefill", peer="d0", pages=(3,), num_chunks=1))  # very late
    actor.apply(Abort(6))
    spans = otel.exporter.get_finished_spans()
    assert [s.name for s in spans] == ["room prefill", "room prefill after request"]
    assert spans[1].parent.span_id == spans[0].context.span_id
    assert spans[1].events[0].attributes["trigger"] == "abort"


def test_hook_errors_never_escape(otel, caplog) -> None:
    rooms = RoomTracer("decode", tracer=otel.tracer)
    rooms.on_transition(SimpleNamespace(room_id="not-an-int"), "abort", 1, 0, False)
    assert "room tracing failed" in caplog.text


def test_without_exporter_nothing_is_recorded(monkeypatch) -> None:
    monkeypatch.delenv(tracing.TRACE_FILE_ENV, raising=False)
    monkeypatch.delenv(tracing.OTLP_ENDPOINT_ENV, raising=False)
    assert tracing.build_provider("pdengine-test") is None
    from opentelemetry.trace import NoOpTracer

    rooms = RoomTracer("decode", tracer=NoOpTracer())
    rooms.bind(1)
    rooms.on_transition(SimpleNamespace(room_id=1), "abort", State.BOOTSTRAPPING, State.FAILED, False)
    assert rooms.live_rooms == 0


def test_compose_hooks_calls_each_in_order() -> None:
    calls: list[str] = []
    hook = compose_hooks(
        lambda *a: calls.append("metrics"), None, lambda *a: calls.append("trace")
    )
    hook(SimpleNamespace(room_id=1), "abort", 1, 0, False)
    assert calls == ["metrics", "trace"]


def _write_spans(path: str, service: str, count: int) -> None:
    provider = tracing.build_provider(service, trace_file=path, otlp=False)
    tracer = tracing.get_tracer(provider)
    for i in range(count):
        span = tracer.start_span(f"{service}-{i}", attributes={"payload": "x" * 2000})
        span.add_event("transition", {"trigger": "t", "late": False})
        span.end()
    provider.shutdown()


def test_trace_file_lines_from_several_processes_stay_whole(tmp_path) -> None:
    path = str(tmp_path / "trace.jsonl")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_spans, args=(path, f"svc{i}", 200)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert len(lines) == 600
    records = [json.loads(line) for line in lines]  # a torn line would not parse
    assert {r["service"] for r in records} == {"svc0", "svc1", "svc2"}
    assert len({r["pid"] for r in records}) == 3
    first = records[0]
    assert set(first) >= {"trace_id", "span_id", "parent_id", "name", "start_ns", "end_ns"}
    assert first["events"][0]["attributes"] == {"trigger": "t", "late": False}
    assert len(first["trace_id"]) == 32 and first["end_ns"] >= first["start_ns"]


def test_trace_file_from_environment(tmp_path, monkeypatch) -> None:
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv(tracing.TRACE_FILE_ENV, os.fspath(path))
    provider = tracing.build_provider("pdengine-router")
    assert provider is not None
    tracing.get_tracer(provider).start_span("one").end()
    provider.shutdown()
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record["name"] == "one" and record["service"] == "pdengine-router"


def test_activated_span_reaches_tasks_started_later(otel) -> None:
    import anyio

    seen: list[str] = []

    async def request_task() -> None:
        span = tracing.start_request_span("chat", "tiny", tracer=otel.tracer)
        tracing.activate(span)  # the handler's task: every task it starts sees the span

        async def upstream_call() -> None:
            seen.append(tracing.inject_headers({})["traceparent"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(upstream_call)
        tracing.end_span(span)
        seen.append(f"{span.get_span_context().span_id:016x}")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(request_task)
        assert "traceparent" not in tracing.inject_headers({})  # not leaked to the parent

    anyio.run(main)
    header, span_id = seen
    assert header.split("-")[2] == span_id


def test_operation_names_of_the_public_endpoints() -> None:
    assert tracing.operation_for_path("/v1/completions") == "text_completion"
    assert tracing.operation_for_path("/v1/chat/completions") == "chat"
    assert tracing.operation_for_path("/generate") == "generate"


def test_room_bytes_follow_its_pages(otel) -> None:
    rooms = RoomTracer("prefill", tracer=otel.tracer, page_nbytes=4096)
    actor, _ = _actor_with(rooms)
    actor.apply(CreateRoom(3, "prefill", peer="d0", pages=(7, 8), num_chunks=1))
    actor.apply(Bootstrapped(3, peer="d0", dst_pages=(1, 2)))
    actor.apply(ChunkSent(3, chunk=0))
    actor.apply(ChunkDone(3, chunk=0, is_last=True))
    (span,) = otel.exporter.get_finished_spans()
    assert span.attributes["pdengine.room.bytes"] == 2 * 4096
    assert span.attributes["pdengine.room.dst_pages"] == 2
    assert "pdengine.room.checksum" not in span.attributes  # the sender verifies nothing


def test_worker_request_trace_closes_span_and_unfinished_room_once(otel) -> None:
    root = tracing.start_request_span("generate", "tiny", tracer=otel.tracer)
    now = [0.0]
    rooms = RoomTracer("decode", tracer=otel.tracer, clock=lambda: now[0])
    headers = tracing.inject_headers({}, root)
    with pytest.raises(ValueError), WorkerRequestTrace("decode", headers, 21, rooms, tokens=9):
        raise ValueError("prompt too long")
    tracing.end_span(root)
    now[0] += 60.0
    rooms.sweep()
    spans = _by_name(otel.exporter)
    request, room = spans["decode request"], spans["room decode"]
    assert request.parent.span_id == root.get_span_context().span_id
    assert room.parent.span_id == request.context.span_id
    assert request.status.status_code.name == "ERROR"
    assert room.attributes["pdengine.room.closed_by"] == "request"
    assert room.attributes["pdengine.room.tokens"] == 9
    assert rooms.live_rooms == 0


def test_typed_errors_are_outcomes_other_errors_keep_their_stack(otel) -> None:
    from pdengine.types import RequestFailedError

    typed = otel.tracer.start_span("typed")
    tracing.end_span(typed, RequestFailedError("room 7 failed on prefill: timeout"))
    crash = otel.tracer.start_span("crash")
    try:
        raise KeyError("bug")
    except KeyError as exc:
        tracing.end_span(crash, exc)
    spans = _by_name(otel.exporter)
    assert spans["typed"].attributes["error.type"] == "RequestFailedError"
    assert "timeout" in spans["typed"].status.description and not spans["typed"].events
    (event,) = spans["crash"].events
    assert event.name == "exception" and "KeyError" in event.attributes["exception.stacktrace"]


def test_otlp_without_its_package_is_skipped_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.delenv(tracing.TRACE_FILE_ENV, raising=False)
    monkeypatch.setenv(tracing.OTLP_ENDPOINT_ENV, "http://127.0.0.1:4317")
    try:
        import opentelemetry.exporter.otlp  # noqa: F401
    except ImportError:
        assert tracing.build_provider("pdengine-router") is None
        assert "opentelemetry-exporter-otlp is not installed" in caplog.text
    else:
        provider = tracing.build_provider("pdengine-router")
        assert provider is not None
        provider.shutdown()
