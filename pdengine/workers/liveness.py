"""Peer liveness: periodic heartbeats to every registered peer (DESIGN.md I6).

A worker watches each peer it exchanges KV with (decode -> its prefill workers,
prefill -> the decode workers that registered with a URL). Every `interval_s`
each watched peer is probed with a `timeout_s` limit; after `max_misses`
consecutive failed probes the peer is declared failed once: `on_failed(peer,
reason)` runs (the worker posts `PeerFailed`, which fails all of that peer's
non-terminal rooms at once) and the peer is no longer watched until it
registers again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LivenessConfig:
    interval_s: float = 1.0
    timeout_s: float = 1.0
    max_misses: int = 3


class PeerMonitor:
    def __init__(
        self,
        probe: Callable[[str], Awaitable[object]],
        on_failed: Callable[[str, str], Awaitable[None]],
        config: LivenessConfig = LivenessConfig(),
    ) -> None:
        self._probe = probe
        self._on_failed = on_failed
        self.config = config
        self._misses: dict[str, int] = {}

    @property
    def peers(self) -> list[str]:
        return list(self._misses)

    def watch(self, peer: str) -> None:
        self._misses.setdefault(peer, 0)

    def unwatch(self, peer: str) -> None:
        self._misses.pop(peer, None)

    async def _probe_one(self, peer: str) -> None:
        try:
            with anyio.fail_after(self.config.timeout_s):
                await self._probe(peer)
        except Exception as exc:  # any failure to answer is a miss
            if peer not in self._misses:
                return
            self._misses[peer] += 1
            if self._misses[peer] >= self.config.max_misses:
                self.unwatch(peer)
                reason = f"peer {peer} missed {self.config.max_misses} heartbeats ({exc!r})"
                log.warning(reason)
                await self._on_failed(peer, reason)
        else:
            if peer in self._misses:
                self._misses[peer] = 0

    async def run(self) -> None:
        while True:
            async with anyio.create_task_group() as tg:
                for peer in list(self._misses):
                    tg.start_soon(self._probe_one, peer)
            await anyio.sleep(self.config.interval_s)
