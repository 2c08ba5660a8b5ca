"""pdengine: a prefill/decode disaggregated LLM inference engine in which no request can be forgotten.

    from pdengine import Engine, SamplingParams
    async with Engine(model="tiny") as engine:
        out = await engine.generate(prompt="Hello", params=SamplingParams(max_tokens=8))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdengine.types import (
    GenerateOutput,
    InvalidRequestError,
    OverloadedError,
    PDEngineError,
    PromptTooLongError,
    RequestAbortedError,
    RequestFailedError,
    SamplingParams,
    StreamDelta,
    UnknownModelError,
)

if TYPE_CHECKING:
    from pdengine.engine import Engine, EngineBase

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The engine pulls in torch: import it only when asked for, so `pdengine --help` stays fast.
    if name in ("Engine", "EngineBase"):
        import pdengine.engine

        return getattr(pdengine.engine, name)
    raise AttributeError(f"module 'pdengine' has no attribute {name!r}")


__all__ = [
    "Engine",
    "EngineBase",
    "GenerateOutput",
    "InvalidRequestError",
    "OverloadedError",
    "PDEngineError",
    "PromptTooLongError",
    "RequestAbortedError",
    "RequestFailedError",
    "SamplingParams",
    "StreamDelta",
    "UnknownModelError",
]
