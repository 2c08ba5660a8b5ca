"""The room actor on a real asyncio loop: deadlines, waiting, backpressure, peers, quarantine."""

from __future__ import annotations

import anyio
import pytest

from pdengine.config import Deadlines
from pdengine.fsm import (
    AckAbort,
    DeliverPages,
    MailboxFull,
    QuarantinePages,
    ReleasePages,
    RoomActor,
    RoomDeadlines,
    RoomState,
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
    PeerFailed,
    TransferFailed,
)

FAST = RoomDeadlines(bootstrap_s=0.05, waiting_for_input_s=0.05, transfer_progress_s=0.05,
                     drain_s=0.05, transfer_total_s=0.2)
SLOW = RoomDeadlines(bootstrap_s=60, waiting_for_input_s=60, transfer_progress_s=60,
                     drain_s=60, transfer_total_s=120)


def _record(actor: RoomActor) -> list:
    seen: list = []
    for kind in (ReleasePages, QuarantinePages, DeliverPages, TellPeer, AckAbort, RoomTerminal):
        actor.on(kind, seen.append)
    return seen


async def test_deadline_fires_and_fails_the_room():
    actor = RoomActor(deadlines=FAST)
    effects = _record(actor)
    async with actor:
        await actor.post(CreateRoom(1, "decode", peer="p0"))
        await actor.post(Bootstrapped(1))
        with anyio.fail_after(5):
            result = await actor.wait_terminal(1)
    assert result.state is RoomState.FAILED
    assert result.reason == "deadline passed in WAITING_FOR_INPUT"
    assert actor.counters.timeouts == 1
    assert TellPeer(1, "p0", result.reason) in effects
    assert actor.live_rooms == 0


async def test_full_success_lifecycle_delivers_pages_with_aux():
    actor = RoomActor(deadlines=SLOW)
    effects = _record(actor)
    async with actor:
        waiter_result = []

        async def wait() -> None:
            waiter_result.append(await actor.wait_terminal(5))  # before CreateRoom is applied

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.sleep(0)
            await actor.post(CreateRoom(5, "decode", peer="p", num_chunks=2, pages=(3, 4)))
            await actor.post(Bootstrapped(5))
            await actor.post(ChunkDone(5, 1, is_last=True, aux={"first_token": 42}))
            await actor.post(ChunkDone(5, 1, is_last=True))  # duplicate: no progress
            await actor.post(ChunkDone(5, 0))
    assert waiter_result[0].state is RoomState.SUCCESS and waiter_result[0].aux == {
        "first_token": 42
    }
    assert effects[0] == DeliverPages(5, (3, 4), {"first_token": 42})
    assert effects[1] == RoomTerminal(5, "decode", RoomState.SUCCESS, "")
    assert actor.counters.invalid_events == 1
    assert (await actor.wait_terminal(5)).state is RoomState.SUCCESS  # removed, still answered


async def test_backpressure_post_waits_and_post_nowait_raises():
    actor = RoomActor(deadlines=SLOW, mailbox_size=2)
    actor.post_nowait(CreateRoom(1, "prefill"))
    actor.post_nowait(CreateRoom(2, "prefill"))
    with pytest.raises(MailboxFull):
        actor.post_nowait(CreateRoom(3, "prefill"))
    with anyio.move_on_after(0.05) as scope:
        await actor.post(CreateRoom(3, "prefill"))
    assert scope.cancelled_caught  # nobody drains: the producer is held back
    assert actor.mailbox_depth == 2
    async with actor:
        await actor.post(CreateRoom(3, "prefill"))
        while actor.counters.created < 3:
            await anyio.sleep(0.001)
    assert actor.counters.created == 3


async def test_peer_failed_fails_every_live_room_of_that_peer_only():
    actor = RoomActor(deadlines=SLOW)
    effects = _record(actor)
    async with actor:
        await actor.post(CreateRoom(1, "prefill", peer="d0", pages=(1,)))
        await actor.post(CreateRoom(2, "decode", peer="d0", pages=(2,)))
        await actor.post(CreateRoom(3, "prefill", peer="d1", pages=(3,)))
        await actor.post(CreateRoom(4, "prefill", peer="d0", num_chunks=1))
        await actor.post(ChunkDone(4, 0, is_last=True))   # already SUCCESS before the failure
        await actor.post(PeerFailed("d0", "heartbeat lost"))
        for rid in (1, 2):
            assert (await actor.wait_terminal(rid)).reason == "heartbeat lost"
        actor_room3 = actor.get(3)
        assert actor_room3 is not None and actor_room3.state is RoomState.BOOTSTRAPPING
        assert actor.result(4).state is RoomState.SUCCESS
        # nobody to tell: the peer is dead; the receiver still quarantines its pages
        assert not [e for e in effects if isinstance(e, TellPeer)]
        assert ReleasePages(1, (1,), "failed") in effects
        assert any(isinstance(e, QuarantinePages) and e.room_id == 2 for e in effects)
        assert actor.get(2).quarantined


async def test_receiver_quarantine_until_abort_acked():
    actor = RoomActor(deadlines=SLOW)
    effects = _record(actor)
    async with actor:
        await actor.post(CreateRoom(1, "decode", peer="p0", pages=(7, 8)))
        await actor.post(Bootstrapped(1))
        await actor.post(ChunkSent(1, 0))
        await actor.post(Abort(1, "client"))
        assert (await actor.wait_terminal(1)).state is RoomState.FAILED
        assert TellPeer(1, "p0", "client") in effects
        assert not [e for e in effects if isinstance(e, ReleasePages)]
        assert actor.gauges()["quarantined_pages"] == 2
        assert actor.snapshot()[0]["quarantined"] is True
        await actor.post(AbortAcked(1))
        await actor.post(AbortAcked(1))  # a duplicate ack is a late event
    assert ReleasePages(1, (7, 8), "abort acked") in effects
    assert actor.live_rooms == 0 and actor.counters.late_events == 1


