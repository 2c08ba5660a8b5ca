"""Small-scope exhaustive checks: every ordering of a small event alphabet, through the actor.

Timeouts are real: the `timeout` symbol moves the fake clock past every armed
deadline and lets the actor's heap fire. After the schedule the clock runs on
until nothing is armed (quiescence), then I1, I2 and I4 are checked, and the
outcome is compared with a reference model written independently here.
"""

from __future__ import annotations

import itertools

from pdengine.fsm import (
    DeliverPages,
    QuarantinePages,
    ReleasePages,
    RoomActor,
    RoomDeadlines,
    RoomState,
)
from pdengine.fsm.events import (
    Abort,
    AbortAcked,
    Bootstrapped,
    ChunkDone,
    CreateRoom,
    TransferFailed,
)

DEADLINES = RoomDeadlines(bootstrap_s=1, waiting_for_input_s=1, transfer_progress_s=1, drain_s=1,
                          transfer_total_s=2)
BOUND = DEADLINES.bound_s()


class Pool:
    """A page pool shared by the rooms of one test; every page is owned at most once."""

    def __init__(self, size: int) -> None:
        self.free = list(range(size))
        self.owner: dict[int, int] = {}
        self.errors: list[str] = []

    def take(self, room_id: int, n: int) -> tuple[int, ...]:
        pages = tuple(self.free.pop(0) for _ in range(n))
        for p in pages:
            self.owner[p] = room_id
        return pages

    def give_back(self, room_id: int, pages: tuple[int, ...]) -> None:
        for p in pages:
            if self.owner.pop(p, None) != room_id:
                self.errors.append(f"room {room_id} freed page {p} it did not own")
            self.free.append(p)


class Harness:
    def __init__(self, pool: Pool) -> None:
        self.now = 0.0
        self.pool = pool
        self.trace: dict[int, list[RoomState]] = {}
        self.terminal_at: dict[int, float] = {}
        self.acked: set[int] = set()
        self.released: list[tuple[int, str, float]] = []
        self.quarantined_at: dict[int, float] = {}
        self.actor = RoomActor(deadlines=DEADLINES, clock=lambda: self.now, hook=self._hook)
        self.actor.on(ReleasePages, self._release)
        self.actor.on(DeliverPages, lambda e: pool.give_back(e.room_id, e.pages))
        self.actor.on(QuarantinePages, lambda e: self.quarantined_at.__setitem__(e.room_id, self.now))

    def _hook(self, room, trigger, src, dst, absorbed):
        trace = self.trace.setdefault(room.room_id, [src])
        trace.append(dst)
        if dst.terminal and not absorbed:
            self.terminal_at[room.room_id] = self.now

    def _release(self, e: ReleasePages) -> None:
        self.released.append((e.room_id, e.reason, self.now))
        self.pool.give_back(e.room_id, e.pages)

    def create(self, room_id: int, pages: int, chunks: int) -> None:
        self.actor.apply(CreateRoom(room_id, "decode", peer="p", num_chunks=chunks,
                                    pages=self.pool.take(room_id, pages)))

    def time_passes(self, seconds: float) -> None:
        target = self.now + seconds
        while (nxt := self.actor.next_deadline()) is not None and nxt <= target:
            self.now = max(self.now, nxt)
            self.actor.expire_due()
        self.now = target

    def quiesce(self) -> None:
        self.time_passes(10 * BOUND)
        assert self.actor.next_deadline() is None

    def check_invariants(self, room_ids) -> None:
        for rid in room_ids:
            states = self.trace[rid]
            first = next(i for i, s in enumerate(states) if s.terminal)
            assert len(set(states[first:])) == 1, f"I1: room {rid} left a terminal state: {states}"
            assert self.terminal_at[rid] <= BOUND + 1e-9, "I2"
        g, c = self.actor.gauges(), self.actor.counters
        assert self.actor.live_rooms == 0 and not any(g["by_state"].values()), "I4 rooms"
        assert g["quarantined_pages"] == 0
        assert c.created == c.entered[RoomState.SUCCESS] + c.entered[RoomState.FAILED]
        assert not self.pool.owner and not self.pool.errors, "I4 pages"
        for rid, reason, at in self.released:  # I5: quarantine ends only by ack or drain
            if rid in self.quarantined_at:
                if reason == "abort acked":
                    assert rid in self.acked
                else:
                    assert reason == "drain deadline"
                    assert at >= self.quarantined_at[rid] + DEADLINES.drain_s - 1e-9


