"""One simulated prefill/decode pair: two real room actors, a faulty network, a page ledger.

Everything runs on one fake clock with no event loop: the world pops the next
scheduled step, first firing every actor deadline that falls before it (so a
timeout happens at its exact deadline time), then applies the step through the
actor's synchronous `apply`. Invariants are checked after every step.

The protocol driver is reactive, like the real workers: the decode side
allocates pages on CreateRoom and sends them to the prefill side; the prefill
side starts chunk WRITEs once bootstrapped and only while its room is live;
each WRITE lands on the destination pages (the ledger checks I5 there) and is
then notified to both sides. Effects turn into messages: TellPeer -> Abort on
the peer, AckAbort -> AbortAcked once that room's WRITEs have landed.

Faults: every control message may be lost, duplicated or delayed far past the
deadlines; aborts race chunk completions on both sides; the link between the
workers may die (both sides get PeerFailed, later messages are lost). Model
assumption: a WRITE in flight lands within `max_write_delay_s` (< drain_s) —
the transport's own timeout — which is what makes the drain deadline sound.

A run records the steps it applied; `replay` re-applies any subsequence of a
recording (no reactions, no randomness), which is how a failing schedule is
shrunk to the shortest one that still breaks an invariant.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field, replace
from typing import Any

from pdengine.fsm.actor import RoomActor
from pdengine.fsm.deadlines import RoomDeadlines
from pdengine.fsm.effects import (
    AckAbort,
    DeliverPages,
    QuarantinePages,
    ReleasePages,
    TellPeer,
)
from pdengine.fsm.events import (
    Abort,
    AbortAcked,
    Bootstrapped,
    ChunkDone,
    ChunkSent,
    CreateRoom,
    PeerFailed,
    TransferFailed,
)
from pdengine.fsm.room import Room, RoomState

SIDES = ("P", "D")  # prefill (sender), decode (receiver)
_PEER = {"P": "D", "D": "P"}
SIM_DEADLINES = RoomDeadlines(
    bootstrap_s=2.0, waiting_for_input_s=3.0, transfer_progress_s=1.0, drain_s=1.5,
    transfer_total_s=4.0,
)


@dataclass(frozen=True)
class Faults:
    loss: float = 0.05
    duplicate: float = 0.05
    late: float = 0.05  # delayed up to 2x the I2 bound
    abort: float = 0.15  # per room, a client abort on a random side at a random time
    write_error: float = 0.03
    peer_death: float = 0.1  # per run
    max_write_delay_s: float = 0.5


@dataclass(frozen=True)
class Step:
    """One applied step: an event for a side's actor, or a sim action ("land"/"free")."""

    t: float
    side: str
    event: Any  # an fsm event, or ("land", room_id, chunk) / ("free", room_id)

    def __str__(self) -> str:
        return f"t={self.t:8.4f} {self.side} {self.event!r}"


@dataclass
class Violation:
    invariant: str
    detail: str
    t: float

    def __str__(self) -> str:
        return f"{self.invariant} at t={self.t:.4f}: {self.detail}"


class PageLedger:
    """Who owns each page of one side's pool; flags double frees and stale writes."""

    def __init__(self, num_pages: int) -> None:
        self.owner: dict[int, int] = {}
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # LIFO: reuse fast
        self.allocated = 0
        self.freed = 0

    def take(self, room_id: int, count: int) -> tuple[int, ...] | None:
        if len(self.free) < count:
            return None
        pages = tuple(self.free.pop() for _ in range(count))
        return self.claim(room_id, pages)

    def claim(self, room_id: int, pages: tuple[int, ...]) -> tuple[int, ...] | None:
        if any(p in self.owner for p in pages):
            return None
        for p in pages:
            self.owner[p] = room_id
            if p in self.free:
                self.free.remove(p)
        self.allocated += len(pages)
        return pages

    def release(self, room_id: int, pages: tuple[int, ...]) -> str | None:
        for p in pages:
            if self.owner.get(p) != room_id:
                return f"room {room_id} released page {p} owned by {self.owner.get(p)}"
        for p in pages:
            del self.owner[p]
            self.free.append(p)
        self.freed += len(pages)
        return None


