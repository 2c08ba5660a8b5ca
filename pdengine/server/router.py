"""The router: one public endpoint set in front of prefill and decode workers.

Per request (`RouterBackend.stream`):
1. pick a (prefill, decode) pair (``round_robin`` or ``least_loaded``) among
   healthy workers and make a random 63-bit room id;
2. POST the tokenized prompt to the prefill worker's ``/generate`` and, at the
   same time, to the decode worker's ``/generate`` with ``stream: true`` and
   ``bootstrap_host`` = the prefill URL;
3. translate the decode side's cumulative SSE output into `StreamDelta`s that
   the OpenAI / SGLang endpoints format for the client.

Each request runs as a task of the router's own task group (owned by the
lifespan) and hands deltas over a memory stream. The client's stream closing
(disconnect, `/abort_request`) cancels that task: both upstream HTTP requests
are closed, and each worker aborts the room (and tells its peer). If either side
fails before anything reached the client, the request is retried once on
another pair with a new room; after that the stream ends with an error event.
A background task polls every worker's ``/health`` (pid, model length, health).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from pdengine.server.params import params_to_json
from pdengine.server.sse import parse_events
from pdengine.telemetry.tracing import inject_headers
from pdengine.types import (
    InvalidRequestError,
    OverloadedError,
    PDEngineError,
    SamplingParams,
    StreamDelta,
)

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded")
HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 5.0
MAX_MISSED_POLLS = 3  # a busy worker may answer slowly; one that refuses connections is down
PREFILL_GRACE_S = 5.0
UPSTREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)


@dataclass
class WorkerRef:
    role: str  # prefill | decode
    url: str
    healthy: bool = True
    missed_polls: int = 0
    pid: int | None = None
    max_model_len: int | None = None
    in_flight: int = 0

    def describe(self) -> dict[str, Any]:
        return {"role": self.role, "url": self.url, "pid": self.pid, "healthy": self.healthy,
                "in_flight": self.in_flight}


class UpstreamError(PDEngineError):
    """A worker answered with an error (or not at all); `status` is what the client gets."""

    def __init__(self, message: str, status: int = 502, retryable: bool = True,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.retryable = retryable
        self.field = param


@dataclass
class _Attempt:
    prefill: WorkerRef
    decode: WorkerRef
    room: int
    worker_rid: str  # the request id the workers see: a retry must not collide with the first
    sent_any: bool = False
    prefill_result: dict[str, Any] | None = None


class RouterBackend:
    """A `Backend` whose engine is a set of prefill/decode workers behind HTTP."""

    role = "router"

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, model_name: str,
                 tokenizer: Any, max_model_len: int, policy: str = "round_robin",
                 api_key: str = "") -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one prefill and one decode worker")
        if policy not in POLICIES:
            raise InvalidRequestError("policy", f"must be one of {POLICIES}")
        self.prefill = [WorkerRef("prefill", u.rstrip("/")) for u in prefill_urls]
        self.decode = [WorkerRef("decode", u.rstrip("/")) for u in decode_urls]
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.policy = policy
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._rr = itertools.count()
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._tg: TaskGroup | None = None
        self._client: httpx.AsyncClient | None = None

    # ---- lifecycle (called by the router app's lifespan) ------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT, limits=limits,
                                     headers=self._headers) as client, \
                anyio.create_task_group() as tg:
            self._client, self._tg = client, tg
            await self.poll_health()
            tg.start_soon(self._health_loop)
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None
                tg.cancel_scope.cancel()

    async def _health_loop(self) -> None:
        while True:
            await anyio.sleep(HEALTH_INTERVAL_S)
            await self.poll_health()

    async def poll_health(self) -> None:
        async def check(w: WorkerRef) -> None:
            assert self._client is not None
            try:
                r = await self._client.get(w.url + "/health", timeout=HEALTH_TIMEOUT_S)
                body = r.json() if r.status_code == 200 else {}
                w.healthy = r.status_code == 200
                w.missed_polls = 0 if w.healthy else MAX_MISSED_POLLS
                w.pid = body.get("pid", w.pid)
                w.max_model_len = body.get("max_model_len", w.max_model_len)
            except httpx.TimeoutException:
                w.missed_polls += 1
                w.healthy = w.missed_polls < MAX_MISSED_POLLS
            except (httpx.HTTPError, ValueError):
                w.missed_polls = MAX_MISSED_POLLS
                w.healthy = False

        async with anyio.create_task_group() as tg:
            for w in self.workers():
                tg.start_soon(check, w)
        known = [w.max_model_len for w in self.workers() if w.max_model_len]
        if known:
            self.max_model_len = min(known)

    def workers(self) -> list[WorkerRef]:
        return self.prefill + self.decode

    # ---- Backend protocol ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self._scopes), "num_queue_reqs": 0}

    def rooms_snapshot(self) -> list[dict[str, Any]]:
        return []  # the router holds no rooms; /debug/rooms on the router asks the workers

    def abort(self, request_id: str) -> bool:
        scope = self._scopes.get(request_id)
        if scope is None:
            return False
        scope.cancel()
        return True

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[StreamDelta]:
        if self._tg is None:
            raise OverloadedError("the router is not running")
        if request_id in self._scopes:
            raise InvalidRequestError("rid", f"{request_id!r} is already running")
        send, receive = anyio.create_memory_object_stream[StreamDelta | BaseException](math.inf)
        scope = anyio.CancelScope()
        self._scopes[request_id] = scope
        self._tg.start_soon(self._serve, scope, send, prompt_token_ids, params, request_id)
        finished = False
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, BaseException):
                        raise item
                    finished = item.finish_reason is not None
                    yield item
            if not finished:
                yield StreamDelta(request_id, [], "", finish_reason="abort")
        finally:
            scope.cancel()
            self._scopes.pop(request_id, None)

    # ---- one request ----------------------------------------------------------------------------

    def pick_pair(self, avoid: set[tuple[str, str]]) -> tuple[WorkerRef, WorkerRef]:
        prefills = [w for w in self.prefill if w.healthy] or self.prefill
        decodes = [w for w in self.decode if w.healthy] or self.decode
        pairs = [(p, d) for p in prefills for d in decodes]
        fresh = [pd for pd in pairs if (pd[0].url, pd[1].url) not in avoid] or pairs
        if self.policy == "least_loaded":
            return min(fresh, key=lambda pd: (pd[0].in_flight + pd[1].in_flight))
        return fresh[next(self._rr) % len(fresh)]

    async def _serve(self, scope: anyio.CancelScope,
                     send: MemoryObjectSendStream[StreamDelta | BaseException],
                     ids: list[int], params: SamplingParams, request_id: str) -> None:
        tried: set[tuple[str, str]] = set()
        async with send:
            with scope:
                try:
                    for attempt in range(2):
                        p, d = self.pick_pair(tried)
                        tried.add((p.url, d.url))
                        rid = request_id if attempt == 0 else f"{request_id}.retry{attempt}"
                        state = _Attempt(p, d, secrets.randbits(63), rid)
                        try:
                            await self._attempt(state, send, ids, params, request_id)
                            return
                        except UpstreamError as exc:
                            if state.sent_any or not exc.retryable or attempt == 1:
                                raise
                            log.warning("request %s: %s; retrying on another pair",
                                        request_id, exc)
                except Exception as exc:  # never let one request take the router down
                    if not isinstance(exc, UpstreamError):
                        log.exception("request %s failed in the router", request_id)
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        send.send_nowait(exc)  # unless the client already left

    async def _attempt(self, a: _Attempt, send: MemoryObjectSendStream[StreamDelta | BaseException],
                       ids: list[int], params: SamplingParams, request_id: str) -> None:
        sp = params_to_json(params)
        prefill_body = {"input_ids": ids, "sampling_params": sp, "bootstrap_room": a.room,
                        "rid": a.worker_rid}
        decode_body = {**prefill_body, "bootstrap_host": a.prefill.url, "stream": True}
        a.prefill.in_flight += 1
        a.decode.in_flight += 1
        prefill_done = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:

                async def prefill_side() -> None:
                    a.prefill_result = await self._prefill(a, prefill_body)
                    prefill_done.set()

                tg.start_soon(prefill_side)
                await self._decode(a, decode_body, send, request_id)
                # The prefill answers when its room is terminal, normally before the last
                # token; do not hold a finished request hostage to it.
                with anyio.move_on_after(PREFILL_GRACE_S):
                    await prefill_done.wait()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _first_upstream(group) from None
        finally:
            a.prefill.in_flight -= 1
            a.decode.in_flight -= 1

    async def _prefill(self, a: _Attempt, body: dict[str, Any]) -> dict[str, Any]:
        assert self._client is not None
        try:
            r = await self._client.post(a.prefill.url + "/generate", json=body,
                                        headers=inject_headers({}))
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ConnectError):
                a.prefill.healthy = False
            raise UpstreamError(f"prefill worker {a.prefill.url} unreachable: {exc}") from None
        if r.status_code != 200:
            raise _upstream_error("prefill", a.prefill.url, r.status_code, _json_or_text(r))
        return r.json()

    async def _decode(self, a: _Attempt, body: dict[str, Any],
                      send: MemoryObjectSendStream[StreamDelta | BaseException],
                      request_id: str) -> None:
        assert self._client is not None
        text_len = ids_len = lp_len = 0
        try:
            async with self._client.stream("POST", a.decode.url + "/generate", json=body,
                                           headers=inject_headers({})) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise _upstream_error("decode", a.decode.url, r.status_code, _json_or_text(r))
                async for obj in parse_events(r.aiter_lines()):
                    if "error" in obj:
                        raise _upstream_error("decode", a.decode.url, 502, obj)
                    text, out_ids = obj.get("text", ""), obj.get("output_ids", [])
                    meta = obj.get("meta_info", {})
                    finish = (meta.get("finish_reason") or {}).get("type")
                    top = meta.get("output_top_logprobs")
                    logprobs = None
                    if top is not None:
                        logprobs = [{int(k): v for k, v in d.items()} for d in top[lp_len:]]
                        lp_len = len(top)
                    delta = StreamDelta(request_id, out_ids[ids_len:], text[text_len:],
                                        finish_reason=finish, logprobs=logprobs)
                    text_len, ids_len = len(text), len(out_ids)
                    if delta.token_ids or delta.text or finish:
                        a.sent_any = a.sent_any or bool(delta.token_ids or delta.text)
                        try:
                            send.send_nowait(delta)
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            return  # the client left; closing its stream cancels this request
                    if finish:
                        return
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ConnectError):
                a.decode.healthy = False
            raise UpstreamError(f"decode worker {a.decode.url} failed: {exc}") from None
        raise UpstreamError(f"decode worker {a.decode.url} ended the stream without finishing")


def _first_upstream(group: BaseExceptionGroup) -> BaseException:
    """The UpstreamError inside an exception group (else the group itself)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = _first_upstream(exc)
        if isinstance(exc, UpstreamError):
            return exc
    return group


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": r.text[:500]}}


def _upstream_error(side: str, url: str, status: int, body: Any) -> UpstreamError:
    err = body.get("error", {}) if isinstance(body, dict) else {}
    message = err.get("message", str(body)) if isinstance(err, dict) else str(err)
    param = err.get("param") if isinstance(err, dict) else None
    if 400 <= status < 500 and status not in (408, 429):
        # the worker refused the request itself: the client's fault, no retry
        return UpstreamError(message, status, retryable=False, param=param)
    return UpstreamError(f"{side} worker {url}: {message}", 502)
