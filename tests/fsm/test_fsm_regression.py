"""Replays of the production failures of DESIGN.md §1 through the real actor (fake clock)."""

from __future__ import annotations

from pdengine.fsm import (
    AckAbort,
    QuarantinePages,
    ReleasePages,
    RoomActor,
    RoomDeadlines,
    RoomState,
    TellPeer,
)
from pdengine.fsm.events import Abort, Bootstrapped, ChunkDone, ChunkSent, CreateRoom

DEADLINES = RoomDeadlines(bootstrap_s=30, waiting_for_input_s=60, transfer_progress_s=30,
                          drain_s=10, transfer_total_s=120)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _actor(clock: Clock, effects: list) -> RoomActor:
    actor = RoomActor(deadlines=DEADLINES, clock=clock)
    for kind in (ReleasePages, QuarantinePages, TellPeer, AckAbort):
        actor.on(kind, effects.append)
    return actor


def _run_until_idle(actor: RoomActor, clock: Clock) -> None:
    while (nxt := actor.next_deadline()) is not None:
        clock.now = max(clock.now, nxt)
        actor.expire_due()


def test_abort_then_late_transferring_write_then_skipped_last_chunk_decode_side():
    clock, effects = Clock(), []
    actor = _actor(clock, effects)
    actor.apply(CreateRoom(7, "decode", peer="prefill-0", num_chunks=3, pages=(10, 11, 12)))
    actor.apply(Bootstrapped(7, peer="prefill-0"))
    actor.apply(ChunkDone(7, 0))
    assert actor.get(7).state is RoomState.TRANSFERRING

    actor.apply(Abort(7, "client disconnected"))          # 1. abort
    actor.apply(ChunkSent(7, 1))                          # 2. a late "transferring" write
    actor.apply(ChunkDone(7, 1))
    # 3. the last chunk (2) is skipped: nothing more ever arrives for this room
    room = actor.get(7)
    assert room.state is RoomState.FAILED and room.late_events == 2
    assert actor.counters.late_events == 2
    assert [type(e) for e in effects] == [TellPeer, QuarantinePages]  # pages not reused yet

    _run_until_idle(actor, clock)                          # no ack: the drain deadline frees
    assert effects[-1] == ReleasePages(7, (10, 11, 12), "drain deadline")
    assert actor.result(7).state is RoomState.FAILED
    assert actor.live_rooms == 0 and actor.gauges()["quarantined_pages"] == 0
    assert sum(len(e.pages) for e in effects if isinstance(e, ReleasePages)) == 3


def test_same_race_on_the_prefill_side_acks_and_frees_source_pages():
    clock, effects = Clock(), []
    actor = _actor(clock, effects)
    actor.apply(CreateRoom(8, "prefill", peer="decode-0", num_chunks=3, pages=(1, 2, 3)))
    actor.apply(Bootstrapped(8, peer="decode-0", dst_pages=(10, 11, 12)))
    actor.apply(ChunkSent(8, 0))
    actor.apply(Abort(8, "peer aborted", from_peer=True))
    actor.apply(ChunkDone(8, 0))                           # the in-flight WRITE completes late
    assert actor.get(8) is None                           # terminal, effects ran, removed
    assert actor.result(8).state is RoomState.FAILED
    assert effects == [AckAbort(8, "decode-0"), ReleasePages(8, (1, 2, 3), "failed")]
    assert actor.counters.late_events == 1


def test_room_left_in_limbo_is_timed_out_within_its_deadlines():
    """§1.2/§1.3: the last chunk is skipped without any abort; the deadline ends the room."""
    clock, effects = Clock(), []
    actor = _actor(clock, effects)
    start = clock.now
    actor.apply(CreateRoom(9, "prefill", peer="d", num_chunks=2, pages=(4,)))
    actor.apply(Bootstrapped(9, dst_pages=(5,)))
    actor.apply(ChunkSent(9, 0))
    actor.apply(ChunkDone(9, 0))
    _run_until_idle(actor, clock)
    result = actor.result(9)
    assert result.state is RoomState.FAILED and "TRANSFERRING" in result.reason
    assert clock.now - start <= DEADLINES.bound_s()
    assert actor.counters.timeouts == 1
    assert TellPeer(9, "d", result.reason) in effects       # I6: the peer is told
    assert ReleasePages(9, (4,), "failed") in effects


def test_drain_deadline_outlasts_an_uninformed_sender_unless_the_peer_is_dead():
    from pdengine.fsm.events import PeerFailed

    clock, effects = Clock(), []
    actor = _actor(clock, effects)
    created = clock.now
    actor.apply(CreateRoom(1, "decode", peer="p0", pages=(1,)))
    actor.apply(CreateRoom(2, "decode", peer="p1", pages=(2,)))
    clock.now += 5
    actor.apply(Abort(1, "client"))          # p0 may never hear of it: wait it out
    actor.apply(PeerFailed("p1"))             # p1 is gone: only in-flight WRITEs remain
    drains = {e.room_id: e.drain_deadline for e in effects if isinstance(e, QuarantinePages)}
    d = DEADLINES
    assert drains[1] == created + d.bootstrap_s + d.bound_s() + d.drain_s
    assert drains[2] == clock.now + d.drain_s
    _run_until_idle(actor, clock)
    released = [e.room_id for e in effects if isinstance(e, ReleasePages)]
    assert released == [2, 1]


def test_a_peer_abort_racing_the_senders_own_end_is_still_acked():
    clock, effects = Clock(), []
    actor = _actor(clock, effects)
    actor.apply(CreateRoom(3, "prefill", peer="decode-0", num_chunks=1, pages=(1,)))
    actor.apply(ChunkDone(3, 0, is_last=True))
    assert actor.result(3).state is RoomState.SUCCESS
    actor.apply(Abort(3, "client", from_peer=True))
    assert effects[-1] == AckAbort(3, "decode-0")
    assert actor.counters.late_events == 1
