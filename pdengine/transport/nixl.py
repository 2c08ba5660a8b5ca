"""NIXL back-end (UCX): WRITEs of KV page runs between processes, CPU (DRAM) or CUDA (VRAM).

Lifecycle:
  1. ``NixlBackend(name)`` creates one agent, UCX only, **no progress thread**
     (it burns a core); progress happens when ``check`` / ``recv_notifications``
     are called, i.e. from the transport's poll.
  2. ``register_pool(pool)`` registers the whole pool tensor once and prepares
     the local descriptor list once.
  3. ``agent_metadata()`` -> bytes (a JSON header describing the pool, then the
     NIXL agent metadata); the peer passes them to ``add_peer``, which loads the
     agent and prepares that peer's remote descriptor list once.
  4. ``post_write`` builds a transfer from the two prepared lists by index and
     posts it with its notification; ``check`` maps "DONE"/"PROC"/"ERR" and
     raised NIXL errors (remote disconnect, backend error) to ``XferState``;
     ``release`` frees the handle.

Descriptor merging: both prepared lists hold, for every level L in
0..``max_run_level``, one descriptor of 2**L pages at each start page. A page run
of n pages becomes popcount-ish pieces (largest power of two first), the same
pieces on both sides, so a chunk of consecutive pages is one or a few
descriptors without preparing lists per request.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdengine.transport.base import PageRun, TransportError, XferState

log = logging.getLogger(__name__)

_MAGIC = b"PDNX1"
# UCX must progress a while after an endpoint failed, or tearing the worker down
# trips an assertion (pending requests still queued on the dead endpoint).
_SETTLE_AFTER_DISCONNECT_S = 0.5


@dataclass(frozen=True)
class PoolDescriptor:
    """Where a pool lives in its owner's address space (travels in the metadata)."""

    addr: int
    num_pages: int
    page_nbytes: int
    device_id: int
    mem_type: str  # "DRAM" | "VRAM"


def run_pieces(count: int, max_level: int) -> list[tuple[int, int]]:
    """Split a run of ``count`` pages into (offset, level) pieces of 2**level pages."""
    pieces: list[tuple[int, int]] = []
    offset = 0
    while count > 0:
        level = min(max_level, count.bit_length() - 1)
        pieces.append((offset, level))
        offset += 1 << level
        count -= 1 << level
    return pieces


class _LevelIndex:
    """Index of descriptor (level, start page) in a prepared multi-level list."""

    def __init__(self, num_pages: int, max_level: int) -> None:
        self.num_pages = num_pages
        self.max_level = min(max_level, max(num_pages.bit_length() - 1, 0))
        self.offsets: list[int] = []
        total = 0
        for level in range(self.max_level + 1):
            self.offsets.append(total)
            total += num_pages - (1 << level) + 1
        self.size = total

    def descriptors(self, pool: PoolDescriptor) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        for level in range(self.max_level + 1):
            span = (1 << level) * pool.page_nbytes
            for start in range(self.num_pages - (1 << level) + 1):
                out.append((pool.addr + start * pool.page_nbytes, span, pool.device_id))
        return out

    def index(self, level: int, start: int) -> int:
        return self.offsets[level] + start


