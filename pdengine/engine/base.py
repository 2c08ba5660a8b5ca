"""The embedded API every engine mode implements (colocated here, PD in `pd.py`).

An engine is an async context manager. Inside it:

    out = await engine.generate(prompt="Hi", params=SamplingParams(max_tokens=8))
    async for delta in engine.stream(prompt_token_ids=[1, 2], params=...): ...
    engine.abort(request_id)

A subclass implements `_start`, `_stop`, `_submit` (returns a RequestStream),
`abort` and `stats`; argument checking, chat templating and `generate`
(collecting a stream) are shared here.
"""

from __future__ import annotations

import abc
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pdengine.runtime.request_stream import RequestStream
from pdengine.types import GenerateOutput, InvalidRequestError, SamplingParams, StreamDelta


class EngineBase(abc.ABC):
    model_name: str
    tokenizer: Any  # pdengine.model.Tokenizer once started
    max_model_len: int
    vocab_size: int

    # ---- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> EngineBase:
        await self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop()

    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    async def _stop(self) -> None: ...

    # ---- requests -------------------------------------------------------------------------

    @abc.abstractmethod
    def _submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> RequestStream: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is; False when it is unknown or already finished."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Gauges and counters: running, waiting, pages_used, pages_free, ..."""

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        """Start a request and return its delta stream. Bad arguments raise InvalidRequestError here."""
        ids = self.resolve_prompt(prompt, prompt_token_ids)
        params = _check_params(params)
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        return self._submit(ids, params, request_id)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> GenerateOutput:
        start = time.perf_counter()
        stream = self.stream(
            prompt, prompt_token_ids=prompt_token_ids, params=params, request_id=request_id
        )
        return await collect(stream, start)

    def prompt_from_messages(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of a chat conversation rendered with the checkpoint's chat template."""
        if not isinstance(messages, list | tuple) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), str
            ):
                raise InvalidRequestError("messages", "each message needs string role and content")
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True))

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> GenerateOutput:
        ids = self.prompt_from_messages(messages)
        return await self.generate(prompt_token_ids=ids, params=params, request_id=request_id)

    def stream_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        ids = self.prompt_from_messages(messages)
        return self.stream(prompt_token_ids=ids, params=params, request_id=request_id)

    def resolve_prompt(self, prompt: str | None, prompt_token_ids: Sequence[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("prompt", "must be a non-empty string")
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise InvalidRequestError("prompt", "encodes to no tokens")
            return ids
        if isinstance(prompt_token_ids, str | bytes) or not isinstance(prompt_token_ids, Sequence):
            raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    "prompt_token_ids", f"{t!r} is not a token id in [0, {self.vocab_size})"
                )
        return ids


def _check_params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", "must be a pdengine.SamplingParams")
    return params


async def collect(stream: AsyncIterator[StreamDelta] | RequestStream, start: float) -> GenerateOutput:
    """Drain a request's stream into one GenerateOutput (closing it aborts if cut short)."""
    tokens: list[int] = []
    text: list[str] = []
    logprobs: list[dict[int, float]] | None = None
    finish_reason = "abort"
    ttft: float | None = None
    try:
        async for delta in stream:
            if ttft is None and delta.token_ids:
                ttft = time.perf_counter() - start
            tokens += delta.token_ids
            text.append(delta.text)
            if delta.logprobs is not None:
                logprobs = (logprobs or []) + delta.logprobs
            if delta.finish_reason is not None:
                finish_reason = delta.finish_reason
    finally:
        await stream.aclose()  # type: ignore[union-attr]
    metrics = {"e2e_s": time.perf_counter() - start}
    if ttft is not None:
        metrics["ttft_s"] = ttft
    return GenerateOutput(
        request_id=getattr(stream, "request_id", ""),
        prompt_token_ids=list(getattr(stream, "prompt_token_ids", [])),
        token_ids=tokens,
        text="".join(text),
        finish_reason=finish_reason,
        logprobs=logprobs,
        metrics=metrics,
    )
