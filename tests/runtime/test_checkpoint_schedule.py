"""When to checkpoint: steps, wall time, and the Young/Daly interval from the measured stall."""

from __future__ import annotations

import math

import pytest

from pipectl.errors import UserInputError
from pipectl.launch.options import parse_checkpoint_interval
from pipectl.runtime.checkpoint import schedule as cs


def test_young_daly_grows_with_the_square_root_of_cost_and_mtbf():
    base = cs.young_daly_seconds(1.0, 3600.0)
    assert base == pytest.approx(math.sqrt(7200.0))
    assert cs.young_daly_seconds(4.0, 3600.0) == pytest.approx(2 * base)
    assert cs.young_daly_seconds(1.0, 4 * 3600.0) == pytest.approx(2 * base)


def test_steps_and_wall_time_schedules(monkeypatch):
    clock = {"now": 1000.0}
    monkeypatch.setattr(cs.time, "monotonic", lambda: clock["now"])
    steps = cs.CheckpointSchedule(every_steps=4)
    assert [s for s in range(1, 13) if steps.step_due(s, 12)] == [4, 8]  # the last step saves anyway
    assert not steps.time_due(100) and steps.interval_seconds() is None
    timed = cs.CheckpointSchedule(every_seconds=60.0)
    assert not timed.time_due(5)
    clock["now"] += 60.0
    assert timed.time_due(5)
    timed.saved(0.2)
    assert not timed.time_due(6) and timed.interval_seconds() == 60.0


def test_auto_measures_once_then_follows_young_daly(monkeypatch):
    clock = {"now": 0.0}
    monkeypatch.setattr(cs.time, "monotonic", lambda: clock["now"])
    auto = cs.CheckpointSchedule.for_job(0, 0.0, True, None, devices=3072)
    assert auto.mtbf_seconds == pytest.approx(cs.DEVICE_MTBF_HOURS * 3600 / 3072)
    assert not auto.time_due(0) and auto.time_due(1)  # the first checkpoint measures the stall
    auto.saved(0.5)
    interval = auto.interval_seconds()
    assert interval == pytest.approx(cs.young_daly_seconds(0.5, auto.mtbf_seconds))  # about 4 minutes
    clock["now"] += interval - 1
    assert not auto.time_due(10)
    clock["now"] += 1
    assert auto.time_due(11)
    tiny = cs.CheckpointSchedule.for_job(0, 0.0, True, 0.001, devices=1)
    tiny.saved(0.001)
    assert tiny.interval_seconds() == cs.AUTO_MIN_INTERVAL_SECONDS  # never more often than a minute


@pytest.mark.parametrize("text, parsed", [("0", (0, 0.0, False)), ("25", (25, 0.0, False)), ("90s", (0, 90.0, False)),
                                          ("1.5h", (0, 5400.0, False)), ("AUTO", (0, 0.0, True))])  # fmt: skip
def test_the_interval_flag_takes_steps_a_wall_time_or_auto(text, parsed):
    assert parse_checkpoint_interval(text) == parsed


def launch_options_error(**flags) -> str:
    """The message `launch` refuses these flags with."""
    from pipectl.config import flag_layer, layered
    from pipectl.launch.options import LaunchOptions

    with pytest.raises(UserInputError) as refused:
        layered(LaunchOptions, [flag_layer(LaunchOptions, flags)])
    return refused.value.message


@pytest.mark.parametrize("text", ["-3", "10 minutes", "0m", "m", "auto5", "99999999999999999999999h", "9" * 23])
def test_a_bad_interval_is_named(text):
    with pytest.raises(ValueError, match="not a step count|longer than a year|64-bit"):
        parse_checkpoint_interval(text)
    refused = launch_options_error(checkpoint_every=text)
    assert refused.startswith(f"--checkpoint-every {text!r}: "), refused
