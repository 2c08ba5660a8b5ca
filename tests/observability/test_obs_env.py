"""Diagnosis settings from the environment: fault injection and raised deadlines."""

from __future__ import annotations

import pytest

from pdengine.fsm import RoomDeadlines
from pdengine.server.diagnostics_env import worker_options_from_env
from pdengine.transport import FaultConfig


def test_nothing_set_changes_nothing() -> None:
    assert worker_options_from_env({}) == {}


def test_stall_and_raised_deadlines() -> None:
    opts = worker_options_from_env({
        "PDENGINE_FAULTS": "stall_write=1.0, max_delay_polls=2",
        "PDENGINE_DEADLINES": "bootstrap_s=600,transfer_progress_s=600,write_s=500",
    })
    assert opts["faults"] == FaultConfig(stall_write=1.0, max_delay_polls=2)
    assert opts["write_deadline_s"] == 500
    d = opts["deadlines"]
    assert isinstance(d, RoomDeadlines)
    assert (d.bootstrap_s, d.transfer_progress_s, d.transfer_total_s) == (600, 600, 600)
    assert d.waiting_for_input_s == RoomDeadlines().waiting_for_input_s


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PDENGINE_FAULTS": "stall=1"}, "unknown setting 'stall=1'"),
        ({"PDENGINE_FAULTS": "corrupt=lots"}, "corrupt must be a number"),
        ({"PDENGINE_FAULTS": "drop=2"}, "drop must be a probability"),
        ({"PDENGINE_DEADLINES": "bootstrap_s=0"}, "bootstrap_s must be > 0"),
    ],
)
def test_bad_settings_name_the_key(env, message) -> None:
    with pytest.raises(ValueError, match=message):
        worker_options_from_env(env)
