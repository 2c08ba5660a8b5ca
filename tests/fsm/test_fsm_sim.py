"""The deterministic simulator: clean on the real tables, and it catches injected bugs."""

from __future__ import annotations

import json

import pytest

from pdengine.fsm import room as room_module
from pdengine.fsm.machine import TableMachine
from pdengine.fsm.room import ROOM_TRANSITIONS, TERMINAL, RoomState
from pdengine.fsm.sim_world import Faults, World
from pdengine.fsm.simulator import main, run_seeds, shrink


def test_a_few_hundred_seeds_hold_every_invariant():
    summary = run_seeds(300, rooms=8)
    assert summary["violations"] == 0, summary.get("first_failure")
    assert summary["events"] > 300 * 8 * 5
    assert 0 < summary["max_time_to_terminal_s"] <= summary["deadline_bound_s"]
    # the schedules really are adversarial: every kind of ending and absorption happens
    for key in ("rooms_succeeded", "rooms_failed", "timeouts", "late_events",
                "invalid_events", "pages_quarantined"):
        assert summary[key] > 0, key


def test_same_seed_same_schedule():
    a, b = World(17, 6), World(17, 6)
    a.run()
    b.run()
    assert [str(s) for s in a.recording] == [str(s) for s in b.recording]
    c = World(18, 6)
    c.run()
    assert [str(s) for s in c.recording] != [str(s) for s in a.recording]


def _forgetful_table() -> TableMachine:
    """The production bug: nothing times out a TRANSFERRING room."""
    rows = []
    for row in ROOM_TRANSITIONS:
        row = dict(row)
        if row["trigger"] == "timeout":
            row["source"] = [RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT]
        rows.append(row)
    return TableMachine("forgetful", RoomState, rows, RoomState.BOOTSTRAPPING, TERMINAL)


def test_an_injected_buggy_table_is_caught_and_shrunk(monkeypatch, capsys):
    monkeypatch.setattr(room_module, "ROOM_MACHINE", _forgetful_table())
    summary = run_seeds(40, rooms=6)
    assert summary["violations"] > 0
    failure = summary["first_failure"]
    assert failure["violation"].startswith("I2")
    assert 1 <= len(failure["shrunk_schedule"]) < failure["schedule_len"]

    assert main(["--seeds", "40", "--rooms", "6", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["violations"] > 0
    assert f"seed={failure['seed']}" in err and "shortest schedule" in err


def test_shrunk_schedule_still_fails_on_replay(monkeypatch):
    monkeypatch.setattr(room_module, "ROOM_MACHINE", _forgetful_table())
    world = next(w for seed in range(40) if (w := World(seed, 6)).run() or w.violations)
    short = shrink(world.seed, 6, world.recording, "I2")
    replayed = World(world.seed, 6)
    replayed.replay(short)
    assert any(v.invariant == "I2" for v in replayed.violations)
    # and it is minimal: dropping any single step makes the violation go away
    for i in range(len(short)):
        again = World(world.seed, 6)
        again.replay(short[:i] + short[i + 1 :])
        assert not any(v.invariant == "I2" for v in again.violations)


def test_writes_outliving_the_drain_deadline_are_caught_as_stale_writes():
    """I5's model assumption broken on purpose: WRITEs that land after drain_s."""
    slow_writes = Faults(max_write_delay_s=3.0)
    summary = run_seeds(60, rooms=8, faults=slow_writes)
    assert summary["violations"] > 0
    assert summary["first_failure"]["violation"].startswith("I5")


def test_cli_json_summary(capsys):
    assert main(["--seeds", "5", "--rooms", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {"seeds", "rooms", "events", "violations", "max_time_to_terminal_s"} <= summary.keys()
    assert (summary["seeds"], summary["rooms"], summary["violations"]) == (5, 3, 0)


def test_cli_rejects_bad_sizes():
    with pytest.raises(SystemExit) as exc:
        main(["--seeds", "0"])
    assert exc.value.code == 2
