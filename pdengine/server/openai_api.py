"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

One prompt per request (``n`` = 1). Extensions beyond OpenAI's fields:
``top_k``, ``ignore_eos``, ``stop_token_ids``. Streaming sends
``data: {chunk}`` events and ends with ``data: [DONE]``; with
``stream_options.include_usage`` the last chunk before it carries ``usage``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdengine.server.context import ServingContext, public_get, public_json
from pdengine.server.errors import APIError
from pdengine.server.generation import Backend, RequestRun
from pdengine.server.params import build_params, need_bool, need_int, token_ids
from pdengine.server.serving import generate_response
from pdengine.types import InvalidRequestError, PromptTooLongError, SamplingParams, StreamDelta

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def check_model(backend: Backend, model: Any) -> None:
    if model is None or model == backend.model_name:
        return
    if not isinstance(model, str):
        raise InvalidRequestError("model", "must be a string")
    raise APIError(404, f"model: {model!r} is not served here; use {backend.model_name!r}", "model")


def check_fits(backend: Backend, ids: list[int], params: SamplingParams,
               field: str = "prompt") -> None:
    """Refuse what the engine would refuse, before any worker is involved (400)."""
    if not ids:
        raise InvalidRequestError(field, "must not be empty")
    limit = backend.max_model_len
    if len(ids) > limit:
        raise PromptTooLongError(len(ids), limit)
    if len(ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"model length {limit}",
        )


def completion_prompt_ids(backend: Backend, prompt: Any) -> list[int]:
    """`prompt` as a string, a token list, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return backend.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise InvalidRequestError("prompt", "batched prompts are not supported; send one")
    if isinstance(prompt, list):
        return token_ids("prompt", prompt, getattr(backend.tokenizer, "vocab_size", None))
    raise InvalidRequestError("prompt", "must be a string or a list of token ids")


def _content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise InvalidRequestError(f"messages[{i}].content", "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")


def chat_prompt_ids(backend: Backend, messages: Any) -> list[int]:
    """Messages rendered with the checkpoint's chat template, tokenized once."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}]", "must be an object")
        if m.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"must be one of {sorted(CHAT_ROLES)}")
        clean.append({"role": m["role"], "content": _content_text(i, m.get("content"))})
    return list(backend.tokenizer.apply_chat_template(clean, add_generation_prompt=True,
                                                      tokenize=True))


def common_params(body: dict[str, Any], *, max_tokens: Any, logprobs: Any) -> SamplingParams:
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise InvalidRequestError("n", "only n=1 is supported")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if body.get(penalty) not in (None, 0, 0.0):
            raise InvalidRequestError(penalty, "is not supported (only 0)")
    return build_params(
        max_tokens=max_tokens,
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=body.get("top_k"),
        seed=body.get("seed"),
        stop=body.get("stop"),
        stop_token_ids=body.get("stop_token_ids"),
        ignore_eos=body.get("ignore_eos"),
        logprobs=logprobs,
    )


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = need_bool("stream", body.get("stream", False))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options", "must be an object")
    include_usage = need_bool("stream_options.include_usage", options.get("include_usage", False))
    return stream, include_usage


def usage(run: RequestRun) -> dict[str, int]:
    return {
        "prompt_tokens": run.prompt_tokens,
        "completion_tokens": run.completion_tokens,
        "total_tokens": run.prompt_tokens + run.completion_tokens,
    }


def _token_logprobs(deltas: list[StreamDelta]) -> list[tuple[int, dict[int, float]]]:
    """(token, {candidate: logprob}) for every generated token of `deltas`."""
    return [pair for d in deltas
            for pair in zip(d.token_ids, d.logprobs or [{}] * len(d.token_ids), strict=False)]


def _highest(top: dict[int, float], k: int | None) -> list[tuple[int, float]]:
    """The `k` most likely candidates (the engine adds the sampled token when it is not)."""
    return sorted(top.items(), key=lambda kv: kv[1], reverse=True)[: k or 0]


def _nothing_to_send(delta: StreamDelta) -> bool:
    """Tokens whose text is held back (an incomplete character, a possible stop string)."""
    return not delta.text and delta.finish_reason is None and delta.logprobs is None


class _OpenAIFormat:
    object_name = ""
    chunk_object = ""

    def __init__(self, backend: Backend, include_usage: bool) -> None:
        self.backend = backend
        self.include_usage = include_usage
        self.created = int(time.time())

    def _token_text(self, token_id: int) -> str:
        return self.backend.tokenizer.decode([token_id])

    def _chunk(self, run: RequestRun, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": run.request_id, "object": self.chunk_object, "created": self.created, "model": self.backend.model_name, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self, run: RequestRun) -> list[dict[str, Any]]:
        return []

    def end(self, run: RequestRun) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self._chunk(run, []), "usage": usage(run)}]

    def _response(self, run: RequestRun, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": run.request_id, "object": self.object_name, "created": self.created,
                "model": self.backend.model_name, "choices": [choice], "usage": usage(run)}


