"""Per-state deadlines (DESIGN.md I2) and the single heap that enforces them.

`RoomDeadlines` mirrors `pdengine.config.Deadlines` field by field (fsm may not
import config); the actor accepts either, or anything with these attributes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

from pdengine.fsm.room import RoomState


class DeadlineSource(Protocol):
    bootstrap_s: float
    waiting_for_input_s: float
    transfer_progress_s: float
    drain_s: float


@dataclass(frozen=True)
class RoomDeadlines:
    """Seconds a room may spend in each non-terminal state.

    TRANSFERRING has a progress deadline (each new chunk restarts it) capped by
    `transfer_total_s` from the moment the transfer started, so a trickle of
    chunks cannot keep a room alive forever. `drain_s` is how long a WRITE
    already posted may take to land; it sets when a failed receiver's quarantined
    pages are released without an abort-ack.
    """

    bootstrap_s: float = 30.0
    waiting_for_input_s: float = 60.0
    transfer_progress_s: float = 30.0
    drain_s: float = 10.0
    transfer_total_s: float = 120.0

    @classmethod
    def from_source(cls, src: DeadlineSource) -> RoomDeadlines:
        if isinstance(src, RoomDeadlines):
            return src
        return cls(
            bootstrap_s=src.bootstrap_s,
            waiting_for_input_s=src.waiting_for_input_s,
            transfer_progress_s=src.transfer_progress_s,
            drain_s=src.drain_s,
            transfer_total_s=getattr(src, "transfer_total_s", cls.transfer_total_s),
        )

    def __post_init__(self) -> None:
        for name in ("bootstrap_s", "waiting_for_input_s", "transfer_progress_s", "drain_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.transfer_total_s < self.transfer_progress_s:
            raise ValueError("transfer_total_s must be >= transfer_progress_s")

    def for_state(self, state: RoomState) -> float:
        if state is RoomState.BOOTSTRAPPING:
            return self.bootstrap_s
        if state is RoomState.WAITING_FOR_INPUT:
            return self.waiting_for_input_s
        if state is RoomState.TRANSFERRING:
            return self.transfer_progress_s
        raise ValueError(f"{state!r} has no deadline")

    def bound_s(self) -> float:
        """I2: the latest a room can reach a terminal state after creation."""
        return self.bootstrap_s + self.waiting_for_input_s + self.transfer_total_s


class DeadlineHeap:
    """Min-heap of (time, seq, room_id) with lazy invalidation.

    The owner keeps at most one live entry per room: an entry is live when its
    time equals the room's `heap_time`. A later deadline does not push; the
    early entry pops, sees the room's newer `deadline`, and re-arms itself.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, when: float, room_id: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, room_id))

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> tuple[float, int] | None:
        if self._heap and self._heap[0][0] <= now:
            when, _, room_id = heapq.heappop(self._heap)
            return when, room_id
        return None
