"""Output text of one sequence: incremental detokenisation plus stop strings.

Wraps the model's streaming detokenizer (anything with `add(ids) -> str`
and `flush() -> str`). After a stop string appears, `text` is cut just
before it and `stopped` is set; streams hold back the last `holdback`
characters, which may still turn out to begin a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class StreamingDetokenizer(Protocol):
    def add(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class OutputText:
    def __init__(self, detokenizer: StreamingDetokenizer, stop: Sequence[str] = ()) -> None:
        self._detok = detokenizer
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> None:
        if not self.stopped:
            self._extend(self._detok.add([token_id]))

    def finish(self) -> None:
        """The sequence ended: release text held back for an incomplete character."""
        if not self.stopped:
            self._extend(self._detok.flush())

    def _extend(self, delta: str) -> None:
        if not delta:
            return
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
