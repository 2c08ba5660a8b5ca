"""``KVTransport``: the room-level transport on top of any ``TransportBackend``.

Lifecycle (one instance per worker, called from one thread — the worker's
event loop; nothing here runs on its own):

  register(pool) -> agent_metadata() to peers -> add_peer(peer metadata)
  prefill, per chunk:  write_pages(...)              posts a tagged WRITE
  every loop tick:     progress() = poll() + drain_notifications() -> events
  either side:         abort(peer, room) / fail(peer, room, reason)
  when a room is gone: forget_room(room)             drops its bookkeeping
  close()

It turns what happens into ``pdengine.fsm.events`` and never decides a room's
state (I3). The abort handshake (I5) is the one thing it does on its own: on
the prefill side an aborted room is *fenced* (``write_pages`` posts nothing for
it) and ``ABORT_ACK`` goes to the peer as soon as ``inflight(room) == 0``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdengine.fsm.events import (
    Abort,
    AbortAcked,
    ChunkDone,
    Event,
    PeerFailed,
    TransferFailed,
)
from pdengine.transport.base import (
    AuxRecord,
    MsgKind,
    Role,
    TransportBackend,
    TransportError,
    WireMessage,
    XferState,
    merge_runs,
    page_spans,
)
from pdengine.transport.integrity import checksum_views

log = logging.getLogger(__name__)

_DISCONNECT_MARKERS = ("DISCONNECT", "Disconnect", "Connection reset", "Input/output error")
_REMEMBERED_ROOMS = 65536  # bound on fenced rooms and delivered (room, chunk) keys


@dataclass
class _Posted:
    handle: Any
    peer: str
    room_id: int
    chunk: int
    is_last: bool
    nbytes: int
    posted_at: float


class KVTransport:
    """Implements ``pdengine.transport.base.Transport`` over one back-end."""

    def __init__(
        self,
        backend: TransportBackend,
        role: Role,
        *,
        checksums: bool = True,
        write_deadline_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        self.backend = backend
        self.name = backend.name
        self.role: Role = role
        self.checksums = checksums
        self.write_deadline_s = write_deadline_s
        self._clock = clock
        self._page_nbytes = 0
        self._posted: list[_Posted] = []
        self._room_inflight: Counter[int] = Counter()
        self._fenced: OrderedDict[int, None] = OrderedDict()
        self._acks_due: dict[int, str] = {}  # room -> peer owed an ABORT_ACK once drained
        self._delivered: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._failed_peers: set[str] = set()
        self._events: list[Event] = []
        self.stats: Counter[str] = Counter()

    # -- set-up ---------------------------------------------------------------

    def register(self, pool: Any) -> None:
        self.backend.register_pool(pool)
        self._page_nbytes = pool[0].numel() * pool.element_size()

    def agent_metadata(self) -> bytes:
        return self.backend.agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        peer = self.backend.add_peer(metadata)
        self._failed_peers.discard(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        self.backend.remove_peer(peer)

    # -- sending ----------------------------------------------------------------

    def write_pages(
        self,
        peer: str,
        room_id: int,
        chunk: int,
        is_last: bool,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        aux: AuxRecord | None = None,
    ) -> int | None:
        """Post one chunk; the result (``ChunkDone``/``TransferFailed``) comes from ``poll``.

        Returns the chunk checksum (0 when checksums are off), or ``None`` when the
        room is fenced by an abort and nothing was posted. Bad page lists raise
        ``ValueError``; back-end errors become a ``TransferFailed`` event instead.
        """
        if room_id in self._fenced:
            self.stats["writes_fenced"] += 1
            return None
        runs = merge_runs(src_pages, dst_pages)
        checksum = checksum_views(self.backend.page_bytes(src_pages)) if self.checksums else 0
        message = WireMessage(
            kind=MsgKind.CHUNK,
            room_id=room_id,
            chunk=chunk,
            is_last=is_last,
            checksum=checksum if self.checksums else None,
            nbytes=len(src_pages) * self._page_nbytes,
            dst_runs=tuple(page_spans(dst_pages)),
            aux=aux,
        )
        if not runs:  # a last chunk that completed no page: the tag alone travels
            return self._send_pageless_chunk(peer, message, checksum)
        try:
            handle = self.backend.post_write(peer, runs, message.encode())
        except Exception as exc:
            self._write_failed(peer, room_id, chunk, f"{type(exc).__name__}: {exc}")
            return checksum
        self._posted.append(
            _Posted(handle, peer, room_id, chunk, is_last, message.nbytes, self._clock())
        )
        self._room_inflight[room_id] += 1
        self.stats["writes_posted"] += 1
        return checksum

    def _send_pageless_chunk(self, peer: str, message: WireMessage, checksum: int) -> int:
        try:
            self.backend.send_notification(peer, message.encode())
        except Exception as exc:
            self._write_failed(peer, message.room_id, message.chunk, f"{type(exc).__name__}: {exc}")
            return checksum
        self._events.append(ChunkDone(message.room_id, message.chunk, is_last=message.is_last))
        return checksum

    def inflight(self, room_id: int) -> int:
        return self._room_inflight.get(room_id, 0)

    def poll(self) -> list[Event]:
        """Completed WRITEs -> ``ChunkDone``; failed or overdue ones -> ``TransferFailed``."""
        now = self._clock()
        still: list[_Posted] = []
        for posted in self._posted:
            state, reason = self.backend.check(posted.handle)
            if state is XferState.PENDING and now - posted.posted_at > self.write_deadline_s:
                state = XferState.FAILED
                reason = f"no completion within {self.write_deadline_s:g}s"
            if state is XferState.PENDING:
                still.append(posted)
                continue
            self.backend.release(posted.handle)
            self._room_inflight[posted.room_id] -= 1
            if self._room_inflight[posted.room_id] <= 0:
                del self._room_inflight[posted.room_id]
            if state is XferState.DONE:
                self.stats["writes_done"] += 1
                self._events.append(
                    ChunkDone(
                        posted.room_id, posted.chunk, is_last=posted.is_last, nbytes=posted.nbytes
                    )
                )
            else:
                self._write_failed(posted.peer, posted.room_id, posted.chunk, reason)
        self._posted = still
        self._send_due_acks()
        events, self._events = self._events, []
        return events

    def _write_failed(self, peer: str, room_id: int, chunk: int, reason: str) -> None:
        self.stats["writes_failed"] += 1
        self._events.append(
            TransferFailed(room_id, f"WRITE of room {room_id} chunk {chunk} to {peer}: {reason}")
        )
        if any(marker in reason for marker in _DISCONNECT_MARKERS):
            self._peer_failed(peer, reason)

    def _peer_failed(self, peer: str, reason: str) -> None:
        if peer not in self._failed_peers:
            self._failed_peers.add(peer)
            self._events.append(PeerFailed(peer, f"peer {peer}: {reason}"))

    # -- control messages ---------------------------------------------------------

    def notify(self, peer: str, message: WireMessage) -> None:
        """Send a control message; a dead peer becomes a ``PeerFailed`` event."""
        try:
            self.backend.send_notification(peer, message.encode())
        except Exception as exc:
            self._peer_failed(peer, f"notification failed: {exc}")

    def abort(self, peer: str, room_id: int, reason: str = "aborted") -> None:
        self._end_room(peer, room_id, MsgKind.ABORT, reason)

    def fail(self, peer: str, room_id: int, reason: str) -> None:
        self._end_room(peer, room_id, MsgKind.FAIL, reason)

    def _end_room(self, peer: str, room_id: int, kind: MsgKind, reason: str) -> None:
        self.notify(peer, WireMessage(kind=kind, room_id=room_id, reason=reason))
        if self.role == "prefill":
            self._fence(peer, room_id)

    def _fence(self, peer: str, room_id: int) -> None:
        self._fenced[room_id] = None
        self._fenced.move_to_end(room_id)
        while len(self._fenced) > _REMEMBERED_ROOMS:
            self._fenced.popitem(last=False)
        self._acks_due[room_id] = peer
        self._send_due_acks()

    def _send_due_acks(self) -> None:
        for room_id, peer in list(self._acks_due.items()):
            if self.inflight(room_id) == 0:
                del self._acks_due[room_id]
                self.stats["abort_acks_sent"] += 1
                self.notify(peer, WireMessage(kind=MsgKind.ABORT_ACK, room_id=room_id))

    def forget_room(self, room_id: int) -> None:
        """The worker dropped the room: release its fence (only after no WRITE is in flight)."""
        if self.inflight(room_id) == 0 and room_id not in self._acks_due:
            self._fenced.pop(room_id, None)

    # -- receiving ------------------------------------------------------------------

    def drain_notifications(self) -> list[Event]:
        """Received messages -> events; CHUNK bytes are verified before ``ChunkDone``."""
        events: list[Event] = []
        for peer, raw in self.backend.recv_notifications():
            try:
                message = WireMessage.decode(raw)
            except ValueError as exc:
                self.stats["bad_notifications"] += 1
                log.warning("dropping a notification from %s: %s", peer, exc)
                continue
            event = self._on_message(peer, message)
            if event is not None:
                events.append(event)
        self._send_due_acks()
        return events

    def _on_message(self, peer: str, message: WireMessage) -> Event | None:
        room_id = message.room_id
        if message.kind is MsgKind.CHUNK:
            return self._on_chunk(peer, message)
        if message.kind in (MsgKind.ABORT, MsgKind.FAIL):
            if self.role == "prefill":
                self._fence(peer, room_id)
            if message.kind is MsgKind.ABORT:
                return Abort(room_id, reason=message.reason or "aborted", from_peer=True)
            return TransferFailed(room_id, f"peer {peer} failed the room: {message.reason}")
        if message.kind is MsgKind.ABORT_ACK:
            if self.role == "decode":
                return AbortAcked(room_id)
            log.warning("prefill agent %s got an abort-ack for room %s", self.name, room_id)
        return None

    def _on_chunk(self, peer: str, message: WireMessage) -> Event | None:
        key = (peer, message.room_id, message.chunk)
        if key in self._delivered:
            self.stats["duplicate_chunks"] += 1
            return None
        self._delivered[key] = None
        while len(self._delivered) > _REMEMBERED_ROOMS:
            self._delivered.popitem(last=False)
        if self.checksums and message.checksum is not None:
            try:
                actual = checksum_views(self.backend.page_bytes(message.dst_pages()))
            except (ValueError, TransportError) as exc:
                return TransferFailed(message.room_id, f"chunk {message.chunk}: {exc}")
            if actual != message.checksum:
                self.stats["checksum_mismatches"] += 1
                return TransferFailed(
                    message.room_id,
                    f"checksum mismatch in room {message.room_id} chunk {message.chunk} "
                    f"from {peer}: expected {message.checksum:016x}, got {actual:016x}",
                )
        self.stats["chunks_received"] += 1
        return ChunkDone(
            message.room_id,
            message.chunk,
            is_last=message.is_last,
            checksum_ok=True,
            nbytes=message.nbytes,
            aux=None if message.aux is None else message.aux.to_dict(),
        )

    def progress(self) -> list[Event]:
        """One loop tick: ``poll()`` then ``drain_notifications()``."""
        return self.poll() + self.drain_notifications()

    def close(self) -> None:
        for posted in self._posted:
            self.backend.release(posted.handle)
        self._posted.clear()
        self._room_inflight.clear()
        self.backend.close()
