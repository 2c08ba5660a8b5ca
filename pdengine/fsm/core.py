"""The synchronous core of the room actor: the room table, the deadline heap, effects.

Every method here is a plain call with no awaits, so the same code is driven by
`RoomActor.run()` (an asyncio task reading the mailbox) and by the simulator
(a fake clock and no event loop). See `pdengine.fsm.actor` for the lifecycle.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdengine.fsm.deadlines import DeadlineHeap, DeadlineSource, RoomDeadlines
from pdengine.fsm.effects import (
    AckAbort,
    DeliverPages,
    Effect,
    QuarantinePages,
    ReleasePages,
    RoomTerminal,
    TellPeer,
)
from pdengine.fsm.events import (
    Abort,
    AbortAcked,
    Bootstrapped,
    ChunkDone,
    ChunkSent,
    CreateRoom,
    Event,
    PeerFailed,
    RoomEvent,
    Timeout,
    TransferFailed,
)
from pdengine.fsm.room import Room, RoomState, TransitionHook

log = logging.getLogger(__name__)

_B, _W, _T = RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING
_F, _S = RoomState.FAILED, RoomState.SUCCESS
_TRIGGER_OF: dict[type, str] = {
    Bootstrapped: "bootstrap",
    ChunkSent: "chunk_sent",
    ChunkDone: "chunk_done",
    TransferFailed: "fail",
    Abort: "abort",
    Timeout: "timeout",
    AbortAcked: "abort_acked",
}


@dataclass(frozen=True, slots=True)
class RoomResult:
    room_id: int
    state: RoomState
    reason: str
    aux: dict[str, Any] | None = None


@dataclass
class ActorCounters:
    created: int = 0
    entered: dict[RoomState, int] = field(default_factory=lambda: dict.fromkeys(RoomState, 0))
    late_events: int = 0  # absorbed by a terminal room (I1)
    invalid_events: int = 0  # absorbed by a non-terminal room (duplicate / out of order)
    unknown_events: int = 0  # for a room id never seen or long forgotten
    timeouts: int = 0
    pages_quarantined: int = 0
    effects_run: int = 0
    effect_errors: int = 0
    unhandled_effects: int = 0
    removed: int = 0


class RoomCore:
    """Owns rooms; `apply` one event at a time, `expire_due` to enforce deadlines."""

    def __init__(
        self,
        *,
        deadlines: DeadlineSource | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        hook: TransitionHook | None = None,
        deadline_jitter: float = 0.0,
        keep_results: int = 16384,
    ) -> None:
        if not 0.0 <= deadline_jitter < 1.0:
            raise ValueError(f"deadline_jitter must be in [0, 1), got {deadline_jitter}")
        self.deadlines = RoomDeadlines.from_source(deadlines or RoomDeadlines())
        self._spans = {s: self.deadlines.for_state(s) for s in (_B, _W, _T)}
        self._clock = clock
        self._rng = rng or random.Random()
        self._jitter = deadline_jitter
        self._user_hook = hook
        self._rooms: dict[int, Room] = {}
        self._results: OrderedDict[int, tuple[RoomResult, Room]] = OrderedDict()
        self._keep_results = keep_results
        self._heap = DeadlineHeap()
        self._handlers: dict[type, list[Callable[[Any], None]]] = {}
        self._by_state: dict[RoomState, int] = dict.fromkeys(RoomState, 0)
        self.counters = ActorCounters()
        self._dispatch: dict[type, Callable[[Any], None]] = {
            CreateRoom: self._on_create,
            Bootstrapped: self._on_bootstrapped,
            ChunkSent: self._on_chunk_sent,
            ChunkDone: self._on_chunk_done,
            TransferFailed: self._on_transfer_failed,
            Abort: self._on_abort,
            AbortAcked: self._on_abort_acked,
            Timeout: self._on_timeout,
            PeerFailed: self._on_peer_failed,
        }

    # ---- wiring -------------------------------------------------------------
    def on(self, effect_type: type[Effect], handler: Callable[[Any], None]) -> None:
        """Register a synchronous, non-blocking handler run by the actor for `effect_type`."""
        self._handlers.setdefault(effect_type, []).append(handler)

    # ---- synchronous step API ---------------------------------------------------
    def apply(self, event: Event) -> None:
        """Apply one event. Never raises for protocol-level surprises (I1)."""
        self._dispatch[type(event)](event)

    def next_deadline(self) -> float | None:
        return self._heap.next_time()

    def expire_due(self, now: float | None = None) -> int:
        """Fire every deadline at or before `now` (default: the clock). Returns how many fired."""
        now = self._clock() if now is None else now
        fired = 0
        while (due := self._heap.pop_due(now)) is not None:
            when, room_id = due
            room = self._rooms.get(room_id)
            if room is None or when != room.heap_time:
                continue  # removed room or superseded entry
            room.heap_time = float("inf")
            if room.deadline > now:  # deadline moved later since this entry was pushed
                self._arm(room, room.deadline)
                continue
            fired += 1
            if room.quarantined:
                self._release_quarantine(room, "drain deadline")
            else:
                self._on_timeout(Timeout(room_id, int(room.state)))
        return fired

    # ---- introspection ----------------------------------------------------------
    @property
    def live_rooms(self) -> int:
        return len(self._rooms)

    def get(self, room_id: int) -> Room | None:
        return self._rooms.get(room_id)

    def result(self, room_id: int) -> RoomResult | None:
        done = self._results.get(room_id)
        return done[0] if done else None

    def oldest_nonterminal_age_s(self) -> float:
        for room in self._rooms.values():  # creation order: the first non-terminal is oldest
            if not room.state.terminal:
                return self._clock() - room.created_at
        return 0.0

    def gauges(self) -> dict[str, Any]:
        return {
            "rooms": len(self._rooms),
            "by_state": {s.name: n for s, n in self._by_state.items()},
            "oldest_nonterminal_age_s": self.oldest_nonterminal_age_s(),
            "quarantined_pages": sum(len(r.pages) for r in self._rooms.values() if r.quarantined),
        }

    def snapshot(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [
            {
                "room_id": r.room_id,
                "role": r.role,
                "state": r.state.name,
                "peer": r.peer,
                "age_s": now - r.created_at,
                "state_age_s": now - r.state_since,
                "deadline_in_s": r.deadline - now,
                "quarantined": r.quarantined,
                "reason": r.reason,
            }
            for r in self._rooms.values()
        ]

    # ---- event handlers -----------------------------------------------------------
    def _room_for(self, event: RoomEvent) -> Room | None:
        """The live room, or None after absorbing the event on its tombstone / counting it."""
        room = self._rooms.get(event.room_id)
        if room is not None:
            return room
        done = self._results.get(event.room_id)
        if done is not None:
            done[1].absorb(_TRIGGER_OF[type(event)])
        else:
            self.counters.unknown_events += 1
            log.debug("event for unknown room %s: %r", event.room_id, event)
        return None

    def _on_create(self, ev: CreateRoom) -> None:
        if ev.room_id in self._rooms or ev.room_id in self._results:
            self.counters.invalid_events += 1
            log.warning("duplicate CreateRoom for room %s ignored", ev.room_id)
            return
        now = self._clock()
        room = Room(
            ev.room_id,
            ev.role,
            peer=ev.peer,
            pages=tuple(ev.pages),
            num_chunks=ev.num_chunks,
            hook=self._on_transition,
            now=now,
        )
        self._rooms[ev.room_id] = room
        self._by_state[_B] += 1
        self.counters.created += 1
        self.counters.entered[_B] += 1
        self._arm(room, self._deadline_for(room, _B, now))

    def _on_bootstrapped(self, ev: Bootstrapped) -> None:
        room = self._room_for(ev)
        if room is None:
            return
        if not room.state.terminal:
            if ev.peer:
                room.peer = ev.peer
            if ev.dst_pages:
                room.dst_pages = tuple(ev.dst_pages)
        room.fire("bootstrap")

    def _on_chunk_sent(self, ev: ChunkSent) -> None:
        room = self._room_for(ev)
        if room is not None:
            room.fire("chunk_sent")

    def _on_chunk_done(self, ev: ChunkDone) -> None:
        room = self._room_for(ev)
        if room is None:
            return
        if room.state.terminal:
            room.absorb("chunk_done")
            return
        if not ev.checksum_ok:
            self._fail(room, "fail", f"checksum mismatch in chunk {ev.chunk}")
            return
        if ev.chunk in room.chunks_done:
            room.absorb("chunk_done")  # duplicate delivery: no progress
            return
        if ev.is_last:
            room.last_chunk = ev.chunk
        if ev.aux is not None:
            room.aux = ev.aux
        if not room.fire("chunk_done"):
            return
        room.chunks_done.add(ev.chunk)
        last = room.last_chunk
        done = room.chunks_done
        if last is not None and len(done) > last and all(i in done for i in range(last + 1)):
            room.succeed()

    def _on_transfer_failed(self, ev: TransferFailed) -> None:
        room = self._room_for(ev)
        if room is not None:
            self._fail(room, "fail", ev.reason)

    def _on_abort(self, ev: Abort) -> None:
        room = self._room_for(ev)
        if room is not None:
            self._fail(room, "abort", ev.reason, "abort" if ev.from_peer else "")
            return
        done = self._results.get(ev.room_id)
        if ev.from_peer and done is not None and done[1].role == "prefill" and done[1].peer:
            # the peer's abort raced our own end: it still waits for the ack (I5)
            self._emit(AckAbort(ev.room_id, done[1].peer))

    def _on_abort_acked(self, ev: AbortAcked) -> None:
        room = self._room_for(ev)
        if room is None:
            return
        if room.quarantined:
            self._release_quarantine(room, "abort acked")
        else:
            room.absorb("abort_acked")

    def _on_timeout(self, ev: Timeout) -> None:
        room = self._room_for(ev)
        if room is None:
            return
        if ev.state >= 0 and int(room.state) != ev.state:
            room.absorb("timeout")  # the room moved on since this timeout was decided
            return
        if self._fail(room, "timeout", f"deadline passed in {room.state.name}"):
            self.counters.timeouts += 1

    def _on_peer_failed(self, ev: PeerFailed) -> None:
        for room in [r for r in self._rooms.values() if r.peer == ev.peer]:
            if not room.state.terminal:
                self._fail(room, "fail", ev.reason, "dead")
            elif room.quarantined:
                # Held for a live peer's writes; a dead peer's in-flight WRITEs land within drain_s.
                room.from_peer = "dead"
                self._arm(room, min(room.deadline, self._clock() + self.deadlines.drain_s))

    def _fail(self, room: Room, trigger: str, reason: str, from_peer: str = "") -> bool:
        if not room.state.terminal:
            room.reason = reason
            room.from_peer = from_peer
        return room.fire(trigger)

    # ---- the one hook path ------------------------------------------------------------
    def _on_transition(
        self, room: Room, trigger: str, src: RoomState, dst: RoomState, absorbed: bool
    ) -> None:
        if absorbed:
            if src.terminal:
                self.counters.late_events += 1
            else:
                self.counters.invalid_events += 1
        else:
            now = self._clock()
            if dst is not src:
                self._by_state[src] -= 1
                self._by_state[dst] += 1
                room.state_since = now
            self.counters.entered[dst] += 1
            if not dst.terminal:
                if dst is _T and src is not _T:
                    room.transfer_started = now
                self._arm(room, self._deadline_for(room, dst, now))
        if self._user_hook is not None:
            self._user_hook(room, trigger, src, dst, absorbed)
        if not absorbed and dst.terminal:
            self._finish(room)

    # ---- terminal: effects, waiters, removal ---------------------------------------------
    def _finish(self, room: Room) -> None:
        state, rid = room.state, room.room_id
        effects: list[Effect] = []
        if room.role == "prefill":
            if state is _F and room.peer:
                if room.from_peer == "abort":
                    effects.append(AckAbort(rid, room.peer))
                elif not room.from_peer:
                    effects.append(TellPeer(rid, room.peer, room.reason))
            if room.pages:
                effects.append(ReleasePages(rid, room.pages, state.name.lower()))
        elif state is _S:
            effects.append(DeliverPages(rid, room.pages, room.aux))
        else:
            if room.peer and not room.from_peer:
                effects.append(TellPeer(rid, room.peer, room.reason))
            if room.pages:
                drain_at = self._drain_deadline(room)
                room.quarantined = True
                self.counters.pages_quarantined += len(room.pages)
                self._arm(room, drain_at)
                effects.append(QuarantinePages(rid, room.pages, drain_at))
        effects.append(RoomTerminal(rid, room.role, state, room.reason))
        result = RoomResult(rid, state, room.reason, room.aux)
        self._results[rid] = (result, room)
        if len(self._results) > self._keep_results:
            self._results.popitem(last=False)
        for effect in effects:
            self._emit(effect)
        self._terminal_reached(result)
        if not room.quarantined:
            self._remove(room)

    def _terminal_reached(self, result: RoomResult) -> None:
        """Called once per room when it turns terminal, after its effects ran."""

    def _release_quarantine(self, room: Room, reason: str) -> None:
        room.quarantined = False
        room.deadline = room.heap_time = float("inf")
        self._emit(ReleasePages(room.room_id, room.pages, reason))
        self._remove(room)

    def _remove(self, room: Room) -> None:
        del self._rooms[room.room_id]
        self._by_state[room.state] -= 1
        self.counters.removed += 1

    def _emit(self, effect: Effect) -> None:
        handlers = self._handlers.get(type(effect))
        if not handlers:
            self.counters.unhandled_effects += 1
            return
        for handler in handlers:
            self.counters.effects_run += 1
            try:
                handler(effect)
            except Exception:
                self.counters.effect_errors += 1
                log.exception("effect handler failed for %r", effect)

    # ---- deadlines ----------------------------------------------------------------------
    def _deadline_for(self, room: Room, state: RoomState, now: float) -> float:
        span = self._spans[state]
        if self._jitter:
            span *= 1.0 - self._jitter * self._rng.random()  # jitter only shortens (I2 holds)
        when = now + span
        if state is _T:
            when = min(when, room.transfer_started + self.deadlines.transfer_total_s)
        return when

    def _drain_deadline(self, room: Room) -> float:
        """When a failed receiver's pages may be reused without an abort-ack (I5).

        A dead peer posts nothing new: its in-flight WRITEs land within `drain_s`. A live
        peer that never heard of the failure (its notification lost) keeps writing until
        its own room ends, at the latest its I2 bound after *its* creation. Assumption: the
        sender room is created at most `bootstrap_s` after this one (a prefill worker keeps
        an early page offer no longer than that), so the last WRITE lands by
        `created_at + bootstrap_s + bound_s + drain_s`. An abort-ack ends it sooner.
        """
        d, now = self.deadlines, self._clock()
        if room.from_peer == "dead":
            return now + d.drain_s
        return max(now, room.created_at + d.bootstrap_s + d.bound_s()) + d.drain_s

    def _arm(self, room: Room, when: float) -> None:
        room.deadline = when
        if when < room.heap_time:
            room.heap_time = when
            self._heap.push(when, room.room_id)
