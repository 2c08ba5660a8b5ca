"""Public endpoints of a prefill or decode worker, called by the router.

- prefill ``POST /generate`` ``{"input_ids", "sampling_params", "bootstrap_room"}``:
  runs `PrefillWorker.prefill` and answers when the room is terminal
  (``{"room_id", "state", "reason"}``; a FAILED room is a 502).
- decode ``POST /generate`` ``{"input_ids", "sampling_params", "bootstrap_room",
  "bootstrap_host", "stream", "rid"?}``: `DecodeWorker.stream` as SGLang-style
  output (SSE when streaming).
- ``POST /abort_request`` ``{"rid"}`` or ``{"bootstrap_room"}``.

A client (the router) that disconnects aborts the room: the prefill call is
cancelled and the room aborted; the decode stream is closed, which aborts the
room on both sides.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdengine.server.context import ServingContext, public_json
from pdengine.server.generate_api import SGLangFormat, request_id_of
from pdengine.server.generation import until_disconnect
from pdengine.server.openai_api import check_fits
from pdengine.server.params import need_bool, params_from_sglang, token_ids
from pdengine.server.serving import generate_response
from pdengine.telemetry.tracing_rooms import WorkerRequestTrace
from pdengine.types import InvalidRequestError, RequestAbortedError, SamplingParams, StreamDelta

MAX_ROOM_ID = (1 << 63) - 1


def room_of(body: dict[str, Any]) -> int:
    room = body.get("bootstrap_room")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room <= MAX_ROOM_ID:
        raise InvalidRequestError("bootstrap_room", "must be an integer in [0, 2**63)")
    return room


class _WorkerView:
    """The worker as a `Backend` for one decode request (room and prefill peer fixed)."""

    role = "decode"

    def __init__(self, ctx: ServingContext, room: int, prefill_url: str,
                 trace: WorkerRequestTrace | None = None) -> None:
        self.trace = trace
        self.worker = ctx.worker
        self.room = room
        self.prefill_url = prefill_url
        self.rooms_by_rid: dict[str, int] = ctx.extras.setdefault("rooms_by_rid", {})
        self.model_name = self.worker.model_name
        self.max_model_len = self.worker.max_model_len
        self.tokenizer = self.worker.tokenizer

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[StreamDelta]:
        inner = self.worker.stream(self.room, prompt_token_ids, params, self.prefill_url,
                                   request_id=request_id)  # a refusal raises before any state
        self.rooms_by_rid[request_id] = self.room
        try:
            async for delta in inner:
                yield delta
        finally:
            self.rooms_by_rid.pop(request_id, None)
            await inner.aclose()
            if self.trace is not None:
                self.trace.close()

    def abort(self, request_id: str) -> bool:
        self.worker.abort(self.room, "aborted by the client")
        return True

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    def rooms_snapshot(self) -> list[dict[str, Any]]:
        return self.worker.rooms_snapshot()


def _common(ctx: ServingContext, body: dict[str, Any]) -> tuple[int, list[int], SamplingParams]:
    room = room_of(body)
    params = params_from_sglang(body.get("sampling_params"))
    ids = token_ids("input_ids", body.get("input_ids"),
                    getattr(ctx.worker.tokenizer, "vocab_size", None))
    return room, ids, params


async def prefill_generate(request: Request) -> Response:
    ctx, body = await public_json(request)
    room, ids, params = _common(ctx, body)
    with WorkerRequestTrace("prefill", request.headers, room, ctx.worker.room_tracer,
                            tokens=len(ids)):
        check_fits(ctx.worker, ids, params, "input_ids")
        ctx.limiter.acquire()
        try:
            result = await until_disconnect(request, ctx.worker.prefill(room, ids, params))
        except RequestAbortedError:
            ctx.worker.abort(room, "router disconnected")
            raise
        finally:
            ctx.limiter.release()
    return JSONResponse(result)


async def decode_generate(request: Request) -> Response:
    ctx, body = await public_json(request)
    room, ids, params = _common(ctx, body)
    prefill_url = body.get("bootstrap_host")
    if not isinstance(prefill_url, str) or not prefill_url.startswith(("http://", "https://")):
        raise InvalidRequestError("bootstrap_host", "must be the prefill worker's base URL")
    stream = need_bool("stream", body.get("stream", False))
    trace = WorkerRequestTrace("decode", request.headers, room, ctx.worker.room_tracer,
                               tokens=len(ids))
    view = _WorkerView(ctx, room, prefill_url, trace)  # the stream's end closes the trace
    try:
        check_fits(view, ids, params, "input_ids")
        return await generate_response(request, ctx, SGLangFormat(), request_id_of(body), ids,
                                       params, stream, backend=view)
    except BaseException as exc:
        trace.close(exc)
        raise


async def worker_abort(request: Request) -> Response:
    ctx, body = await public_json(request)
    if "bootstrap_room" in body:
        room = room_of(body)
    else:
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("rid", "give rid or bootstrap_room")
        room = ctx.extras.get("rooms_by_rid", {}).get(rid)
        if room is None:
            abort_request = getattr(ctx.worker, "abort_request", None)
            found = bool(abort_request(rid, "aborted by /abort_request")) if abort_request else False
            return JSONResponse({"rid": rid, "aborted": found})
    found = ctx.worker.abort(room, "aborted by /abort_request")
    return JSONResponse({"bootstrap_room": room, "aborted": found is not False})

