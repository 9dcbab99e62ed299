import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import ScheduleError, UserInputError
from pipectl.plan.stage_costs import StageCosts, uniform_costs
from pipectl.plan.simulate import simulate, simulate_step_seconds
from pipectl.schedule import generate
from pipectl.schedule.comm import add_communication
from pipectl.schedule.ir import Action, ActionKind, Schedule, ScheduleKind

FLUSHED = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.PIPEDREAM_2BW]


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("kind", FLUSHED)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16, 32])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_times_tf_plus_tb(kind, p, m):
    tf, tb = 1.3, 2.9
    timeline = simulate(generate(kind, p, m), uniform_costs(p, 1, tf, tb))
    assert close(timeline.step_seconds, (m + p - 1) * (tf + tb))
    for rank in range(p):
        assert close(timeline.bubble_fraction[rank], (p - 1) / (m + p - 1))  # idle / step
        assert close(timeline.bubble_ratio[rank], (p - 1) / m)  # the papers' convention: idle / compute
    assert timeline.communication_seconds == 0.0


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3, 5])
def test_interleaved_takes_m_plus_p_minus_1_over_v(p, v, groups):
    m = groups * p
    tf, tb = 0.7, 1.6  # a rank's whole share; each chunk costs tf/v, tb/v
    timeline = simulate(generate(ScheduleKind.INTERLEAVED, p, m, v), uniform_costs(p, v, tf, tb))
    assert close(timeline.step_seconds, (m + (p - 1) / v) * (tf + tb))
    for rank in range(p):
        assert close(timeline.bubble_ratio[rank], (p - 1) / (v * m))


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(FLUSHED + [ScheduleKind.INTERLEAVED]),
    st.integers(1, 10),
    st.integers(1, 8),
    st.integers(1, 4),
    st.floats(0.01, 100.0),
    st.floats(0.01, 100.0),
)
def test_closed_forms_hold_for_any_uniform_times(kind, p, groups, v, tf, tb):
    if kind is not ScheduleKind.INTERLEAVED:
        v = 1
    m = groups * p if v > 1 else groups
    step = simulate_step_seconds(generate(kind, p, m, v), uniform_costs(p, v, tf, tb))
    assert close(step, (m + (p - 1) / v) * (tf + tb))


def random_costs(p, v, rng, jitter=0.0):
    s = p * v
    return StageCosts(
        forward_seconds=[rng.uniform(0.5, 2.0) for _ in range(s)],
        backward_seconds=[rng.uniform(1.0, 4.0) for _ in range(s)],
        recompute_seconds=[rng.uniform(0.5, 2.0) for _ in range(s)],
        send_forward_seconds=[rng.uniform(0.0, 0.5) for _ in range(s - 1)],
        send_backward_seconds=[rng.uniform(0.0, 0.5) for _ in range(s - 1)],
        allreduce_seconds=[rng.uniform(0.0, 3.0) for _ in range(p)],
        optimizer_seconds=[rng.uniform(0.0, 1.0) for _ in range(p)],
        jitter_seconds=jitter,
        seed=rng.randrange(1000),
    )


