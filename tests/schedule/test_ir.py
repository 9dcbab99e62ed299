import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipectl.schedule.ir import Action, ActionKind, Schedule, ScheduleKind

actions = st.builds(
    lambda stage, kind, mb: Action(stage, kind, mb if kind.has_microbatch else None),
    st.integers(0, 200),
    st.sampled_from(list(ActionKind)),
    st.integers(0, 10_000),
)


@given(actions)
def test_action_text_round_trips(action):
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2F0", Action(2, ActionKind.FORWARD, 0)),
        ("1SF3", Action(1, ActionKind.SEND_FORWARD, 3)),
        ("12RB11", Action(12, ActionKind.RECV_BACKWARD, 11)),
        ("0R7", Action(0, ActionKind.RECOMPUTE, 7)),
        ("3AR", Action(3, ActionKind.ALL_REDUCE)),
        ("0STEP", Action(0, ActionKind.OPTIMIZER_STEP)),
    ],
)
def test_action_parse_known_forms(text, expected):
    assert Action.parse(text) == expected


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "-1F0", "2STEP3", "2F0x"])
def test_action_parse_rejects_malformed(text):
    with pytest.raises(ValueError):
        Action.parse(text)


def test_schedule_text_round_trips():
    schedule = Schedule(
        ScheduleKind.ONE_F_ONE_B,
        2,
        2,
        1,
        {
            0: tuple(Action.parse(t) for t in "0F0 0F1 0B0 0B1 0AR 0STEP".split()),
            1: tuple(Action.parse(t) for t in "1F0 1B0 1F1 1B1 1AR 1STEP".split()),
        },
    )
    again = Schedule.from_text(schedule.to_text())
    assert again == schedule
    assert [str(a) for a in again.compute_order(1)] == ["1F0", "1B0", "1F1", "1B1"]
