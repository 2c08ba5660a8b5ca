"""Typed effects a room actor emits after a transition and executes through handlers.

Callers never free pages or notify peers themselves: the actor decides the
effect from the transition and runs every handler registered for its type, in
its own task, right after the state change. Handlers are plain synchronous
callables that must not block (hand slow work to your own task via a
`send_nowait` on its stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdengine.fsm.room import RoomState


@dataclass(frozen=True, slots=True)
class Effect:
    room_id: int


@dataclass(frozen=True, slots=True)
class ReleasePages(Effect):
    """The room's local KV pages may be freed and reused now."""

    pages: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class QuarantinePages(Effect):
    """Receiver failed: its pages may still take a stale WRITE (I5). Do not reuse them until
    a ReleasePages for this room follows (abort acked, or the drain deadline passed; see
    `RoomCore._drain_deadline` for how far that deadline is when no ack comes)."""

    pages: tuple[int, ...]
    drain_deadline: float


@dataclass(frozen=True, slots=True)
class DeliverPages(Effect):
    """Receiver succeeded: ownership of the filled pages passes to the decode batch."""

    pages: tuple[int, ...]
    aux: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class TellPeer(Effect):
    """Tell the peer worker this room failed here (I6: failure travels in milliseconds)."""

    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class AckAbort(Effect):
    """Sender: the peer aborted; acknowledge once this room's in-flight WRITEs drained (I5)."""

    peer: str


@dataclass(frozen=True, slots=True)
class RoomTerminal(Effect):
    """The room reached a terminal state (notify the request owner)."""

    role: str
    state: RoomState
    reason: str