def reference_ends(schedule, costs):
    """Independent reference: iterate start times to a fixed point (no topological order)."""
    s_last = schedule.virtual_stages - 1
    timed = {r: [a for a in acts if not a.kind.is_p2p] for r, acts in schedule.actions.items()}
    duration = {
        ActionKind.FORWARD: lambda a, r: costs.forward_seconds[a.stage],
        ActionKind.BACKWARD: lambda a, r: costs.backward_seconds[a.stage],
        ActionKind.RECOMPUTE: lambda a, r: costs.recompute_seconds[a.stage],
        ActionKind.ALL_REDUCE: lambda a, r: costs.allreduce_seconds[r],
        ActionKind.OPTIMIZER_STEP: lambda a, r: costs.optimizer_seconds[r],
        # the split backward: I its fraction of B, W the rest
        ActionKind.BACKWARD_INPUT: lambda a, r: costs.backward_seconds[a.stage] * costs.backward_input_fraction,
        ActionKind.BACKWARD_WEIGHT: lambda a, r: costs.backward_seconds[a.stage] * (1 - costs.backward_input_fraction),
    }
    def sent(stage, neighbour, seconds):  # the turn of zbv's V (stages p - 1 and p, one rank) sends nothing
        local = schedule.kind.v_placement and schedule.rank_of(stage) == schedule.rank_of(neighbour)
        return 0.0 if local else seconds

    end = {}
    for _ in range(10_000):
        changed = False
        for r, acts in timed.items():
            free = 0.0
            for a in acts:
                ready = 0.0
                if a.kind is ActionKind.FORWARD and a.stage > 0:
                    ready = end.get(("F", a.stage - 1, a.microbatch), math.inf) + sent(
                        a.stage, a.stage - 1, costs.send_forward_seconds[a.stage - 1])
                if a.kind.computes_input_gradient and a.stage < s_last:
                    ready = end.get((a.kind.value, a.stage + 1, a.microbatch), math.inf) + sent(
                        a.stage, a.stage + 1, costs.send_backward_seconds[a.stage])
                finish = max(free, ready) + duration[a.kind](a, r)
                key = (a.kind.value, a.stage, a.microbatch if a.microbatch is not None else r)
                if finish != math.inf and end.get(key) != finish:
                    end[key] = finish
                    changed = True
                free = finish
        if not changed:
            return end
    raise AssertionError("no fixed point")


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(list(ScheduleKind)),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 3),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_matches_a_fixed_point_reference_with_random_costs(kind, p, groups, v, recompute, rng):
    if kind is not ScheduleKind.INTERLEAVED:
        v = 1
    m = groups * p if v > 1 else groups + 1
    if kind is ScheduleKind.ZBV:  # two chunks placed as a V, m >= 2p - 1
        v, m = 2, 2 * p - 2 + groups
    schedule = generate(kind, p, m, v, recompute)
    costs = random_costs(p, v, rng)
    timeline = simulate(schedule, costs)
    reference = reference_ends(schedule, costs)
    for record in timeline.records:
        a = record.action
        key = (a.kind.value, a.stage, a.microbatch if a.microbatch is not None else record.rank)
        assert close(record.end, reference[key]), str(a)
    assert close(timeline.step_seconds, max(reference.values()))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(list(ScheduleKind)),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 3),
    st.booleans(),
    st.floats(0.0, 0.3),
    st.randoms(use_true_random=False),
)
def test_timeline_respects_dependencies_and_lower_bounds(kind, p, groups, v, recompute, jitter, rng):
    if kind is not ScheduleKind.INTERLEAVED:
        v = 1
    m = groups * p if v > 1 else groups
    if kind is ScheduleKind.ZBV:  # two chunks placed as a V, m >= 2p - 1
        v, m = 2, 2 * p - 2 + groups
    schedule = generate(kind, p, m, v, recompute)
    costs = random_costs(p, v, rng, jitter)
    timeline = simulate(schedule, costs)
    assert timeline.step_seconds == simulate_step_seconds(schedule, costs)
    ends = {(r.action.kind, r.action.stage, r.action.microbatch): r for r in timeline.records}
    last = p * v - 1
    # boundary s -> s + 1: its transfer time, none at the turn of zbv's V (both stages on one rank)
    crosses = [not (kind.v_placement and schedule.rank_of(s) == schedule.rank_of(s + 1)) for s in range(last)]
    forward_sent = [t if c else 0.0 for t, c in zip(costs.send_forward_seconds, crosses)]
    backward_sent = [t if c else 0.0 for t, c in zip(costs.send_backward_seconds, crosses)]
    for record in timeline.records:
        a = record.action
        if a.kind is ActionKind.FORWARD and a.stage > 0:
            assert record.start >= ends[(a.kind, a.stage - 1, a.microbatch)].end + forward_sent[a.stage - 1] - 1e-12
        if a.kind.computes_input_gradient and a.stage < last:
            assert record.start >= ends[(a.kind, a.stage + 1, a.microbatch)].end + backward_sent[a.stage] - 1e-12
    busy = [0.0] * p
    for rank in range(p):
        records = timeline.rank_records(rank)
        assert [r.action for r in records] == [x for x in schedule.actions[rank] if not x.kind.is_p2p]
        for before, after in zip(records, records[1:]):
            assert after.start >= before.end - 1e-12  # one action at a time per rank
        busy[rank] = sum(r.end - r.start for r in records)
    # critical-path bounds: no rank can do its work faster than back to back, and one
    # micro-batch must travel through every stage and back
    assert timeline.step_seconds >= max(busy) - 1e-9
    # (a split backward's chain runs through I only: W waits for nothing downstream)
    backward_share = costs.backward_input_fraction if kind.splits_backward else 1.0
    round_trip = sum(costs.forward_seconds) + sum(costs.backward_seconds) * backward_share
    round_trip += sum(forward_sent) + sum(backward_sent)
    assert timeline.step_seconds >= round_trip - 1e-9
    for rank in range(p):
        assert 0.0 <= timeline.bubble_fraction[rank] <= 1.0
        assert close(timeline.bubble_fraction[rank] * timeline.step_seconds, timeline.step_seconds - busy[rank])


def test_jitter_is_seeded_and_only_delays():
    schedule = generate(ScheduleKind.ONE_F_ONE_B, 4, 8)
    base = uniform_costs(4, 1, 1.0, 2.0, send=0.1)
    jittered = [simulate_step_seconds(schedule, uniform_costs(4, 1, 1.0, 2.0, send=0.1, jitter=0.2, seed=s)) for s in (1, 1, 2)]
    assert jittered[0] == jittered[1]
    assert jittered[0] != jittered[2]
    assert min(jittered) >= simulate_step_seconds(schedule, base)


