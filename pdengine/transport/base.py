"""The transport contract: typed wire messages, the back-end protocol, the room-level API.

Two layers, one job each:

* ``TransportBackend`` — what a back-end (NIXL, loopback, the fault wrapper)
  implements: register a pool, describe itself, post a WRITE of page *runs* with
  a notification, report the state of a posted WRITE, send and receive small
  notifications. It knows nothing about rooms.
* ``Transport`` — what workers use (implemented once, in ``transfer.py``, on top
  of any back-end): post a room's chunk (checksum + tag), turn completions and
  notifications into ``pdengine.fsm.events`` for the room actor, run the abort
  handshake (I5). It never sets room state (I3); it only returns events.

Push flow (DESIGN.md section 3): decode registers its agent metadata and sends
destination pages; prefill calls ``write_pages`` per chunk; the WRITE's
notification (``MsgKind.CHUNK``) arrives after the chunk's bytes, the receiver
verifies the checksum over its destination pages and yields ``ChunkDone``. The
last chunk's notification carries the ``AuxRecord``.

Abort handshake (I5): only the prefill side (``role="prefill"``, the writer)
sends ``ABORT_ACK``. Whoever aborts sends ``ABORT`` at once (I6); the prefill
side fences the room (no more posts), waits until ``inflight(room) == 0``, then
acks. The decode side maps ``ABORT_ACK`` to ``AbortAcked`` and may then reuse the
room's pages.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from pdengine.fsm.events import Event

Role = Literal["prefill", "decode"]


class TransportError(RuntimeError):
    """A back-end call failed synchronously (bad peer, bad pages, NIXL error)."""


class MsgKind(enum.StrEnum):
    CHUNK = "chunk"  # a WRITE's completion tag: room/chunk/is_last/checksum
    ABORT = "abort"  # the sender of this message aborted the room
    FAIL = "fail"  # the sender of this message failed the room (reason says why)
    ABORT_ACK = "abort_ack"  # prefill: no WRITE of this room is in flight any more


@dataclass(frozen=True)
class PageRun:
    """``count`` consecutive pages from ``src`` (local) to ``dst`` (remote): one descriptor."""

    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class AuxRecord:
    """Rides on the last chunk's notification (decode needs it to start decoding)."""

    first_token: int
    prompt_len: int
    chunk_checksums: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["chunk_checksums"] = list(self.chunk_checksums)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuxRecord:
        return cls(
            first_token=int(data["first_token"]),
            prompt_len=int(data["prompt_len"]),
            chunk_checksums=tuple(int(c) for c in data.get("chunk_checksums", ())),
            extra=dict(data.get("extra", {})),
        )


