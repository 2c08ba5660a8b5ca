"""ColocatedEngine: prefill and decode in one process, no KV transfer (the PD baseline).

Lifecycle:
- `__aenter__` loads the model and tokenizer into an EngineCore (model, KV
  pool, scheduler, runner) in a worker thread, and starts one task group
  holding the engine loop.
- `stream()` / `generate()` check arguments on the caller's task, then hand
  the request to the loop through an inbox; deltas come back on the
  request's own memory stream.
- The loop applies new requests and aborts between steps, runs one
  `EngineCore.step()` (plan, forward, sample, update) in the compute thread
  (a capacity limiter of one) and dispatches the deltas. Between steps only
  the loop touches the scheduler; during a step only the compute thread does.
- A crash in the loop fails every open request with RequestFailedError and
  cancels the task group, so the error surfaces at `async with` too.
- `__aexit__` cancels the loop (a running step finishes first) and aborts
  whatever is left.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from pdengine.config import SchedulerConfig
from pdengine.engine.base import EngineBase, RequestStream
from pdengine.runtime import EngineCore, OutputText, Sequence, StepOutput
from pdengine.types import InvalidRequestError, RequestFailedError, SamplingParams, StreamDelta


class _Request:
    def __init__(self, seq: Sequence, send: MemoryObjectSendStream[StreamDelta | BaseException]):
        self.seq = seq
        self.send = send
        self.text_sent = 0  # characters of seq.text already streamed
        self.logprobs_sent = 0


class ColocatedEngine(EngineBase):
    def __init__(
        self,
        model: str = "tiny",
        *,
        scheduler_config: SchedulerConfig | None = None,
        dtype: str | None = None,
        device: str = "cpu",
    ) -> None:
        self.model_name = str(model)
        self._model_ref = model
        self._config = scheduler_config or SchedulerConfig()
        self._dtype = dtype
        self._device = device
        self._requests: dict[str, _Request] = {}
        self._inbox: list[_Request] = []
        self._aborts: set[str] = set()
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)
        self._tg: TaskGroup | None = None
        self._loop_thread = -1
        self.core: EngineCore | None = None
        self._failure: BaseException | None = None
        self._counters = {"requests_finished": 0, "requests_aborted": 0, "steps": 0}

    # ---- lifecycle ------------------------------------------------------------------------

    async def _start(self) -> None:
        core, self.tokenizer = await anyio.to_thread.run_sync(
            lambda: EngineCore.load(
                self._model_ref, self._config, dtype=self._dtype, device=self._device
            )
        )
        self.core = core
        self.scheduler = core.scheduler
        self.vocab_size = core.model.config.vocab_size
        self.max_model_len = core.max_model_len
        self._loop_thread = threading.get_ident()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._loop, name="pdengine-engine-loop")

    async def _stop(self) -> None:
        if self._tg is None:
            return
        tg, self._tg = self._tg, None
        tg.cancel_scope.cancel()
        try:
            await tg.__aexit__(None, None, None)
        finally:
            for rid in list(self._requests):
                self._finish_request(rid, "abort")

    # ---- requests -------------------------------------------------------------------------

    def _submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
                ) -> RequestStream:
        if self._failure is not None:
            raise RequestFailedError(f"the engine has failed: {self._failure!r}")
        if self._tg is None:
            raise RuntimeError("use the engine inside `async with`")
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)
        text = OutputText(self.tokenizer.detokenizer(prompt_token_ids), params.stop)
        seq = Sequence(request_id, prompt_token_ids, params, output_text=text)
        send, receive = anyio.create_memory_object_stream[StreamDelta | BaseException](math.inf)
        req = _Request(seq, send)
        self._requests[request_id] = req
        self._inbox.append(req)
        self._wake.set()
        return RequestStream(request_id, prompt_token_ids, receive, self.abort)

    def abort(self, request_id: str) -> bool:
        if request_id not in self._requests:
            return False
        self._aborts.add(request_id)
        # A stream collected by the GC in another thread lands here too: the event is not
        # thread-safe, and the loop, busy with a step, picks the abort up after it anyway.
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        return True

    def stats(self) -> dict[str, Any]:
        if self.core is None:  # not started
            return {"running": 0, "waiting": 0, "pages_used": 0, "requests_in_flight": 0}
        return {
            **self.scheduler.stats(),
            "inbox": len(self._inbox),
            "requests_in_flight": len(self._requests),
            **self._counters,
        }

    # ---- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        core = self.core
        assert core is not None
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                self._apply_inbox()
                while self.scheduler.has_work():
                    ran = await anyio.to_thread.run_sync(core.step, limiter=self._limiter)
                    if ran is None:  # every request fits an empty pool, so this is a bug
                        raise RuntimeError(f"scheduler stalled: {self.scheduler.stats()}")
                    self._counters["steps"] += 1
                    self._dispatch(ran[1])
                    self._apply_inbox()
        except BaseException as exc:
            self._failure = exc
            err = RequestFailedError(f"the engine loop failed: {exc!r}")
            for req in self._requests.values():
                _send(req, err)
                req.send.close()
            self._requests.clear()
            raise

    def _apply_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for req in inbox:
            if req.seq.request_id in self._aborts:
                continue
            try:
                self.scheduler.add(req.seq)
            except InvalidRequestError as exc:  # checked at submit; kept so one request can't kill the loop
                self._requests.pop(req.seq.request_id, None)
                _send(req, exc)
                req.send.close()
        aborts, self._aborts = self._aborts, set()
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None:
                self.scheduler.abort(req.seq)
                self._finish_request(rid, "abort")

    def _dispatch(self, out: StepOutput) -> None:
        for seq, _ in out.sampled:
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            _send(req, self._delta(req, [seq.token_ids[-1]]))
            if seq.is_finished:
                self._finish_request(seq.request_id, seq.finish_reason or "stop", send_final=False)

    def _delta(self, req: _Request, token_ids: list[int]) -> StreamDelta:
        seq = req.seq
        finished = seq.is_finished
        text = seq.text
        upto = len(text) if finished else max(req.text_sent, len(text) - _holdback(seq))
        delta_text = text[req.text_sent : upto]
        req.text_sent = upto
        lps = None
        if seq.logprobs is not None:
            lps = seq.logprobs[req.logprobs_sent :]
            req.logprobs_sent = len(seq.logprobs)
        return StreamDelta(
            request_id=seq.request_id,
            token_ids=token_ids,
            text=delta_text,
            finish_reason=seq.finish_reason if finished else None,
            logprobs=lps,
        )

    def _finish_request(self, rid: str, reason: str, send_final: bool = True) -> None:
        req = self._requests.pop(rid, None)
        if req is None:
            return
        if send_final:
            if not req.seq.is_finished:
                self.scheduler.finish(req.seq, reason)
            _send(req, self._delta(req, []))
        key = "requests_aborted" if req.seq.finish_reason == "abort" else "requests_finished"
        self._counters[key] += 1
        req.send.close()


def _holdback(seq: Sequence) -> int:
    return seq.output_text.holdback if seq.output_text is not None else 0


def _send(req: _Request, item: StreamDelta | BaseException) -> None:
    """Deliver to the request's stream; a caller that already left is not an error."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        req.send.send_nowait(item)
