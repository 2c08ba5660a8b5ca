"""Typed events posted to a worker's room actor (DESIGN.md I3).

Everything that can change a room is one of these messages. Producers (the
compute loops, the transport, HTTP handlers, the deadline heap) only *post*
them; the actor applies them one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RoomEvent:
    room_id: int


@dataclass(frozen=True)
class CreateRoom(RoomEvent):
    role: str  # "prefill" (sender) | "decode" (receiver)
    peer: str = ""
    num_chunks: int | None = None  # known up front on the sender; None = learn from is_last
    meta: dict[str, Any] = field(default_factory=dict)
    pages: tuple[int, ...] = ()  # local KV pages the room holds (freed/quarantined by effects)


@dataclass(frozen=True)
class Bootstrapped(RoomEvent):
    """Sender: the decode side registered and sent destination pages.
    Receiver: destination pages were accepted by the prefill side."""

    peer: str = ""
    dst_pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChunkSent(RoomEvent):
    """A chunk's WRITE was posted (sender) or its first bytes are expected (receiver)."""

    chunk: int


@dataclass(frozen=True)
class ChunkDone(RoomEvent):
    """A chunk's WRITE completed (sender) or arrived and was verified (receiver)."""

    chunk: int
    is_last: bool = False
    checksum_ok: bool = True
    nbytes: int = 0
    aux: dict[str, Any] | None = None  # last chunk: first token, prompt length, checksums


@dataclass(frozen=True)
class TransferFailed(RoomEvent):
    reason: str


@dataclass(frozen=True)
class Abort(RoomEvent):
    reason: str = "aborted"
    from_peer: bool = False


@dataclass(frozen=True)
class AbortAcked(RoomEvent):
    """The prefill side drained its in-flight writes for an aborted room (I5)."""


@dataclass(frozen=True)
class Timeout(RoomEvent):
    """Posted by the actor's own deadline heap."""

    state: int = -1


@dataclass(frozen=True)
class PeerFailed:
    """Every non-terminal room bound to `peer` fails at once."""

    peer: str
    reason: str = "peer failed"


Event = RoomEvent | PeerFailed
