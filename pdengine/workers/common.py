"""What a prefill and a decode worker share: model + KV pool, room actor, transport, peers.

`WorkerCore.run()` owns every task of the worker in one anyio task group (a
crash in any task cancels the worker instead of dying silently):

- the room actor (`pdengine.fsm.RoomActor`): the one owner of room state (I3);
- the transport loop: `transport.progress()` -> events posted to the actor,
  nothing else (it never sets state);
- the compute loop (the subclass's `_compute_loop`), whose forward pass runs
  in a dedicated thread;
- the peer monitor (heartbeats, I6) for peers that gave a URL.

Subclasses register effect handlers on the actor and implement the role.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from pdengine.config import Deadlines, SchedulerConfig
from pdengine.fsm import RoomActor, RoomResult, RoomState
from pdengine.fsm.events import Event, PeerFailed
from pdengine.model import load_model
from pdengine.runtime import StepOutput
from pdengine.runtime.core import EngineCore
from pdengine.telemetry.metrics import Metrics
from pdengine.telemetry.tracing_rooms import RoomTracer
from pdengine.transport import FaultConfig, KVTransport, make_transport
from pdengine.types import InvalidRequestError, RequestFailedError
from pdengine.workers.liveness import LivenessConfig, PeerMonitor
from pdengine.workers.peer_client import PeerClient, PeerError

log = logging.getLogger(__name__)

_BUSY_POLL_S = 0.0005  # transport poll period while rooms are live and active
_MAX_BUSY_POLL_S = 0.002  # ... backed off to this while they are live but quiet
_IDLE_POLL_S = 0.05  # ... and while none is (notifications still arrive: aborts, acks)
_GAUGE_PERIOD_S = 0.25
CLUSTER_TOKEN_ENV = "PDENGINE_CLUSTER_TOKEN"  # fallback when WorkerOptions has no token


@dataclass
class WorkerOptions:
    """Everything a worker is built from besides the model name."""

    transport: str = "nixl"  # "nixl" | "loopback"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    deadlines: Deadlines = field(default_factory=Deadlines)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    cluster_token: str = ""
    advertise_url: str | None = None  # this worker's base URL, sent to peers for heartbeats
    checksums: bool = True
    dtype: str | None = None
    device: str = "cpu"
    name: str | None = None
    faults: FaultConfig | None = None  # fault injection (tests, PDENGINE_FAULTS)
    write_deadline_s: float = 10.0  # the transport's deadline for one WRITE to complete


class WorkerCore:
    role = ""

    def __init__(
        self,
        model_ref: str,
        options: WorkerOptions,
        metrics: Metrics | None = None,
        loaded: tuple[Any, Any] | None = None,
    ) -> None:
        self.options = options
        self.model_name = str(model_ref)
        self.name = options.name or f"{self.role}-{uuid.uuid4().hex[:12]}"
        model, tokenizer = loaded if loaded is not None else load_model(
            model_ref, dtype=options.dtype, device=options.device
        )
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.core = EngineCore(model, options.scheduler, device=options.device,
                               prefill_only=self.role == "prefill")
        self.scheduler_config = self.core.config
        self.max_model_len = self.core.max_model_len
        self.pool = self.core.pool
        self.scheduler = self.core.scheduler
        self.metrics = metrics if metrics is not None else Metrics(self.role)
        self.room_tracer = RoomTracer(self.role, page_nbytes=self.pool.layout.page_nbytes)
        self.actor = RoomActor(deadlines=options.deadlines, hook=self._on_transition)
        self.transport: KVTransport = make_transport(
            options.transport, self.name, self.role,  # type: ignore[arg-type]
            checksums=options.checksums, write_deadline_s=options.write_deadline_s,
            faults=options.faults,
        )
        self.transport.register(self.pool.tensor)
        token = options.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV, "")
        self.peer_client = PeerClient(token, timeout_s=options.liveness.timeout_s * 5)
        self.monitor = PeerMonitor(self._probe_peer, self._peer_failed, options.liveness)
        self._peer_urls: dict[str, str | None] = {}  # transport peer name -> base URL
        self._compute_limiter = anyio.CapacityLimiter(1)
        self._tg: anyio.abc.TaskGroup | None = None
        self._wake = anyio.Event()
        self._transport_wake = anyio.Event()
        self._stopped = anyio.Event()
        self._transition_listeners: list[Callable[[Any, RoomState, RoomState], None]] = []

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run the worker until cancelled; `task_status.started()` once it accepts requests."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self.actor.run, name=f"{self.name}-actor")
                tg.start_soon(self._transport_loop, name=f"{self.name}-transport")
                tg.start_soon(self._compute_loop, name=f"{self.name}-compute")
                tg.start_soon(self.monitor.run, name=f"{self.name}-liveness")
                task_status.started()
        finally:
            self._tg = None
            self._stopped.set()
            self._on_stop()
            self.transport.close()
            with anyio.CancelScope(shield=True):
                await self.peer_client.aclose()

    @property
    def running(self) -> bool:
        return self._tg is not None

    def _require_running(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise RequestFailedError(f"{self.name} is not running (start it with `run()`)")
        return self._tg

    def _on_stop(self) -> None:
        """Subclass hook: fail whatever is still open when the worker stops."""

    async def wait_room(self, room_id: int) -> RoomResult:
        """`actor.wait_terminal` for callers outside the worker: raises RequestFailedError
        instead of hanging if the worker stops (or crashes) first."""
        results: list[RoomResult] = []

        async def wait(scope: anyio.CancelScope) -> None:
            results.append(await self.actor.wait_terminal(room_id))
            scope.cancel()

        async def stop(scope: anyio.CancelScope) -> None:
            await self._stopped.wait()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, tg.cancel_scope)
            tg.start_soon(stop, tg.cancel_scope)
        if not results:
            raise RequestFailedError(f"{self.name} stopped before room {room_id} ended")
        return results[0]

    async def _compute_loop(self) -> None:
        raise NotImplementedError

    def wake(self) -> None:
        self._wake.set()

    def wake_transport(self) -> None:
        """A room was created or a WRITE posted: poll at the busy rate from now."""
        self._transport_wake.set()

    async def _wait_wake(self, timeout_s: float) -> None:
        with anyio.move_on_after(timeout_s):
            await self._wake.wait()
        self._wake = anyio.Event()

    # ---- rooms ----------------------------------------------------------------------------

    def room_state(self, room_id: int) -> RoomState | None:
        """Current state of a live room (read-only decision input), None when gone."""
        room = self.actor.get(room_id)
        return None if room is None else room.state

    def _on_transition(self, room: Any, trigger: str, src: RoomState, dst: RoomState,
                       absorbed: bool) -> None:
        self.metrics.on_room_transition(room, trigger, src, dst, absorbed)
        self.room_tracer.on_transition(room, trigger, src, dst, absorbed)
        if not absorbed:
            for listener in self._transition_listeners:
                listener(room, src, dst)

    def rooms_snapshot(self) -> list[dict[str, Any]]:
        rows = self.actor.snapshot()
        for row in rows:
            row["deadline_s"] = row.get("deadline_in_s")
        return rows

    def _room_gauges(self) -> dict[str, Any]:
        g = self.actor.gauges()
        by_state = g["by_state"]
        return {
            "rooms": by_state,
            "rooms_live": g["rooms"],
            "oldest_nonterminal_room_age_seconds": g["oldest_nonterminal_age_s"],
            "quarantined_pages": g["quarantined_pages"],
            "kv_pages_used": self.pool.allocator.num_used,
            "pages_used": self.pool.allocator.num_used,
            "pages_free": self.pool.allocator.num_free,
            "late_events": self.actor.counters.late_events,
            "room_timeouts": self.actor.counters.timeouts,
        }

    # ---- peers ----------------------------------------------------------------------------

    def agent_metadata(self) -> bytes:
        return self.transport.agent_metadata()

    def is_registered(self, peer: str) -> bool:
        return peer in self._peer_urls

    def _add_peer(self, agent_metadata: bytes, url: str | None) -> str:
        try:
            name = self.transport.add_peer(agent_metadata)
        except Exception as exc:  # NIXL / loopback refuse metadata they cannot load
            raise InvalidRequestError(
                "agent_metadata", f"cannot load the peer agent: {exc}"
            ) from exc
        self._peer_urls[name] = url
        if url:
            self.monitor.watch(name)
        return name

    async def _probe_peer(self, peer: str) -> None:
        url = self._peer_urls.get(peer)
        if url:
            name = await self.peer_client.heartbeat(url, self.options.liveness.timeout_s)
            if name != peer:  # a restarted worker lost our registration and its rooms
                raise PeerError(f"{url} now answers as {name!r}, not {peer!r}")

    async def _peer_failed(self, peer: str, reason: str) -> None:
        self._peer_urls.pop(peer, None)
        await self.actor.post(PeerFailed(peer, reason))

    # ---- transport loop -------------------------------------------------------------------

    async def _transport_loop(self) -> None:
        next_gauges, period = 0.0, _BUSY_POLL_S
        while True:
            events = self.transport.progress()
            # live rooms but nothing happening (e.g. waiting for a long prefill queue): back
            # off up to _MAX_BUSY_POLL_S; any event or a new room polls fast again
            period = _BUSY_POLL_S if events else min(period * 2, _MAX_BUSY_POLL_S)
            for event in events:
                self._observe_event(event)
                if isinstance(event, PeerFailed):
                    self.monitor.unwatch(event.peer)
                    self._peer_urls.pop(event.peer, None)
                await self.actor.post(event)
            now = time.monotonic()
            if now >= next_gauges:
                next_gauges = now + _GAUGE_PERIOD_S
                self.metrics.set_gauges(self.stats())
            with anyio.move_on_after(period if self.actor.live_rooms else _IDLE_POLL_S):
                await self._transport_wake.wait()  # a new room or WRITE: poll now
            if self._transport_wake.is_set():
                self._transport_wake, period = anyio.Event(), _BUSY_POLL_S

    def _observe_event(self, event: Event) -> None:
        """Subclass hook: look at (never act on) a transport event before the actor gets it."""

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    async def _step(self) -> StepOutput | None:
        """Plan and run one scheduler step in the compute thread; None when nothing can run.

        The scheduler is touched only here and by the loop between steps, never concurrently.
        """
        if not self.scheduler.has_work():
            return None
        done = await anyio.to_thread.run_sync(self.core.step, limiter=self._compute_limiter)
        return None if done is None else done[1]
