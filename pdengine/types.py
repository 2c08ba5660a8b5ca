"""Public request/response types and typed errors of the embedded API (stdlib only)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class PDEngineError(Exception):
    """Base of every error pdengine raises on purpose. `http_status` maps it for the server."""

    http_status = 500


class InvalidRequestError(PDEngineError, ValueError):
    """A request argument is wrong; `field` names it."""

    http_status = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTooLongError(InvalidRequestError):
    def __init__(self, prompt_len: int, limit: int) -> None:
        super().__init__("prompt", f"prompt has {prompt_len} tokens; the limit is {limit}")


class UnknownModelError(PDEngineError):
    http_status = 404


class OverloadedError(PDEngineError):
    http_status = 429


class RequestAbortedError(PDEngineError):
    http_status = 499


class RequestFailedError(PDEngineError):
    """The request ended in FAILED (transfer error, timeout, peer failure, checksum)."""

    http_status = 502


MAX_SEED = 1 << 63  # torch generators take a signed 64-bit seed


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token; None: off

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise InvalidRequestError(name, msg)

        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        need(_finite(self.temperature) and self.temperature >= 0.0, "temperature", "must be >= 0")
        need(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 or >= 1")
        need(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < MAX_SEED),
             "seed", "must be an integer in [0, 2**63)")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs", "must be in [0, 20]")


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class GenerateOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # ttft_s, e2e_s, ...


@dataclass
class StreamDelta:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
