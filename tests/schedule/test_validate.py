import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import ScheduleError
from pipectl.schedule import generate
from pipectl.schedule.comm import add_communication
from pipectl.schedule.ir import Action, Schedule, ScheduleKind
from pipectl.schedule.validate import validate


def schedule_from(rows, p=2, m=2, v=1, kind=ScheduleKind.ONE_F_ONE_B):
    return Schedule(kind, p, m, v, {r: tuple(Action.parse(t) for t in row.split()) for r, row in enumerate(rows)})


def replaced(schedule, rank, actions):
    new = dict(schedule.actions)
    new[rank] = tuple(actions)
    return Schedule(schedule.kind, schedule.pipeline_parallel, schedule.micro_batches, schedule.chunks, new)


def test_valid_schedule_passes():
    validate(schedule_from(["0F0 0F1 0B0 0B1 0AR 0STEP", "1F0 1B0 1F1 1B1 1AR 1STEP"]))


@pytest.mark.parametrize(
    "rows, message",
    [
        (["0F0 0F1 0B0 0AR 0STEP", "1F0 1B0 1F1 1B1 1AR 1STEP"], "never runs 0B1"),
        (["0F0 0F1 0B0 0B1 0B1 0AR 0STEP", "1F0 1B0 1F1 1B1 1AR 1STEP"], "0B1 appears twice"),
        (["0F0 0F1 0B0 0B1 0AR 0STEP", "1F0 1B0 1F1 1B1 1STEP 1AR"], "rank 1 must end with exactly one AR then one STEP"),
        (["0F0 0F1 0B0 0B1 0AR 0STEP", "1F0 1B0 1F1 1B1 1AR"], "rank 1 must end"),
        (["0F0 1F1 0B0 0B1 0AR 0STEP", "1F0 1B0 1F1 1B1 1AR 1STEP"], "virtual stage 1, which lives on rank 1"),
        (["0F0 0F1 0B0 0B1 0F2 0AR 0STEP", "1F0 1B0 1F1 1B1 1AR 1STEP"], "micro-batch 2, but m=2"),
        (["0F0 0F1 0B0 0R1 0B1 0AR 0STEP", "1F0 1B0 1F1 1B1 1AR 1STEP"], None),
        (["0F0 0R1 0F1 0B0 0B1 0AR 0STEP", "1F0 1B0 1F1 1B1 1AR 1STEP"], "0R1 after 0F1 and before 0B1"),
        (["0F0 0F1 0B0 0B1 0AR 0STEP", "1F1 1B1 1F0 1B0 1AR 1STEP"], None),
    ],
)
def test_malformed_schedules_are_named(rows, message):
    schedule = schedule_from(rows)
    if message is None:
        validate(schedule)  # legal variants: an R between F and B; another micro-batch order
    else:
        with pytest.raises(ScheduleError, match=message):
            validate(schedule)


def test_dependency_cycle_is_a_deadlock_with_the_stuck_ranks_marked():
    # rank 0 wants B0 (needs 1B0) before F1; rank 1 wants F1 (needs 0F1) before B0.
    schedule = schedule_from(["0F0 0B0 0F1 0B1 0AR 0STEP", "1F0 1F1 1B0 1B1 1AR 1STEP"])
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    text = str(err.value)
    assert "deadlock" in text
    assert "*0B0*" in text and "*1F1*" in text
    assert "step  rank 0  rank 1" in text
    marked = [line for line in text.splitlines() if line.endswith("<-- here")]
    assert len(marked) == 1 and marked[0].lstrip().startswith("1 ")


def test_blocking_sends_that_cross_deadlock():
    # Both ranks send first: rank 0 sends F1's activation while rank 1 sends B0's gradient.
    schedule = schedule_from([
        "0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0AR 0STEP",
        "1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1AR 1STEP",
    ])
    with pytest.raises(ScheduleError, match="deadlocks under blocking send/receive") as err:
        validate(schedule)
    assert "*0SF1*" in str(err.value) and "*1SB0*" in str(err.value)


