"""The in-process engine as a serving `Backend` (the colocated role)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdengine.engine import EngineBase
from pdengine.types import SamplingParams, StreamDelta


class EngineBackend:
    """Adapts `Engine` (colocated or PD-in-one-process) to the endpoints' `Backend`."""

    def __init__(self, engine: EngineBase, role: str = "colocated") -> None:
        self.engine = engine
        self.role = role

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[StreamDelta]:
        return self.engine.stream(
            prompt_token_ids=prompt_token_ids, params=params, request_id=request_id
        )

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def rooms_snapshot(self) -> list[dict[str, Any]]:
        snapshot = getattr(self.engine, "rooms_snapshot", None)
        return list(snapshot()) if snapshot is not None else []