class NixlBackend:
    """One NIXL agent owning one registered KV pool; peers are other ``NixlBackend``s."""

    def __init__(self, name: str, *, max_run_level: int = 8, telemetry: bool = False) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        config = nixl_agent_config(
            enable_prog_thread=False, capture_telemetry=telemetry, backends=["UCX"]
        )
        self.name = name
        self._agent = nixl_agent(name, config)
        self._max_run_level = max_run_level
        self._pool: Any = None
        self._pool_desc: PoolDescriptor | None = None
        self._reg: Any = None
        self._levels: _LevelIndex | None = None
        self._local_dlist: Any = None
        self._peers: dict[str, tuple[Any, _LevelIndex]] = {}
        self._disconnected: set[str] = set()
        self._handle_peer: dict[int, str] = {}
        self.descriptors_posted = 0

    # -- registration and peers -------------------------------------------------

    def register_pool(self, pool: Any) -> None:
        if self._pool is not None:
            raise TransportError(f"agent {self.name} already has a registered pool")
        if not pool.is_contiguous():
            raise TransportError("the KV pool must be one contiguous tensor")
        num_pages = int(pool.shape[0])
        mem_type = "VRAM" if pool.is_cuda else "DRAM"
        self._pool_desc = PoolDescriptor(
            addr=pool.data_ptr(),
            num_pages=num_pages,
            page_nbytes=pool[0].numel() * pool.element_size(),
            device_id=pool.get_device() if pool.is_cuda else 0,
            mem_type=mem_type,
        )
        self._reg = self._agent.register_memory(pool)
        self._pool = pool
        self._levels = _LevelIndex(num_pages, self._max_run_level)
        self._local_dlist = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._levels.descriptors(self._pool_desc), mem_type
        )

    def agent_metadata(self) -> bytes:
        if self._pool_desc is None:
            raise TransportError("register_pool before agent_metadata")
        header = json.dumps({"agent": self.name, "pool": vars(self._pool_desc)}).encode()
        return _MAGIC + struct.pack("!I", len(header)) + header + self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        if self._levels is None:
            raise TransportError("register_pool before add_peer")
        if not metadata.startswith(_MAGIC):
            raise TransportError("peer metadata is not from a pdengine NIXL agent")
        (hlen,) = struct.unpack_from("!I", metadata, len(_MAGIC))
        start = len(_MAGIC) + 4
        header = json.loads(metadata[start : start + hlen])
        pool = PoolDescriptor(**header["pool"])
        if pool.page_nbytes != self._pool_desc.page_nbytes:  # type: ignore[union-attr]
            raise TransportError(
                f"peer {header['agent']} pages are {pool.page_nbytes} bytes, "
                f"ours are {self._pool_desc.page_nbytes}"  # type: ignore[union-attr]
            )
        if header["agent"] in self._peers:  # a restarted peer: forget the old one first
            self.remove_peer(header["agent"])
        try:
            loaded = self._agent.add_remote_agent(metadata[start + hlen :])
        except Exception as exc:
            raise TransportError(f"cannot load peer {header['agent']}: {exc}") from exc
        peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._disconnected.discard(peer)
        levels = _LevelIndex(pool.num_pages, self._max_run_level)
        levels.max_level = min(levels.max_level, self._levels.max_level)
        dlist = self._agent.prep_xfer_dlist(peer, levels.descriptors(pool), pool.mem_type)
        self._peers[peer] = (dlist, levels)
        return peer

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is None:
            return
        if peer in self._disconnected:
            self._settle()
        try:
            entry[0].release()
            self._agent.remove_remote_agent(peer)
        except Exception as exc:  # a dead peer may already be gone from NIXL
            log.debug("removing peer %s: %s", peer, exc)

    # -- data path ---------------------------------------------------------------

    def page_bytes(self, pages: Sequence[int]) -> list[memoryview]:
        from pdengine.transport.integrity import pool_page_views

        return pool_page_views(self._pool, pages)

    def post_write(self, peer: str, runs: Sequence[PageRun], notification: bytes) -> Any:
        entry = self._peers.get(peer)
        if entry is None or self._levels is None:
            raise TransportError(f"unknown peer {peer!r} (add_peer first)")
        if peer in self._disconnected:  # never queue more work on a dead endpoint
            raise TransportError(f"peer {peer} is gone (NIXL_ERR_REMOTE_DISCONNECT earlier)")
        remote_dlist, remote_levels = entry
        local_idx: list[int] = []
        remote_idx: list[int] = []
        for run in runs:
            if run.src + run.count > self._levels.num_pages:
                raise TransportError(f"local pages {run.src}..+{run.count} out of range")
            if run.dst + run.count > remote_levels.num_pages:
                raise TransportError(f"peer pages {run.dst}..+{run.count} out of range")
            for offset, level in run_pieces(run.count, remote_levels.max_level):
                local_idx.append(self._levels.index(level, run.src + offset))
                remote_idx.append(remote_levels.index(level, run.dst + offset))
        handle = self._agent.make_prepped_xfer(
            "WRITE", self._local_dlist, local_idx, remote_dlist, remote_idx, notification
        )
        self.descriptors_posted += len(local_idx)
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._note_error(peer, exc)
            self._release_quietly(handle)
            raise
        if state == "ERR":
            self._release_quietly(handle)
            raise TransportError(f"posting a WRITE to {peer} returned ERR")
        self._handle_peer[id(handle)] = peer
        return handle

    def check(self, handle: Any) -> tuple[XferState, str]:
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            self._note_error(self._handle_peer.get(id(handle), ""), exc)
            return XferState.FAILED, f"{type(exc).__name__}: {exc}"
        if state == "DONE":
            return XferState.DONE, ""
        if state == "ERR":
            return XferState.FAILED, "check_xfer_state returned ERR"
        return XferState.PENDING, ""

    def release(self, handle: Any) -> None:
        self._handle_peer.pop(id(handle), None)
        self._release_quietly(handle)

    def _release_quietly(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as exc:  # an active WRITE that cannot be cancelled
            log.warning("releasing a NIXL transfer handle: %s", exc)

    # -- notifications -------------------------------------------------------------

    def send_notification(self, peer: str, message: bytes) -> None:
        if peer in self._disconnected:
            raise TransportError(f"peer {peer} is gone (NIXL_ERR_REMOTE_DISCONNECT earlier)")
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            self._note_error(peer, exc)
            raise TransportError(f"notification to {peer} failed: {exc}") from exc

    def _note_error(self, peer: str, exc: Exception) -> None:
        if "DISCONNECT" in f"{type(exc).__name__} {exc}".upper():
            self._disconnected.add(peer)

    def _settle(self) -> None:
        deadline = time.monotonic() + _SETTLE_AFTER_DISCONNECT_S
        while time.monotonic() < deadline:
            self._agent.get_new_notifs()

    def recv_notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for peer, messages in self._agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((name, m) for m in messages)
        return out

    def close(self) -> None:
        if self._disconnected:
            self._settle()
            self._disconnected.clear()
        for peer in list(self._peers):
            self.remove_peer(peer)
        if self._local_dlist is not None:
            self._local_dlist.release()
            self._local_dlist = None
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                log.debug("deregistering the pool: %s", exc)
            self._reg = None
        self._pool = None
