"""SGLang-style native endpoints: POST /generate and POST /abort_request.

``/generate`` takes ``text`` or ``input_ids``, ``sampling_params`` (SGLang
names: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
``stop``, ``stop_token_ids``, ``ignore_eos``, ``logprobs``), ``stream`` and
an optional ``rid``. Streaming events carry the *cumulative* ``text`` and
``output_ids`` (as SGLang does) and end with ``data: [DONE]``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdengine.server.context import public_json
from pdengine.server.generation import Backend, RequestRun
from pdengine.server.openai_api import check_fits
from pdengine.server.params import need_bool, params_from_sglang, token_ids
from pdengine.server.serving import generate_response
from pdengine.types import InvalidRequestError, StreamDelta


def prompt_ids_of(backend: Backend, body: dict[str, Any]) -> list[int]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequestError("text", "give exactly one of text or input_ids")
    if ids is not None:
        return token_ids("input_ids", ids, getattr(backend.tokenizer, "vocab_size", None))
    if not isinstance(text, str):
        raise InvalidRequestError("text", "must be a string (one prompt per request)")
    return backend.tokenizer.encode(text)


def request_id_of(body: dict[str, Any]) -> str:
    rid = body.get("rid")
    if rid is None:
        return secrets.token_hex(16)
    if not isinstance(rid, str) or not rid or len(rid) > 128:
        raise InvalidRequestError("rid", "must be a non-empty string of at most 128 characters")
    return rid


class SGLangFormat:
    """Cumulative `text` / `output_ids` with a `meta_info` block, as SGLang answers."""

    def __init__(self) -> None:
        self.text = ""
        self.output_ids: list[int] = []
        self.top_logprobs: list[dict[str, float]] | None = None

    def _add(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.output_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.top_logprobs = self.top_logprobs or []
            self.top_logprobs.extend({str(k): v for k, v in d.items()} for d in delta.logprobs)

    def _object(self, run: RequestRun) -> dict[str, Any]:
        finish = run.finish_reason
        meta: dict[str, Any] = {
            "id": run.request_id,
            "prompt_tokens": run.prompt_tokens,
            "completion_tokens": run.completion_tokens,
            "finish_reason": None if finish is None else {"type": finish},
            "e2e_latency": time.perf_counter() - run.started,
        }
        if self.top_logprobs is not None:
            meta["output_top_logprobs"] = self.top_logprobs
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def start(self, run: RequestRun) -> list[dict[str, Any]]:
        return []

    def delta(self, run: RequestRun, delta: StreamDelta) -> list[dict[str, Any]]:
        self._add(delta)
        return [self._object(run)]

    def end(self, run: RequestRun) -> list[dict[str, Any]]:
        return []

    def full(self, run: RequestRun, deltas: list[StreamDelta]) -> dict[str, Any]:
        for d in deltas:
            self._add(d)
        return self._object(run)


async def generate(request: Request) -> Response:
    ctx, body = await public_json(request)
    backend = ctx.require_backend()
    params = params_from_sglang(body.get("sampling_params"))
    stream = need_bool("stream", body.get("stream", False))
    ids = prompt_ids_of(backend, body)
    check_fits(backend, ids, params, "input_ids" if "input_ids" in body else "text")
    return await generate_response(request, ctx, SGLangFormat(), request_id_of(body), ids,
                                   params, stream)


async def abort_request(request: Request) -> Response:
    ctx, body = await public_json(request)
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError("rid", "must be the request id to abort")
    return JSONResponse({"rid": rid, "aborted": bool(ctx.require_backend().abort(rid))})
