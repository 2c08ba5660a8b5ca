"""The stuck-pin verdict as a pure function over synthetic sample windows."""

from __future__ import annotations

import pytest

from pdengine.server.probe import PinSample, Verdict, format_timeline, judge


def window(inflight, running, ages, step=1.0):
    return [
        PinSample(t=i * step, inflight=f, running=r, oldest_age_s=a)
        for i, (f, r, a) in enumerate(zip(inflight, running, ages, strict=True))
    ]


def test_all_zero_is_idle() -> None:
    v = judge(window([0] * 5, [0] * 5, [0] * 5))
    assert v == Verdict("idle", v.reason) and v.exit_code == 0


def test_the_production_pin_is_stuck() -> None:
    # inflight=1 for the whole window, decode idle, the room ages with the clock.
    v = judge(window([1] * 8, [0] * 8, [40 + i for i in range(8)]))
    assert v.verdict == "stuck" and v.exit_code == 1
    assert "inflight constant at 1" in v.reason


def test_pin_with_several_rooms_is_stuck() -> None:
    assert judge(window([3] * 4, [0] * 4, [10, 17, 24, 31], step=7.0)).verdict == "stuck"


@pytest.mark.parametrize(
    ("inflight", "running", "ages", "why"),
    [
        ([1, 1, 1, 1], [0, 2, 1, 0], [1, 2, 3, 4], "decode is running"),  # decode progresses
        ([2, 1, 3, 0], [0, 0, 0, 0], [1, 2, 3, 4], "inflight moves"),  # transfers complete
        ([1, 1, 1, 1], [0, 0, 0, 0], [3, 0.2, 1.1, 0.4], "rooms finish"),  # age resets
        ([1, 1, 1, 1], [0, 0, 0, 0], [5.0, 5.1, 5.1, 5.2], "not ageing"),  # sampled age lag
        ([0, 0, 0, 0], [1, 1, 1, 1], [0.1, 0.1, 0.1, 0.1], "decode is running"),
    ],
)
def test_moving_values_are_healthy(inflight, running, ages, why) -> None:
    v = judge(window(inflight, running, ages))
    assert v.verdict == "healthy" and v.exit_code == 0
    assert why in v.reason


def test_a_pin_that_clears_inside_the_window_is_healthy() -> None:
    # Stuck-looking for most of the window, then the deadline fails the room: not a pin now.
    v = judge(window([1, 1, 1, 1, 0], [0] * 5, [20, 21, 22, 23, 0]))
    assert v.verdict == "healthy"


def test_needs_two_samples() -> None:
    with pytest.raises(ValueError, match="two samples"):
        judge(window([1], [0], [1]))


def test_timeline_has_one_row_per_sample() -> None:
    text = format_timeline(window([1, 1], [0, 0], [3.0, 10.0], step=7.0))
    rows = text.splitlines()
    assert len(rows) == 3 and "inflight" in rows[0]
    assert rows[2].split() == ["7.0", "1", "0", "10.0"]