@dataclass(frozen=True)
class WireMessage:
    """One notification between agents, serialised as a JSON object (named fields only)."""

    kind: MsgKind
    room_id: int
    chunk: int = -1
    is_last: bool = False
    checksum: int | None = None  # xxh3_64 of the chunk's pages in order; None = off
    nbytes: int = 0
    dst_runs: tuple[tuple[int, int], ...] = ()  # (first page, count) on the receiver
    aux: AuxRecord | None = None
    reason: str = ""

    def encode(self) -> bytes:
        body: dict[str, Any] = {"kind": self.kind.value, "room_id": self.room_id}
        if self.kind is MsgKind.CHUNK:
            body.update(
                chunk=self.chunk,
                is_last=self.is_last,
                checksum=self.checksum,
                nbytes=self.nbytes,
                dst_runs=[list(r) for r in self.dst_runs],
            )
            if self.aux is not None:
                body["aux"] = self.aux.to_dict()
        if self.reason:
            body["reason"] = self.reason
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> WireMessage:
        """Parse a notification; raises ``ValueError`` naming what is wrong."""
        try:
            body = json.loads(raw)
            kind = MsgKind(body["kind"])
            aux = body.get("aux")
            return cls(
                kind=kind,
                room_id=int(body["room_id"]),
                chunk=int(body.get("chunk", -1)),
                is_last=bool(body.get("is_last", False)),
                checksum=None if body.get("checksum") is None else int(body["checksum"]),
                nbytes=int(body.get("nbytes", 0)),
                dst_runs=tuple((int(a), int(n)) for a, n in body.get("dst_runs", ())),
                aux=None if aux is None else AuxRecord.from_dict(aux),
                reason=str(body.get("reason", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed transport notification {raw[:80]!r}: {exc}") from exc

    def dst_pages(self) -> list[int]:
        return [p for start, count in self.dst_runs for p in range(start, start + count)]


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@runtime_checkable
class TransportBackend(Protocol):
    """Moves bytes between registered pools; rooms are opaque to it.

    Lifecycle: ``register_pool`` once -> ``agent_metadata`` to peers -> ``add_peer``
    for each peer's metadata -> ``post_write`` / ``check`` / ``release`` per
    WRITE, ``send_notification`` / ``recv_notifications`` for control messages
    -> ``close``. Every call is made from one thread (no progress thread).
    """

    name: str

    def register_pool(self, pool: Any) -> None:
        """Register the KV pool tensor (CPU or CUDA, contiguous)."""

    def agent_metadata(self) -> bytes:
        """This agent and its pool descriptors, for ``add_peer`` on another agent."""

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's name."""

    def remove_peer(self, peer: str) -> None: ...

    def page_bytes(self, pages: Sequence[int]) -> list[memoryview]:
        """Host-readable bytes of local pages, merged into contiguous runs (for checksums)."""

    def post_write(self, peer: str, runs: Sequence[PageRun], notification: bytes) -> Any:
        """Start a WRITE of the runs; ``notification`` reaches the peer after the bytes."""

    def check(self, handle: Any) -> tuple[XferState, str]:
        """State of a posted WRITE and, when FAILED, the reason."""

    def release(self, handle: Any) -> None: ...

    def send_notification(self, peer: str, message: bytes) -> None: ...

    def recv_notifications(self) -> list[tuple[str, bytes]]:
        """(peer name, message) pairs received since the last call, in arrival order."""

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """The room-level API workers use; every method returns events, never sets state."""

    name: str
    role: Role

    def register(self, pool: Any) -> None:
        """Register the KV pool tensor (``KVLayout.shape``) once, before ``agent_metadata``."""

    def agent_metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def remove_peer(self, peer: str) -> None: ...

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
        """Post one chunk's WRITE; returns its checksum (or 0 when checksums are off),
        or ``None`` when the room is fenced by an abort and nothing was posted."""

    def inflight(self, room_id: int) -> int:
        """Posted WRITEs of this room not yet completed or failed."""

    def poll(self) -> list[Event]:
        """Sender: completions -> ``ChunkDone``, errors/deadlines -> ``TransferFailed``
        (+ ``PeerFailed`` on a disconnect); sends abort-acks whose drain finished."""

    def drain_notifications(self) -> list[Event]:
        """Receiver: ``CHUNK`` -> verified ``ChunkDone`` (mismatch -> ``TransferFailed``),
        ``ABORT`` -> ``Abort(from_peer=True)``, ``FAIL`` -> ``TransferFailed``,
        ``ABORT_ACK`` -> ``AbortAcked``."""

    def abort(self, peer: str, room_id: int, reason: str = "aborted") -> None:
        """Tell the peer at once; on prefill also fence the room and ack after drain."""

    def fail(self, peer: str, room_id: int, reason: str) -> None:
        """Like ``abort`` but the peer sees ``TransferFailed(reason)``."""

    def notify(self, peer: str, message: WireMessage) -> None: ...

    def progress(self) -> list[Event]:
        """One loop tick: ``poll()`` then ``drain_notifications()``."""

    def forget_room(self, room_id: int) -> None:
        """The worker dropped the room; its fence goes once nothing is in flight."""

    def close(self) -> None: ...


def merge_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Merge page pairs into runs contiguous on both sides (one descriptor each)."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(
            f"src_pages has {len(src_pages)} pages but dst_pages has {len(dst_pages)}"
        )
    runs: list[PageRun] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        last = runs[-1] if runs else None
        if last is not None and s == last.src + last.count and d == last.dst + last.count:
            runs[-1] = PageRun(last.src, last.dst, last.count + 1)
        else:
            runs.append(PageRun(int(s), int(d), 1))
    return runs


def page_spans(pages: Sequence[int]) -> list[tuple[int, int]]:
    """(first page, count) spans of consecutive pages, order kept."""
    spans: list[tuple[int, int]] = []
    for p in pages:
        if spans and p == spans[-1][0] + spans[-1][1]:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((int(p), 1))
    return spans