@dataclass
class World:
    seed: int
    rooms: int
    faults: Faults = field(default_factory=Faults)
    deadlines: RoomDeadlines = SIM_DEADLINES
    now: float = 0.0
    steps: int = 0
    recording: list[Step] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    max_time_to_terminal_s: float = 0.0
    reactive: bool = True

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.bound_s = self.deadlines.bound_s()
        self.actors = {
            side: RoomActor(
                deadlines=self.deadlines,
                clock=lambda: self.now,
                rng=random.Random(self.seed * 2 + i),
                deadline_jitter=0.1,
                hook=self._make_hook(side),
            )
            for i, side in enumerate(SIDES)
        }
        self.ledgers = {side: PageLedger(4 * self.rooms + 4) for side in SIDES}
        self._queue: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._link_dead_at = float("inf")
        self._dst_pages: dict[int, tuple[int, ...]] = {}
        self._chunks: dict[int, int] = {}
        self._landing: dict[int, float] = {}  # room -> latest landing time of its WRITEs
        self._delivered: dict[int, tuple[int, ...]] = {}  # decode batch holds these pages
        self._computing: set[int] = set()  # prefill rooms whose chunks are scheduled
        for side in SIDES:
            actor = self.actors[side]
            actor.on(ReleasePages, lambda e, s=side: self._release(s, e.room_id, e.pages))
            actor.on(QuarantinePages, lambda e: None)
            actor.on(DeliverPages, self._deliver)
            actor.on(TellPeer, lambda e, s=side: self._tell_peer(s, e))
            actor.on(AckAbort, self._ack_abort)

    # ---- schedule ----------------------------------------------------------------
    def _push(self, t: float, side: str, event: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (t, self._seq, side, event))

    def _send(self, side: str, event: Any, extra_delay: float = 0.0) -> None:
        """A control message over the faulty network to `side`."""
        t = self.now + extra_delay
        if t >= self._link_dead_at or self.rng.random() < self.faults.loss:
            return
        copies = 2 if self.rng.random() < self.faults.duplicate else 1
        for _ in range(copies):
            if self.rng.random() < self.faults.late:
                delay = self.rng.uniform(0.0, 2 * self.bound_s)
            else:
                delay = self.rng.uniform(0.0, 0.05)
            self._push(t + delay, side, event)

    def seed_rooms(self) -> None:
        f, rng = self.faults, self.rng
        spread = self.bound_s
        for rid in range(self.rooms):
            t0 = rng.uniform(0.0, spread)
            self._chunks[rid] = rng.randint(1, 4)
            # the router hands the request to prefill first, decode a moment later
            self._push(t0, "P", CreateRoom(rid, "prefill", peer="D", num_chunks=self._chunks[rid]))
            self._push(t0 + rng.uniform(0, 0.05), "D", CreateRoom(rid, "decode", peer="P"))
            if rng.random() < f.abort:
                self._push(t0 + rng.uniform(0, 1.5), rng.choice(SIDES), Abort(rid, "client"))
        if rng.random() < f.peer_death:
            self._link_dead_at = rng.uniform(0.0, spread)
            self._push(self._link_dead_at, "D", PeerFailed("P"))
            self._push(self._link_dead_at, "P", PeerFailed("D"))

    # ---- running --------------------------------------------------------------------
    def run(self) -> None:
        self.seed_rooms()
        self._drain()
        self._check_quiescent()

    def replay(self, schedule: list[Step]) -> None:
        self.reactive = False
        for step in schedule:
            if self.violations:
                return
            self._advance(step.t)
            self._apply(step)
        self._drain()
        self._check_quiescent()

    def _drain(self) -> None:
        """Apply queued steps and fire deadlines until nothing is left to happen."""
        while not self.violations:
            if self._queue:
                t, _, side, event = heapq.heappop(self._queue)
                self._advance(t)
                self._apply(Step(t, side, event))
                continue
            pending = [d for a in self.actors.values() if (d := a.next_deadline()) is not None]
            if not pending:
                return
            self._advance(min(pending))

    def _advance(self, t: float) -> None:
        """Fire every deadline before `t` at its own time, then set the clock to `t`."""
        while not self.violations:
            due = [(a.next_deadline(), s) for s, a in self.actors.items()]
            due = [(d, s) for d, s in due if d is not None and d <= t]
            if not due:
                break
            when, side = min(due)
            self.now = max(self.now, when)
            self.actors[side].expire_due(when)
            self._check_bounds()
        self.now = max(self.now, t)

    def _check_quiescent(self) -> None:
        """I4 once nothing is left to happen; time passes first, so a stuck room shows (I2)."""
        self.now += 2 * self.bound_s
        self._check_bounds()
        if self.violations:
            return
        for side, actor in self.actors.items():
            g, c = actor.gauges(), actor.counters
            terminal = c.entered[RoomState.SUCCESS] + c.entered[RoomState.FAILED]
            if actor.live_rooms or any(g["by_state"].values()) or g["quarantined_pages"]:
                self._violate("I4", f"{side}: not quiescent: {g}")
            elif c.created != terminal:
                self._violate("I4", f"{side}: created {c.created} != terminal {terminal}")
            ledger = self.ledgers[side]
            if ledger.owner or ledger.allocated != ledger.freed:
                self._violate("I4", f"{side}: pages still held: {sorted(ledger.owner.items())}")

    def _apply(self, step: Step) -> None:
        self.steps += 1
        self.recording.append(step)
        ev, side = step.event, step.side
        if isinstance(ev, tuple):
            (self._land if ev[0] == "land" else self._decode_done)(side, *ev[1:])
        elif isinstance(ev, CreateRoom):
            ev = self._allocate(side, ev)
            if ev is None:
                self.recording.pop()
                return
            self.recording[-1] = replace(step, event=ev)
            self.actors[side].apply(ev)
            if side == "D":
                self._dst_pages[ev.room_id] = ev.pages
                if self.reactive:
                    self._send("P", Bootstrapped(ev.room_id, peer="D", dst_pages=ev.pages))
        else:
            self.actors[side].apply(ev)
            if self.reactive:
                self._react(side, ev)
        self._check_bounds()

    def _allocate(self, side: str, ev: CreateRoom) -> CreateRoom | None:
        ledger = self.ledgers[side]
        if ev.pages:  # replay: the recorded pages
            return ev if ledger.claim(ev.room_id, ev.pages) else None
        count = self._chunks.get(ev.room_id, 1)
        pages = ledger.take(ev.room_id, count)
        return None if pages is None else replace(ev, pages=pages)

    def _react(self, side: str, ev: Any) -> None:
        """What the real workers do after an event: the prefill side computes and WRITEs."""
        if side != "P" or not isinstance(ev, Bootstrapped | ChunkSent):
            return
        room = self.actors["P"].get(ev.room_id)
        if room is None or room.terminal:
            return  # the transport reads the decision: no WRITE for a dead room
        if isinstance(ev, Bootstrapped):
            if room.state is not RoomState.WAITING_FOR_INPUT or ev.room_id in self._computing:
                return  # a duplicate bootstrap does not restart the prefill
            self._computing.add(ev.room_id)
            self._send("D", Bootstrapped(ev.room_id, peer="P"))
            t = self.now
            for chunk in range(self._chunks[ev.room_id]):
                t += self.rng.uniform(0.0, 0.6)
                self._push(t, "P", ChunkSent(ev.room_id, chunk))
            return
        self._post_write(room, ev.chunk)

    def _post_write(self, room: Room, chunk: int) -> None:
        if room.state is not RoomState.TRANSFERRING or not room.dst_pages:
            return
        lands = self.now + self.rng.uniform(0.0, self.faults.max_write_delay_s)
        self._landing[room.room_id] = max(self._landing.get(room.room_id, 0.0), lands)
        self._push(lands, "D", ("land", room.room_id, chunk))

    def _land(self, side: str, room_id: int, chunk: int) -> None:
        """A WRITE lands on the decode pool: I5 says those pages are still this room's."""
        pages = self._dst_pages.get(room_id, ())
        for p in pages:
            owner = self.ledgers["D"].owner.get(p)
            if owner != room_id:
                self._violate("I5", f"WRITE of room {room_id} landed on page {p} owned by {owner}")
                return
        if not self.reactive:
            return
        last = chunk == self._chunks[room_id] - 1
        if self.rng.random() < self.faults.write_error:
            self._push(self.now, "P", TransferFailed(room_id, "write error"))
            return
        self._push(self.now, "P", ChunkDone(room_id, chunk, is_last=last))
        self._send("D", ChunkDone(room_id, chunk, is_last=last))

    def _decode_done(self, side: str, room_id: int) -> None:
        room_pages = self._delivered.pop(room_id, ())
        self._release("D", room_id, room_pages)

    # ---- effects ------------------------------------------------------------------------
    def _release(self, side: str, room_id: int, pages: tuple[int, ...]) -> None:
        err = self.ledgers[side].release(room_id, pages)
        if err:
            self._violate("I4", f"{side}: {err}")

    def _deliver(self, e: DeliverPages) -> None:
        self._delivered[e.room_id] = e.pages
        if self.reactive:  # the decode batch finishes and frees the pages later
            self._push(self.now + self.rng.uniform(0.0, 1.0), "D", ("free", e.room_id))

    def _tell_peer(self, side: str, e: TellPeer) -> None:
        if self.reactive:
            self._send(_PEER[side], Abort(e.room_id, e.reason, from_peer=True))

    def _ack_abort(self, e: AckAbort) -> None:
        if self.reactive:
            drained = max(0.0, self._landing.get(e.room_id, 0.0) - self.now)
            self._send("D", AbortAcked(e.room_id), extra_delay=drained)

    # ---- invariants -----------------------------------------------------------------------
    def _make_hook(self, side: str):
        def hook(room: Room, trigger: str, src: RoomState, dst: RoomState, absorbed: bool) -> None:
            if src.terminal and (not absorbed or dst is not src):
                self._violate("I1", f"{side} room {room.room_id} left {src.name} by {trigger}")
            if dst.terminal and not absorbed:
                took = self.now - room.created_at
                self.max_time_to_terminal_s = max(self.max_time_to_terminal_s, took)
                if took > self.bound_s + 1e-9:
                    self._violate("I2", f"{side} room {room.room_id} terminal after {took:.3f}s")

        return hook

    def _check_bounds(self) -> None:
        for side, actor in self.actors.items():
            age = actor.oldest_nonterminal_age_s()
            if age > self.bound_s + 1e-9:
                self._violate("I2", f"{side}: a room is non-terminal after {age:.3f}s")

    def _violate(self, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, detail, self.now))