async def test_receiver_quarantine_ends_at_the_drain_deadline_without_ack():
    actor = RoomActor(deadlines=FAST)
    effects = _record(actor)
    async with actor:
        await actor.post(CreateRoom(1, "decode", peer="p0", pages=(9,)))
        await actor.post(TransferFailed(1, "checksum"))
        assert (await actor.wait_terminal(1)).state is RoomState.FAILED
        assert actor.live_rooms == 1  # quarantined: still held
        with anyio.fail_after(5):
            while actor.live_rooms:
                await anyio.sleep(0.01)
    quarantine = next(e for e in effects if isinstance(e, QuarantinePages))
    release = next(e for e in effects if isinstance(e, ReleasePages))
    assert effects.index(quarantine) < effects.index(release)
    assert release == ReleasePages(1, (9,), "drain deadline")


async def test_failing_effect_handler_is_counted_and_the_loop_survives():
    actor = RoomActor(deadlines=SLOW)

    def broken(effect):
        raise RuntimeError("handler bug")

    actor.on(ReleasePages, broken)
    async with actor:
        await actor.post(CreateRoom(1, "prefill", pages=(1,)))
        await actor.post(Abort(1))
        assert (await actor.wait_terminal(1)).state is RoomState.FAILED
        await actor.post(CreateRoom(2, "prefill", num_chunks=1))
        await actor.post(ChunkDone(2, 0, is_last=True))
        assert (await actor.wait_terminal(2)).state is RoomState.SUCCESS
    assert actor.counters.effect_errors == 1


async def test_checksum_failure_fails_and_late_events_reach_the_hook():
    calls = []
    actor = RoomActor(deadlines=SLOW, hook=lambda *a: calls.append(a[1:]))
    async with actor:
        await actor.post(CreateRoom(1, "decode"))
        await actor.post(ChunkDone(1, 0, checksum_ok=False))
        await actor.post(ChunkDone(1, 1))       # late, absorbed by the removed room's tombstone
        await actor.post(ChunkDone(99, 0))      # never existed
        await actor.post(CreateRoom(1, "decode"))  # duplicate id
        result = await actor.wait_terminal(1)
    assert result.reason == "checksum mismatch in chunk 0"
    assert calls == [
        ("fail", RoomState.BOOTSTRAPPING, RoomState.FAILED, False),
        ("chunk_done", RoomState.FAILED, RoomState.FAILED, True),
    ]
    c = actor.counters
    assert (c.late_events, c.unknown_events, c.invalid_events) == (1, 1, 1)


def test_gauges_snapshot_and_config_deadlines_on_a_fake_clock():
    now = [100.0]
    actor = RoomActor(deadlines=Deadlines(bootstrap_s=5, waiting_for_input_s=6,
                                          transfer_progress_s=7, drain_s=2),
                      clock=lambda: now[0])
    actor.apply(CreateRoom(1, "prefill", peer="d"))
    now[0] = 103.0
    actor.apply(CreateRoom(2, "decode", peer="p"))
    actor.apply(Bootstrapped(2))
    g = actor.gauges()
    assert g["by_state"]["BOOTSTRAPPING"] == 1 and g["by_state"]["WAITING_FOR_INPUT"] == 1
    assert g["oldest_nonterminal_age_s"] == 3.0
    rows = {r["room_id"]: r for r in actor.snapshot()}
    assert rows[1]["deadline_in_s"] == 2.0 and rows[2]["deadline_in_s"] == 6.0
    assert rows[2]["state"] == "WAITING_FOR_INPUT" and rows[2]["role"] == "decode"
    now[0] = 105.0
    assert actor.expire_due() == 1 and actor.result(1).state is RoomState.FAILED


def test_peer_death_shortens_an_already_quarantined_rooms_hold_to_drain_s():
    now = [0.0]
    deadlines = RoomDeadlines(bootstrap_s=30, waiting_for_input_s=60, transfer_progress_s=30,
                              drain_s=2, transfer_total_s=120)
    actor = RoomActor(deadlines=deadlines, clock=lambda: now[0])
    released: list = []
    actor.on(ReleasePages, released.append)
    actor.apply(CreateRoom(1, "decode", peer="p0", pages=(4, 5)))
    actor.apply(Abort(1, "client"))  # peer alive: held for its possible late writes
    held_until = actor.get(1).deadline
    assert actor.get(1).quarantined and held_until > 100
    now[0] = 10.0
    actor.apply(PeerFailed("p0", "heartbeat lost"))
    assert actor.get(1).deadline == 12.0
    now[0] = 12.0
    assert actor.expire_due() == 1
    assert released == [ReleasePages(1, (4, 5), "drain deadline")] and actor.live_rooms == 0


def test_bad_configuration_is_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="bootstrap_s"):
        RoomDeadlines(bootstrap_s=0)
    with pytest.raises(ValueError, match="mailbox_size"):
        RoomActor(mailbox_size=0)
    with pytest.raises(ValueError, match="deadline_jitter"):
        RoomActor(deadline_jitter=1.5)
