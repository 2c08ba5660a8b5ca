"""The body every generation endpoint shares: run the request, then answer as JSON or SSE.

A `ResponseFormat` turns deltas into the wire objects of one API (OpenAI
completions, OpenAI chat, SGLang /generate). Errors before the first token
are HTTP errors with a status; errors after it end the stream with an
``{"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdengine.server.context import ServingContext
from pdengine.server.errors import error_from_exception
from pdengine.server.generation import Backend, RequestRun
from pdengine.server.sse import DONE, EventStream, event
from pdengine.telemetry import tracing
from pdengine.types import RequestAbortedError, RequestFailedError, SamplingParams, StreamDelta

log = logging.getLogger(__name__)


class ResponseFormat(Protocol):
    def start(self, run: RequestRun) -> list[dict[str, Any]]: ...

    def delta(self, run: RequestRun, delta: StreamDelta) -> list[dict[str, Any]]: ...

    def end(self, run: RequestRun) -> list[dict[str, Any]]: ...

    def full(self, run: RequestRun, deltas: list[StreamDelta]) -> dict[str, Any]: ...


def check_finish(run: RequestRun) -> None:
    """A request that ended in abort or error is not a success."""
    if run.finish_reason == "abort":
        raise RequestAbortedError("request was aborted")
    if run.finish_reason == "error":
        raise RequestFailedError("request failed in the engine")


async def generate_response(
    request: Request,
    ctx: ServingContext,
    fmt: ResponseFormat,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    stream: bool,
    backend: Backend | None = None,
) -> Response:
    """Serve one request through `backend` (default: the app's); workers record no
    request metrics here (their own loops do), the colocated engine and router do."""
    metrics = ctx.metrics if backend is None else None
    span = None
    if backend is None:  # a public request: the root span of its trace
        span = tracing.start_request_span(
            tracing.operation_for_path(request.url.path), ctx.require_backend().model_name,
            max_tokens=params.max_tokens, temperature=params.temperature,
            input_tokens=len(prompt_token_ids), headers=request.headers)
        tracing.activate(span)  # the router's upstream calls carry it (traceparent)
    backend = backend or ctx.require_backend()
    try:
        run = RequestRun.open(backend, metrics, ctx.limiter, request_id, prompt_token_ids,
                              params, span=span)
    except BaseException as exc:
        if span is not None:
            tracing.end_span(span, exc)
        raise
    if not stream:
        try:
            deltas = await run.collect(request)
            check_finish(run)
            return JSONResponse(fmt.full(run, deltas))
        finally:
            await run.close()
    try:
        first = await run.first(request)
    except BaseException:
        await run.close()
        raise
    return EventStream(_events(run, first, fmt))


async def _events(run: RequestRun, first: StreamDelta | None, fmt: ResponseFormat
                  ) -> AsyncIterator[bytes]:
    try:
        try:
            for obj in fmt.start(run):
                yield event(obj)
            if first is not None:
                for obj in fmt.delta(run, first):
                    yield event(obj)
            async for delta in run.rest():
                for obj in fmt.delta(run, delta):
                    yield event(obj)
            check_finish(run)
            for obj in fmt.end(run):
                yield event(obj)
        except Exception as exc:  # after the first byte the status is sent: report in-band
            _, body = error_from_exception(exc)
            log.info("request %s ended with an error mid-stream: %s", run.request_id, exc)
            yield event(body)
        yield DONE
    finally:
        await run.close()
