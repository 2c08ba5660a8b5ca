"""Request fields -> `SamplingParams`, with a 400 naming the field for every bad value.

`SamplingParams` checks ranges; this module checks JSON types first, so that
e.g. ``"stop": 5`` is a clear 400 rather than a TypeError.
"""

from __future__ import annotations

import math
from typing import Any

from pdengine.types import MAX_SEED, InvalidRequestError, SamplingParams

_INT = "an integer"
_NUM = "a number"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def need_int(name: str, value: Any, minimum: int | None = None) -> int:
    if not _is_int(value):
        raise InvalidRequestError(name, f"must be {_INT}")
    if minimum is not None and value < minimum:
        raise InvalidRequestError(name, f"must be >= {minimum}")
    return value


def need_number(name: str, value: Any) -> float:
    if not _is_num(value):
        raise InvalidRequestError(name, f"must be {_NUM}")
    return float(value)


def need_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(name, "must be true or false")
    return value


def stop_strings(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidRequestError(name, "must be a non-empty string or a list of them")
    if len(value) > 16:
        raise InvalidRequestError(name, "at most 16 stop strings")
    return tuple(value)


def token_ids(name: str, value: Any, vocab_size: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise InvalidRequestError(name, "must be a list of non-negative integer token ids")
    if vocab_size is not None and any(t >= vocab_size for t in value):
        raise InvalidRequestError(name, f"token ids must be < the vocabulary size {vocab_size}")
    return value


def build_params(
    *,
    max_tokens: Any = None,
    temperature: Any = None,
    top_p: Any = None,
    top_k: Any = None,
    seed: Any = None,
    stop: Any = None,
    stop_token_ids: Any = None,
    ignore_eos: Any = None,
    logprobs: Any = None,
    max_tokens_field: str = "max_tokens",
    default_max_tokens: int = 16,
) -> SamplingParams:
    """A validated `SamplingParams` from optional JSON values (None: the default)."""
    kwargs: dict[str, Any] = {
        "max_tokens": default_max_tokens
        if max_tokens is None
        else need_int(max_tokens_field, max_tokens, 1),
        "stop": stop_strings("stop", stop),
    }
    if temperature is not None:
        kwargs["temperature"] = need_number("temperature", temperature)
    if top_p is not None:
        kwargs["top_p"] = need_number("top_p", top_p)
    if top_k is not None:
        kwargs["top_k"] = need_int("top_k", top_k)
    if seed is not None:
        kwargs["seed"] = need_int("seed", seed, 0)
        if kwargs["seed"] >= MAX_SEED:
            raise InvalidRequestError("seed", f"must be < 2**63 (got {seed})")
    if stop_token_ids is not None:
        kwargs["stop_token_ids"] = tuple(token_ids("stop_token_ids", stop_token_ids))
    if ignore_eos is not None:
        kwargs["ignore_eos"] = need_bool("ignore_eos", ignore_eos)
    if logprobs is not None:
        kwargs["logprobs"] = need_int("logprobs", logprobs)
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        if exc.field == "max_tokens" and max_tokens_field != "max_tokens":
            raise InvalidRequestError(max_tokens_field, str(exc).split(": ", 1)[-1]) from None
        raise


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    """The SGLang-style `sampling_params` object the router forwards to workers."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "ignore_eos": params.ignore_eos,
    }
    if params.seed is not None:
        out["seed"] = params.seed
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.logprobs is not None:
        out["logprobs"] = params.logprobs
    return out


SGLANG_PARAM_NAMES = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
    }
)


def params_from_sglang(sp: Any) -> SamplingParams:
    """`sampling_params` of POST /generate (SGLang names) -> SamplingParams."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise InvalidRequestError("sampling_params", "must be a JSON object")
    unknown = sorted(set(sp) - SGLANG_PARAM_NAMES)
    if unknown:
        raise InvalidRequestError(unknown[0], "unknown sampling parameter")
    return build_params(
        max_tokens=sp.get("max_new_tokens"),
        max_tokens_field="max_new_tokens",
        temperature=sp.get("temperature"),
        top_p=sp.get("top_p"),
        top_k=sp.get("top_k"),
        seed=sp.get("seed"),
        stop=sp.get("stop"),
        stop_token_ids=sp.get("stop_token_ids"),
        ignore_eos=sp.get("ignore_eos"),
        logprobs=sp.get("logprobs"),
    )