def test_exposed_communication_counts_transfer_waits_and_allreduce():
    p, m = 4, 8
    schedule = generate(ScheduleKind.ONE_F_ONE_B, p, m)
    free = simulate(schedule, uniform_costs(p, 1, 1.0, 2.0))
    assert free.communication_seconds == 0.0
    with_ar = simulate(schedule, uniform_costs(p, 1, 1.0, 2.0, allreduce=0.5, optimizer=0.25))
    assert with_ar.communication_seconds == pytest.approx(0.5)
    assert with_ar.step_seconds == pytest.approx(free.step_seconds + 0.75)
    sent = simulate(schedule, uniform_costs(p, 1, 1.0, 2.0, send=0.1))
    # the first micro-batch's trip crosses 2(p-1) boundaries on the critical path
    assert sent.step_seconds >= free.step_seconds + 2 * (p - 1) * 0.1 - 1e-9
    assert max(sent.communication_seconds_per_rank) == sent.communication_seconds > 0


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (3, 6), (1, 5)])
def test_peak_in_flight(p, m):
    gpipe = simulate(generate(ScheduleKind.GPIPE, p, m), uniform_costs(p, 1, 1.0, 2.0))
    assert gpipe.peak_in_flight == (m,) * p
    one_f = simulate(generate(ScheduleKind.ONE_F_ONE_B, p, m), uniform_costs(p, 1, 1.0, 2.0))
    assert one_f.peak_in_flight == tuple(min(p - r, m) for r in range(p))
    # with recompute only the stage input is kept between F and R: one full set at a time
    recomputed = simulate(generate(ScheduleKind.GPIPE, p, m, recompute=True), uniform_costs(p, 1, 1.0, 2.0))
    assert recomputed.peak_in_flight == tuple(1 if r < p - 1 else m for r in range(p))
    assert recomputed.peak_stashed_inputs == (m,) * p


def test_recompute_adds_a_forward_to_non_last_stages():
    p, m, tf, tb = 4, 8, 1.0, 2.0
    plain = simulate(generate(ScheduleKind.ONE_F_ONE_B, p, m), uniform_costs(p, 1, tf, tb))
    recomputed = simulate(generate(ScheduleKind.ONE_F_ONE_B, p, m, recompute=True), uniform_costs(p, 1, tf, tb))
    assert recomputed.step_seconds > plain.step_seconds
    busy0 = sum(r.end - r.start for r in recomputed.rank_records(0))
    assert busy0 == pytest.approx(m * (2 * tf + tb))


def test_communication_actions_in_the_schedule_do_not_change_the_timing():
    schedule = generate(ScheduleKind.INTERLEAVED, 4, 8, 2)
    costs = random_costs(4, 2, random.Random(3))
    assert simulate_step_seconds(add_communication(schedule), costs) == simulate_step_seconds(schedule, costs)


def test_varuna_with_uniform_times_pays_one_recompute_per_microbatch():
    p, m, tf, tb = 4, 8, 1.0, 2.0
    timeline = simulate(generate(ScheduleKind.VARUNA, p, m), uniform_costs(p, 1, tf, tb))
    one_f = simulate_step_seconds(generate(ScheduleKind.ONE_F_ONE_B, p, m), uniform_costs(p, 1, tf, tb))
    assert one_f < timeline.step_seconds <= one_f + m * tf
    assert timeline.peak_in_flight[:-1] == (1,) * (p - 1)


@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("forward_seconds", (1.0,) * 3, "forward_seconds has 3 entries, expected 4"),
        ("send_forward_seconds", (0.0,) * 4, "send_forward_seconds has 4 entries, expected 3"),
        ("allreduce_seconds", (0.0,) * 3, "allreduce_seconds has 3 entries, expected 4"),
        ("backward_seconds", (1.0, -1.0, 1.0, 1.0), "backward_seconds must be >= 0"),
        ("jitter_seconds", -0.5, "jitter_seconds must be >= 0"),
    ],
)
def test_bad_costs_are_user_errors(field, value, pattern):
    from dataclasses import replace

    costs = replace(uniform_costs(4, 1, 1.0, 2.0), **{field: value})
    with pytest.raises(UserInputError, match=pattern):
        simulate_step_seconds(generate(ScheduleKind.ONE_F_ONE_B, 4, 8), costs)


def test_a_deadlocked_schedule_is_a_schedule_error():
    bad = Schedule(
        ScheduleKind.ONE_F_ONE_B, 2, 2, 1,
        {0: tuple(map(Action.parse, "0F0 0B0 0F1 0B1 0AR 0STEP".split())),
         1: tuple(map(Action.parse, "1F0 1F1 1B0 1B1 1AR 1STEP".split()))},
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad, uniform_costs(2, 1, 1.0, 2.0))


def test_a_hand_built_schedule_is_not_served_from_another_schedules_cache():
    first = generate(ScheduleKind.ONE_F_ONE_B, 2, 2)
    swapped = Schedule(
        ScheduleKind.ONE_F_ONE_B, 2, 2, 1,
        {0: first.actions[0], 1: tuple(map(Action.parse, "1F1 1B1 1F0 1B0 1AR 1STEP".split()))},
    )
    costs = uniform_costs(2, 1, 1.0, 2.0)
    assert simulate_step_seconds(first, costs) == 9.0
    # rank 1 starts with micro-batch 1 (ready at 2), so rank 0 waits for 1B0 until 8: 8 + 2 + 2
    assert simulate_step_seconds(swapped, costs) == 12.0
