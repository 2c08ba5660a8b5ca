"""One generation request between an HTTP endpoint and a back-end.

A `Backend` is anything that streams `StreamDelta`s for a tokenized prompt:
the colocated engine (`EngineBackend`) or the router (`RouterBackend`). The
OpenAI and SGLang endpoints are written once against it.

Lifecycle of a `RequestRun`:
1. ``RequestRun.open(...)`` takes a concurrency slot (429 when none is free);
2. ``await run.first(request)`` waits for the first delta while watching the
   client: errors before the first token become proper HTTP errors, a client
   that leaves before it aborts the request;
3. ``run.rest()`` yields the remaining deltas;
4. ``await run.close()`` (always, in a ``finally``): aborts the request when it
   did not finish, closes the back-end stream, releases the slot, records e2e.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
from starlette.requests import Request

from pdengine.telemetry import tracing
from pdengine.telemetry.metrics import Metrics
from pdengine.types import OverloadedError, RequestAbortedError, SamplingParams, StreamDelta

T = TypeVar("T")


class Backend(Protocol):
    role: str
    model_name: str
    max_model_len: int
    tokenizer: Any

    def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[StreamDelta]: ...

    def abort(self, request_id: str) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def rooms_snapshot(self) -> list[dict[str, Any]]: ...


class ConcurrencyLimiter:
    """Counts requests in flight; refuses past `limit` with a 429."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def acquire(self) -> None:
        if self.in_flight >= self.limit:
            raise OverloadedError(f"too many concurrent requests (limit {self.limit}); retry later")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`; raise RequestAbortedError if the client disconnects first.

    Only valid after the request body was read (the next ASGI message is then
    the disconnect).
    """
    result: list[T] = []
    error: list[Exception] = []

    async def work(scope: anyio.CancelScope) -> None:
        try:
            result.append(await awaitable)
        except Exception as exc:  # re-raised below as itself, not wrapped in a group
            error.append(exc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(work, tg.cancel_scope)
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                tg.cancel_scope.cancel()
                break
    if error:
        raise error[0]
    if not result:
        raise RequestAbortedError("client disconnected")
    return result[0]


@dataclass
class RequestRun:
    backend: Backend
    metrics: Metrics | None  # None where the worker records its own metrics
    limiter: ConcurrencyLimiter
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    started: float = field(default_factory=time.perf_counter)
    completion_tokens: int = 0
    finish_reason: str | None = None
    _stream: AsyncIterator[StreamDelta] | None = None
    _last: float | None = None
    _closed: bool = False
    _exhausted: bool = False
    span: Any = None  # the request's root span (public endpoints), ended by close()
    error: Exception | None = None

    @classmethod
    def open(
        cls,
        backend: Backend,
        metrics: Metrics | None,
        limiter: ConcurrencyLimiter,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        span: Any = None,
    ) -> RequestRun:
        limiter.acquire()
        try:
            stream = backend.stream(prompt_token_ids, params, request_id)  # may refuse (4xx)
        except BaseException:
            limiter.release()
            raise
        run = cls(backend, metrics, limiter, request_id, prompt_token_ids, params, span=span)
        run._stream = stream
        return run

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def _account(self, delta: StreamDelta) -> StreamDelta:
        now = time.perf_counter()
        n = len(delta.token_ids)
        if n and self.metrics is not None:
            if self._last is None:
                self.metrics.observe_ttft(now - self.started)
            else:
                for _ in range(n):
                    self.metrics.observe_inter_token((now - self._last) / n)
        if n:
            self._last = now
        self.completion_tokens += n
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return delta

    async def _next(self) -> StreamDelta | None:
        assert self._stream is not None
        try:
            return self._account(await self._stream.__anext__())
        except StopAsyncIteration:
            self._exhausted = True
            return None
        except Exception as exc:
            self.error = exc  # the trace reports it; a stream that raised needs no abort
            raise

    async def first(self, request: Request | None) -> StreamDelta | None:
        """The first delta (None if the stream ended at once); watches `request` for a disconnect."""
        if request is None:
            return await self._next()
        return await until_disconnect(request, self._next())

    async def rest(self) -> AsyncIterator[StreamDelta]:
        while self.finish_reason is None:
            delta = await self._next()
            if delta is None:
                return
            yield delta

    async def collect(self, request: Request | None) -> list[StreamDelta]:
        """Every delta of a non-streaming request (watching the client for a disconnect)."""

        async def gather() -> list[StreamDelta]:
            deltas = []
            while (delta := await self._next()) is not None:
                deltas.append(delta)
                if delta.finish_reason is not None:
                    break
            return deltas

        if request is None:
            return await gather()
        return await until_disconnect(request, gather())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.finish_reason is None and not self._exhausted and self.error is None:
                self.backend.abort(self.request_id)
                if self.metrics is not None:
                    self.metrics.inc_aborted()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                aclose = getattr(self._stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        finally:
            self.limiter.release()
            if self.metrics is not None:
                self.metrics.observe_e2e(time.perf_counter() - self.started)
            if self.span is not None:
                tracing.record_usage(self.span, self.prompt_tokens, self.completion_tokens,
                                     self.finish_reason or "abort")
                failed = self.error or ("request failed" if self.finish_reason == "error" else None)
                tracing.end_span(self.span, failed)