def test_messages_received_out_of_order_are_a_mismatch():
    schedule = schedule_from([
        "0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0AR 0STEP",
        "1RF1 1RF0 1F0 1B0 1SB0 1F1 1B1 1SB1 1AR 1STEP",
    ])
    with pytest.raises(ScheduleError, match="order mismatch between ranks 0 and 1: 0SF0 meets 1RF1"):
        validate(schedule)


def test_missing_receive_is_reported():
    schedule = schedule_from([
        "0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0AR 0STEP",
        "1RF0 1F0 1F1 1B0 1SB0 1B1 1SB1 1AR 1STEP",
    ])
    with pytest.raises(ScheduleError, match="lacks 1RF1"):
        validate(schedule)


def test_send_before_its_compute_is_reported():
    schedule = schedule_from([
        "0SF0 0F0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0AR 0STEP",
        "1RF0 1F0 1RF1 1B0 1SB0 1F1 1B1 1SB1 1AR 1STEP",
    ])
    with pytest.raises(ScheduleError, match="0SF0 must come after 0F0"):
        validate(schedule)


def test_rank_count_must_match_p():
    schedule = Schedule(ScheduleKind.GPIPE, 3, 1, 1, {0: (), 1: ()})
    with pytest.raises(ScheduleError, match=r"ranks 0..2 \(p=3\)"):
        validate(schedule)


def test_long_schedules_show_a_window_around_the_error():
    good = generate(ScheduleKind.GPIPE, 2, 40)
    broken = replaced(good, 1, [a for a in good.actions[1] if str(a) != "1B30"])
    with pytest.raises(ScheduleError, match="never runs 1B30") as err:
        validate(broken)
    assert len(str(err.value).splitlines()) < 20


@st.composite
def generated(draw):
    kind = draw(st.sampled_from(list(ScheduleKind)))
    p = draw(st.integers(1, 6))
    v = draw(st.integers(1, 3)) if kind is ScheduleKind.INTERLEAVED else 1
    m = draw(st.integers(1, 4)) * p if v > 1 else draw(st.integers(1, 12))
    if kind is ScheduleKind.ZBV:  # two chunks placed as a V, m >= 2p - 1
        v, m = 2, 2 * p - 1 + draw(st.integers(0, 6))
    return generate(kind, p, m, v, draw(st.booleans()))


@settings(max_examples=60, deadline=None)
@given(generated(), st.data())
def test_dropping_any_required_action_is_caught(schedule, data):
    rank = data.draw(st.sampled_from(sorted(schedule.actions)))
    actions = list(schedule.actions[rank])
    # every action but a recompute is required (a schedule may skip a recompute)
    index = data.draw(st.sampled_from([k for k, a in enumerate(actions) if a.kind.value != "R"]))
    del actions[index]
    with pytest.raises(ScheduleError):
        validate(replaced(schedule, rank, actions))


@settings(max_examples=60, deadline=None)
@given(generated(), st.data())
def test_swapping_a_backward_before_its_forward_is_caught(schedule, data):
    rank = data.draw(st.sampled_from(sorted(schedule.actions)))
    actions = list(schedule.actions[rank])
    backwards = [k for k, a in enumerate(actions) if a.kind.value in ("B", "I")]
    k = data.draw(st.sampled_from(backwards))
    target = actions[k]
    f = next(j for j, a in enumerate(actions) if a.kind.value == "F" and (a.stage, a.microbatch) == (target.stage, target.microbatch))
    actions[k], actions[f] = actions[f], actions[k]
    with pytest.raises(ScheduleError):
        validate(replaced(schedule, rank, actions))


def test_validate_accepts_generated_schedules_with_communication():
    validate(add_communication(generate(ScheduleKind.ONE_F_ONE_B, 4, 8)))