class CompletionFormat(_OpenAIFormat):
    object_name = chunk_object = "text_completion"

    def _logprobs(self, run: RequestRun, deltas: list[StreamDelta]) -> dict[str, Any] | None:
        if all(d.logprobs is None for d in deltas):
            return None
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        for tok, top in _token_logprobs(deltas):
            out["tokens"].append(self._token_text(tok))
            out["token_logprobs"].append(top.get(tok))
            out["top_logprobs"].append(
                {self._token_text(k): v for k, v in _highest(top, run.params.logprobs)})
        return out

    def delta(self, run: RequestRun, delta: StreamDelta) -> list[dict[str, Any]]:
        if _nothing_to_send(delta):
            return []
        choice = {"index": 0, "text": delta.text, "logprobs": self._logprobs(run, [delta]),
                  "finish_reason": delta.finish_reason}
        return [self._chunk(run, [choice])]

    def full(self, run: RequestRun, deltas: list[StreamDelta]) -> dict[str, Any]:
        choice = {"index": 0, "text": "".join(d.text for d in deltas),
                  "logprobs": self._logprobs(run, deltas), "finish_reason": run.finish_reason}
        return self._response(run, choice)


class ChatFormat(_OpenAIFormat):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _logprobs(self, run: RequestRun, deltas: list[StreamDelta]) -> dict[str, Any] | None:
        if all(d.logprobs is None for d in deltas):
            return None
        content = []
        for tok, top in _token_logprobs(deltas):
            text = self._token_text(tok)
            content.append({
                "token": text, "logprob": top.get(tok), "bytes": list(text.encode()),
                "top_logprobs": [{"token": self._token_text(k), "logprob": v,
                                  "bytes": list(self._token_text(k).encode())}
                                 for k, v in _highest(top, run.params.logprobs)],
            })
        return {"content": content}

    def start(self, run: RequestRun) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return [self._chunk(run, [choice])]

    def delta(self, run: RequestRun, delta: StreamDelta) -> list[dict[str, Any]]:
        if _nothing_to_send(delta):
            return []
        body = {"content": delta.text} if delta.text else {}
        choice = {"index": 0, "delta": body, "logprobs": self._logprobs(run, [delta]),
                  "finish_reason": delta.finish_reason}
        return [self._chunk(run, [choice])]

    def full(self, run: RequestRun, deltas: list[StreamDelta]) -> dict[str, Any]:
        message = {"role": "assistant", "content": "".join(d.text for d in deltas)}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(run, deltas),
                  "finish_reason": run.finish_reason}
        return self._response(run, choice)


async def completions(request: Request) -> Response:
    ctx, body = await public_json(request)
    backend = ctx.require_backend()
    check_model(backend, body.get("model"))
    if body.get("echo"):
        raise InvalidRequestError("echo", "is not supported")
    if "prompt" not in body:
        raise InvalidRequestError("prompt", "is required")
    params = common_params(body, max_tokens=body.get("max_tokens"), logprobs=body.get("logprobs"))
    stream, include_usage = stream_flags(body)
    ids = completion_prompt_ids(backend, body["prompt"])
    check_fits(backend, ids, params)
    return await generate_response(request, ctx, CompletionFormat(backend, include_usage),
                                   f"cmpl-{secrets.token_hex(12)}", ids, params, stream)


async def chat_completions(request: Request) -> Response:
    ctx, body = await public_json(request)
    backend = ctx.require_backend()
    check_model(backend, body.get("model"))
    top = None
    if body.get("logprobs") is not None and need_bool("logprobs", body["logprobs"]):
        top = need_int("top_logprobs", body.get("top_logprobs", 0), 0)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    try:
        params = common_params(body, max_tokens=max_tokens, logprobs=top)
    except InvalidRequestError as exc:
        if exc.field == "max_tokens" and field != "max_tokens":
            raise InvalidRequestError(field, str(exc).split(": ", 1)[-1]) from None
        raise
    stream, include_usage = stream_flags(body)
    ids = chat_prompt_ids(backend, body.get("messages"))
    check_fits(backend, ids, params, "messages")
    return await generate_response(request, ctx, ChatFormat(backend, include_usage),
                                   f"chatcmpl-{secrets.token_hex(12)}", ids, params, stream)


async def models(request: Request) -> Response:
    ctx: ServingContext = public_get(request)
    backend = ctx.require_backend()
    card = {"id": backend.model_name, "object": "model", "created": int(ctx.started_at),
            "owned_by": "pdengine", "max_model_len": backend.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})