def reference_outcome(order, chunks_needed):
    """Independent model: the first of abort/fail/timeout or 'all chunks done' wins."""
    done = set()
    for symbol in order:
        if symbol in ("abort", "fail", "timeout"):
            return RoomState.FAILED
        if symbol.startswith("chunk"):
            done.add(symbol)
            if done == chunks_needed:
                return RoomState.SUCCESS
    return RoomState.FAILED  # nothing finished it: its deadline does


ONE_ROOM = ("bootstrap", "chunk0", "chunk1", "chunk2", "abort", "fail", "timeout")


def test_every_ordering_for_one_room():
    outcomes = {RoomState.SUCCESS: 0, RoomState.FAILED: 0}
    for order in itertools.permutations(ONE_ROOM):
        h = Harness(Pool(3))
        h.create(1, pages=3, chunks=3)
        for symbol in order:
            if symbol == "bootstrap":
                h.actor.apply(Bootstrapped(1, peer="p"))
            elif symbol.startswith("chunk"):
                k = int(symbol[-1])
                h.actor.apply(ChunkDone(1, k, is_last=k == 2))
            elif symbol == "abort":
                h.actor.apply(Abort(1, "client"))
            elif symbol == "fail":
                h.actor.apply(TransferFailed(1, "nixl error"))
            else:
                h.time_passes(BOUND)
            h.now += 0.001
        h.quiesce()
        result = h.actor.result(1)
        assert result.state is reference_outcome(order, {"chunk0", "chunk1", "chunk2"}), order
        h.check_invariants([1])
        outcomes[result.state] += 1
    assert outcomes[RoomState.SUCCESS] > 0 and outcomes[RoomState.FAILED] > 0


TWO_ROOMS = ("a_bootstrap", "a_chunk", "a_abort", "b_chunk", "b_abort", "a_ack", "timeout")


def test_every_ordering_for_two_rooms_sharing_a_page_pool():
    for order in itertools.permutations(TWO_ROOMS):
        pool = Pool(4)
        h = Harness(pool)
        h.create(1, pages=2, chunks=1)
        h.create(2, pages=2, chunks=1)
        for symbol in order:
            if symbol == "timeout":
                h.time_passes(BOUND)
                continue
            rid = 1 if symbol[0] == "a" else 2
            kind = symbol[2:]
            if kind == "bootstrap":
                h.actor.apply(Bootstrapped(rid))
            elif kind == "chunk":
                h.actor.apply(ChunkDone(rid, 0, is_last=True))
            elif kind == "abort":
                h.actor.apply(Abort(rid, "client"))
            else:
                h.acked.add(rid)
                h.actor.apply(AbortAcked(rid))
            h.now += 0.001
            # pages of a live or quarantined room are never handed to anyone else
            assert len(pool.owner) + len(pool.free) == 4
        h.quiesce()
        for rid, prefix in ((1, "a"), (2, "b")):
            mine = [s for s in order if s == "timeout" or s.startswith(prefix + "_")]
            expected = reference_outcome([s.replace(prefix + "_", "") for s in mine], {"chunk"})
            assert h.actor.result(rid).state is expected, (order, rid)
        h.check_invariants([1, 2])
        # the freed pool serves a new room: pages really came back
        h.create(3, pages=4, chunks=1)
        assert set(h.actor.get(3).pages) == {0, 1, 2, 3}
