"""Seeded fault injection around any ``TransportBackend`` (simulator and reliability tests).

Which side to wrap:
* the **sending** side for WRITE faults: ``fail_write`` (the WRITE reports FAILED,
  nothing moves), ``stall_write`` (the WRITE never completes; the transport's
  write deadline must catch it);
* the **receiving** side for notification faults and corruption: ``drop``,
  ``duplicate``, ``delay`` (held back for 1..``max_delay_polls`` receive calls),
  ``reorder`` (a received batch is shuffled) and ``corrupt`` (one byte of a
  chunk's destination pages is flipped before the notification is handed up,
  as if the wire had damaged it — the checksum must catch it).

Every probability is 0 by default, so ``FaultyBackend(inner)`` behaves like
``inner``. All randomness comes from one ``random.Random`` (seed it for replay);
``injected`` counts what was done.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdengine.transport.base import MsgKind, PageRun, TransportBackend, WireMessage, XferState


@dataclass(frozen=True)
class FaultConfig:
    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    max_delay_polls: int = 3
    reorder: float = 0.0
    fail_write: float = 0.0
    stall_write: float = 0.0
    corrupt: float = 0.0

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "delay", "reorder", "fail_write", "stall_write", "corrupt"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value}")
        if self.max_delay_polls < 1:
            raise ValueError(f"max_delay_polls must be >= 1, got {self.max_delay_polls}")


@dataclass(frozen=True)
class _InjectedWrite:
    state: XferState
    reason: str


class FaultyBackend:
    """A ``TransportBackend`` that forwards to ``inner`` and misbehaves on purpose."""

    def __init__(
        self,
        inner: TransportBackend,
        config: FaultConfig | None = None,
        rng: random.Random | int | None = 0,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.config = config or FaultConfig()
        self.rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        self.injected: Counter[str] = Counter()
        self._held: list[tuple[int, str, bytes]] = []  # (polls left, peer, message)

    def _roll(self, probability: float) -> bool:
        return probability > 0.0 and self.rng.random() < probability

    # -- pass-through --------------------------------------------------------------

    def register_pool(self, pool: Any) -> None:
        self.inner.register_pool(pool)

    def agent_metadata(self) -> bytes:
        return self.inner.agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def page_bytes(self, pages: Sequence[int]) -> list[memoryview]:
        return self.inner.page_bytes(pages)

    def send_notification(self, peer: str, message: bytes) -> None:
        self.inner.send_notification(peer, message)

    def close(self) -> None:
        self.inner.close()

    # -- WRITE faults --------------------------------------------------------------------

    def post_write(self, peer: str, runs: Sequence[PageRun], notification: bytes) -> Any:
        if self._roll(self.config.fail_write):
            self.injected["fail_write"] += 1
            return _InjectedWrite(XferState.FAILED, "injected fault: WRITE failed")
        if self._roll(self.config.stall_write):
            self.injected["stall_write"] += 1
            return _InjectedWrite(XferState.PENDING, "")
        return self.inner.post_write(peer, runs, notification)

    def check(self, handle: Any) -> tuple[XferState, str]:
        if isinstance(handle, _InjectedWrite):
            return handle.state, handle.reason
        return self.inner.check(handle)

    def release(self, handle: Any) -> None:
        if not isinstance(handle, _InjectedWrite):
            self.inner.release(handle)

    # -- notification faults ------------------------------------------------------------

    def recv_notifications(self) -> list[tuple[str, bytes]]:
        ready: list[tuple[str, bytes]] = []
        held: list[tuple[int, str, bytes]] = []
        for polls_left, peer, message in self._held:
            if polls_left <= 1:
                ready.append((peer, message))
            else:
                held.append((polls_left - 1, peer, message))
        for peer, message in self.inner.recv_notifications():
            if self._roll(self.config.drop):
                self.injected["drop"] += 1
                continue
            if self._roll(self.config.corrupt):
                self._corrupt_destination(message)
            if self._roll(self.config.delay):
                self.injected["delay"] += 1
                held.append((self.rng.randint(1, self.config.max_delay_polls), peer, message))
                continue
            ready.append((peer, message))
            if self._roll(self.config.duplicate):
                self.injected["duplicate"] += 1
                ready.append((peer, message))
        self._held = held
        if len(ready) > 1 and self._roll(self.config.reorder):
            self.injected["reorder"] += 1
            self.rng.shuffle(ready)
        return ready

    def _corrupt_destination(self, raw: bytes) -> None:
        try:
            message = WireMessage.decode(raw)
        except ValueError:
            return
        pages = message.dst_pages()
        if message.kind is not MsgKind.CHUNK or not pages:
            return
        views = self.inner.page_bytes(pages)
        view = views[self.rng.randrange(len(views))]
        if view.readonly:  # e.g. a CUDA pool, seen through a host copy
            return
        offset = self.rng.randrange(len(view))
        view[offset] ^= 0xFF
        self.injected["corrupt"] += 1
