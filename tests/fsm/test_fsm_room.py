"""The room and request tables: every state x every trigger, absorption, the one hook path."""

from __future__ import annotations

import pytest

from pdengine.fsm import (
    REQUEST_TRANSITIONS,
    REQUEST_TRIGGERS,
    ROOM_TRANSITIONS,
    ROOM_TRIGGERS,
    RequestLifecycle,
    RequestState,
    Room,
    RoomState,
)
from pdengine.fsm.machine import TableMachine
from pdengine.fsm.room import ROOM_MACHINE

F, B, W, T, S = (
    RoomState.FAILED,
    RoomState.BOOTSTRAPPING,
    RoomState.WAITING_FOR_INPUT,
    RoomState.TRANSFERRING,
    RoomState.SUCCESS,
)
ABSORB = None  # no transition: state kept, event counted

# Written out by hand, independently of ROOM_TRANSITIONS: the contract.
EXPECTED_ROOM = {
    B: {"bootstrap": W, "chunk_sent": T, "chunk_done": T, "succeed": ABSORB,
        "abort": F, "fail": F, "timeout": F},
    W: {"bootstrap": ABSORB, "chunk_sent": T, "chunk_done": T, "succeed": ABSORB,
        "abort": F, "fail": F, "timeout": F},
    T: {"bootstrap": ABSORB, "chunk_sent": T, "chunk_done": T, "succeed": S,
        "abort": F, "fail": F, "timeout": F},
    S: dict.fromkeys(ROOM_TRIGGERS, ABSORB),
    F: dict.fromkeys(ROOM_TRIGGERS, ABSORB),
}


def test_room_state_values_are_kvpoll_compatible():
    assert [(s.name, int(s)) for s in RoomState] == [
        ("FAILED", 0), ("BOOTSTRAPPING", 1), ("WAITING_FOR_INPUT", 2),
        ("TRANSFERRING", 3), ("SUCCESS", 4),
    ]
    assert ROOM_TRIGGERS == (
        "bootstrap", "chunk_sent", "chunk_done", "succeed", "abort", "fail", "timeout"
    )
    assert all({"trigger", "source", "dest"} <= row.keys() for row in ROOM_TRANSITIONS)


def _room_in(state: RoomState, calls: list) -> Room:
    room = Room(1, "decode", hook=lambda *a: calls.append(a))
    path = {B: [], W: ["bootstrap"], T: ["bootstrap", "chunk_done"],
            S: ["bootstrap", "chunk_done", "succeed"], F: ["abort"]}[state]
    for trigger in path:
        assert room.fire(trigger)
    assert room.state is state
    calls.clear()
    return room


@pytest.mark.parametrize("state", list(RoomState), ids=lambda s: s.name)
@pytest.mark.parametrize("trigger", ROOM_TRIGGERS)
def test_every_state_times_every_trigger(state, trigger):
    calls: list = []
    room = _room_in(state, calls)
    expected = EXPECTED_ROOM[state][trigger]
    changed = getattr(room, trigger)()  # one method per trigger
    if expected is ABSORB:
        assert changed is False
        assert room.state is state
        assert calls == [(room, trigger, state, state, True)]
        assert (room.late_events, room.invalid_events) == ((1, 0) if state.terminal else (0, 1))
    else:
        assert changed is True
        assert room.state is expected and isinstance(room.state, RoomState)
        assert calls == [(room, trigger, state, expected, False)]
        assert room.late_events == room.invalid_events == 0


def test_terminal_absorbs_every_trigger_forever():
    for terminal_path in (["abort"], ["bootstrap", "chunk_done", "succeed"]):
        room = Room(3, "prefill")
        for trigger in terminal_path:
            room.fire(trigger)
        final = room.state
        for _ in range(3):
            for trigger in ROOM_TRIGGERS:
                assert room.fire(trigger) is False
        assert room.state is final
        assert room.late_events == 3 * len(ROOM_TRIGGERS)


def test_the_production_resurrection_cannot_happen():
    """DESIGN §1.1: FAILED then a late 'transferring' write; max(0, 3) revived the room."""
    room = Room(9, "prefill")
    room.bootstrap()
    room.chunk_sent()
    room.abort()
    assert room.chunk_sent() is False and room.chunk_done() is False
    assert room.state is RoomState.FAILED and room.late_events == 2


def test_room_rejects_an_unknown_role():
    with pytest.raises(ValueError, match="role"):
        Room(1, "router")


def test_table_machine_refuses_rows_out_of_a_final_state():
    rows = [*ROOM_TRANSITIONS, {"trigger": "revive", "source": [F], "dest": T}]
    with pytest.raises(ValueError, match="final"):
        TableMachine("bad", RoomState, rows, B, (S, F))


def test_table_machine_refuses_duplicate_rows():
    rows = [*ROOM_TRANSITIONS, {"trigger": "bootstrap", "source": [B], "dest": T}]
    with pytest.raises(ValueError, match="duplicate"):
        TableMachine("bad", RoomState, rows, B, (S, F))


def test_transitions_machine_declares_finals_and_no_auto_transitions():
    machine = ROOM_MACHINE._machine
    assert machine.auto_transitions is False
    finals = {name for name, st in machine.states.items() if st.final}
    assert finals == {"SUCCESS", "FAILED"}
    assert set(machine.events) == set(ROOM_TRIGGERS)


EXPECTED_REQUEST = {
    RequestState.QUEUED: {"start_prefill": "PREFILLING", "start_decode": "DECODING"},
    RequestState.PREFILLING: {"start_transfer": "TRANSFERRING", "start_decode": "DECODING"},
    RequestState.TRANSFERRING: {"start_decode": "DECODING"},
    RequestState.DECODING: {"finish": "FINISHED"},
}


@pytest.mark.parametrize("state", list(RequestState), ids=lambda s: s.name)
def test_request_table_every_state_times_every_trigger(state):
    assert len(REQUEST_TRANSITIONS) == 6
    paths = {
        RequestState.QUEUED: [], RequestState.PREFILLING: ["start_prefill"],
        RequestState.TRANSFERRING: ["start_prefill", "start_transfer"],
        RequestState.DECODING: ["start_decode"], RequestState.FINISHED: ["start_decode", "finish"],
        RequestState.ABORTED: ["abort"], RequestState.FAILED: ["fail"],
    }
    for trigger in REQUEST_TRIGGERS:
        seen: list = []
        req = RequestLifecycle("r1", hook=lambda *a, seen=seen: seen.append(a))
        for step in paths[state]:
            assert req.fire(step)
        seen.clear()
        changed = req.fire(trigger)
        if state.terminal:
            expected = None
        elif trigger in ("abort", "fail"):
            expected = "ABORTED" if trigger == "abort" else "FAILED"
        else:
            expected = EXPECTED_REQUEST[state].get(trigger)
        if expected is None:
            assert not changed and req.state is state
            assert seen == [(req, trigger, state, state, True)]
            assert req.late_events + req.invalid_events == 1
            assert req.late_events == (1 if state.terminal else 0)
        else:
            assert changed and req.state.name == expected
            assert seen == [(req, trigger, state, req.state, False)]


def test_request_abort_keeps_its_reason_and_is_final():
    req = RequestLifecycle("r2")
    req.start_prefill()
    req.abort("client went away")
    assert req.finish() is False and req.start_decode() is False
    assert (req.state, req.reason, req.late_events) == (
        RequestState.ABORTED, "client went away", 2
    )
