"""In-process back-end: pages are copied with ``Tensor.copy_`` between pools in one process.

For the embedded engine (prefill and decode workers in one process) and for unit
tests. Agents find each other through a ``LoopbackHub`` (a process-wide default
one unless given), so ``agent_metadata`` is just the agent's name. A WRITE
completes during ``post_write``; its notification is queued to the peer after
the bytes are copied, like NIXL's ordering. Two agents may share one pool
tensor (colocated mode): the copy is then pool-internal.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from typing import Any

from pdengine.transport.base import PageRun, TransportError, XferState
from pdengine.transport.integrity import pool_page_views


class LoopbackHub:
    """Name -> agent registry shared by the agents of one process."""

    def __init__(self) -> None:
        self.agents: dict[str, LoopbackBackend] = {}


DEFAULT_HUB = LoopbackHub()


class LoopbackBackend:
    def __init__(self, name: str, hub: LoopbackHub | None = None) -> None:
        self.name = name
        self._hub = hub if hub is not None else DEFAULT_HUB
        if name in self._hub.agents:
            raise TransportError(f"a loopback agent named {name!r} already exists")
        self._hub.agents[name] = self
        self._pool: Any = None
        self._peers: set[str] = set()
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._closed = False
        self.descriptors_posted = 0

    def register_pool(self, pool: Any) -> None:
        if self._pool is not None:
            raise TransportError(f"agent {self.name} already has a registered pool")
        self._pool = pool

    def agent_metadata(self) -> bytes:
        if self._pool is None:
            raise TransportError("register_pool before agent_metadata")
        return json.dumps({"loopback_agent": self.name}).encode()

    def add_peer(self, metadata: bytes) -> str:
        try:
            peer = json.loads(metadata)["loopback_agent"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError("peer metadata is not from a loopback agent") from exc
        if peer not in self._hub.agents:
            raise TransportError(f"no loopback agent named {peer!r} in this process")
        self._peers.add(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        self._peers.discard(peer)

    def page_bytes(self, pages: Sequence[int]) -> list[memoryview]:
        return pool_page_views(self._pool, pages)

    def _peer(self, peer: str) -> LoopbackBackend:
        agent = self._hub.agents.get(peer)
        if peer not in self._peers or agent is None or agent._closed:
            raise TransportError(f"loopback peer {peer!r} is unknown or closed")
        return agent

    def post_write(self, peer: str, runs: Sequence[PageRun], notification: bytes) -> Any:
        target = self._peer(peer)
        src_pool, dst_pool = self._pool, target._pool
        for run in runs:
            if run.src + run.count > src_pool.shape[0] or run.dst + run.count > dst_pool.shape[0]:
                raise TransportError(f"pages out of range in {run}")
        for run in runs:
            dst_pool[run.dst : run.dst + run.count].copy_(src_pool[run.src : run.src + run.count])
        self.descriptors_posted += len(runs)
        if notification:
            target._inbox.append((self.name, notification))
        return XferState.DONE

    def check(self, handle: Any) -> tuple[XferState, str]:
        return handle, ""

    def release(self, handle: Any) -> None:
        return None

    def send_notification(self, peer: str, message: bytes) -> None:
        self._peer(peer)._inbox.append((self.name, message))

    def recv_notifications(self) -> list[tuple[str, bytes]]:
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def close(self) -> None:
        self._closed = True
        if self._hub.agents.get(self.name) is self:
            del self._hub.agents[self.name]
