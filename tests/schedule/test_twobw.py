"""PipeDream-2BW across steps (`pipectl.schedule.twobw`, `pipectl.plan.twobw_steady_state`): versions, double buffer, steady state.

The times are checked against closed forms computed here and against `pipectl.plan.simulate`, the
project's step simulator, run on the same F/B order; the versions against the paper's formula (docs/design.md, 'PipeDream-2BW'), written
out here rather than imported.
"""

from __future__ import annotations

import doctest
import random

import pytest

from pipectl.errors import ScheduleError
from pipectl.plan.stage_costs import StageCosts
from pipectl.plan.simulate import simulate
from pipectl.schedule import generate, one_f_one_b
from pipectl.schedule.ir import ActionKind, ScheduleKind
from pipectl.plan import twobw_steady_state
from pipectl.schedule import twobw
from pipectl.schedule.twobw import BACKWARD, FORWARD, RECOMPUTE, UPDATE, TwoBWOp, two_bw_order
from pipectl.plan.twobw_steady_state import simulate_two_bw_run, two_bw_memory, two_bw_steady_state

# (p, m) with m >= p - 1, the boundary m = p - 1 included
DEGREES = [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2), (3, 5), (4, 3), (4, 4), (4, 8), (5, 7), (6, 6)]


def spec_version(k: int, m: int) -> int:
    """PipeDream-2BW (Narayanan et al., ICML 2021, §3.1): micro-batch k (1-based) uses weight version max(⌊(k−1)/m⌋ − 1, 0)."""
    return max((k - 1) // m - 1, 0)


def test_docstring_examples():
    results = [doctest.testmod(module) for module in (twobw, twobw_steady_state)]
    assert sum(r.attempted for r in results) > 0 and sum(r.failed for r in results) == 0


@pytest.mark.parametrize("p, m", DEGREES)
@pytest.mark.parametrize("recompute", [False, True])
def test_versions_follow_spec_and_forward_and_backward_use_the_same_one(p, m, recompute):
    updates = 4
    run = simulate_two_bw_run(p, m, updates, forward_seconds=1.0, backward_seconds=2.0, recompute=recompute)
    assert sorted(run.forward_versions) == list(range(updates * m))
    for i in range(updates * m):
        assert run.forward_versions[i] == spec_version(i + 1, m)
    # per stage, from the events: F, R and B of a micro-batch read the same version
    for s in range(p):
        used: dict[int, set[int]] = {}
        for event in run.stage_events(s):
            if event.op.kind != UPDATE:
                used.setdefault(event.op.index, set()).add(event.version)
        assert all(len(versions) == 1 for versions in used.values()), (s, used)
    assert run.backward_versions == run.forward_versions


@pytest.mark.parametrize("p, m", DEGREES)
def test_at_most_two_versions_are_live_on_a_stage_and_two_are_needed(p, m):
    """Live after each operation: the newest version (updates apply to it) and every version a
    micro-batch whose backward has not run yet still needs (if already made)."""
    updates = 5
    run = simulate_two_bw_run(p, m, updates, forward_seconds=1.0, backward_seconds=3.0)
    for s in range(p):
        newest = 0
        done: set[int] = set()
        most = 0
        for event in run.stage_events(s):
            if event.op.kind == UPDATE:
                assert event.version == event.op.index == newest + 1
                newest = event.version
            elif event.op.kind == BACKWARD:
                done.add(event.op.index)
            needed = {spec_version(i + 1, m) for i in range(updates * m) if i not in done}
            live = {newest} | {v for v in needed if v <= newest}
            assert len(live) <= 2, (s, event, live)
            most = max(most, len(live))
        assert most == 2  # the second buffer is really used


@pytest.mark.parametrize("p, m", [(p, m) for p, m in DEGREES if p >= 2])
def test_the_spec_version_is_the_newest_one_stage_0_has_when_the_window_starts(p, m):
    """The formula is not staler than it must be: when the first micro-batch of window j enters
    stage 0, the newest version stage 0 has made is max(j − 1, 0) (0-based j)."""
    orders = two_bw_order(p, m, 5)
    stage0 = orders[0]
    for j in range(5):
        position = stage0.index(TwoBWOp(FORWARD, j * m))
        made = sum(1 for op in stage0[:position] if op.kind == UPDATE)
        assert made == max(j - 1, 0) == spec_version(j * m + 1, m)


@pytest.mark.parametrize("p, m", [(2, 2), (3, 4), (4, 4)])
def test_no_flush_the_next_windows_forwards_run_before_the_stage_updates(p, m):
    orders = two_bw_order(p, m, 3)
    for s in range(p):
        order = orders[s]
        ops = {str(op) for op in order}
        assert {f"F{i}" for i in range(3 * m)} <= ops and {f"B{i}" for i in range(3 * m)} <= ops
        assert [op.index for op in order if op.kind == UPDATE] == [1, 2, 3]
        # update j right after B(jm - 1); on every stage but the last, forwards of window j + 1 came before it
        for j in (1, 2):
            update = order.index(TwoBWOp(UPDATE, j))
            assert order[update - 1] == TwoBWOp(BACKWARD, j * m - 1)
            assert (order.index(TwoBWOp(FORWARD, j * m)) < update) == (s < p - 1)


def test_fewer_than_p_minus_1_micro_batches_per_update_is_refused():
    with pytest.raises(ScheduleError, match="needs at least p - 1 = 3 micro-batches per update, got m=2"):
        two_bw_order(4, 2, 3)
    with pytest.raises(ScheduleError, match="needs at least p - 1"):
        two_bw_steady_state(5, 3, forward_seconds=1.0, backward_seconds=2.0)


@pytest.mark.parametrize("p, m", DEGREES)
@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (0.5, 0.5), (2.0, 7.0)])
def test_uniform_steady_state_is_m_times_tf_plus_tb_per_update(p, m, tf, tb):
    state = two_bw_steady_state(p, m, forward_seconds=tf, backward_seconds=tb)
    assert state.update_seconds == pytest.approx(m * (tf + tb), rel=1e-12)
    # every interval between updates, not only their mean: the simulated run itself
    for ends in state.run.update_ends:
        for earlier, later in zip(ends, ends[1:-1]):  # the last update is in the run's drain
            assert later - earlier == pytest.approx(m * (tf + tb), rel=1e-12)
    # the first update pays the fill, as one flushed step does
    assert state.first_update_seconds == pytest.approx((m + p - 1) * (tf + tb), rel=1e-12)
    assert state.flushed_step_seconds == pytest.approx((m + p - 1) * (tf + tb), rel=1e-12)
    # a run of n updates, drain included: (n m + p − 1)(t_f + t_b), against n (m + p − 1)(t_f + t_b) flushed
    run = simulate_two_bw_run(p, m, 3, forward_seconds=tf, backward_seconds=tb)
    assert run.run_seconds == pytest.approx((3 * m + p - 1) * (tf + tb), rel=1e-12)
    assert state.seconds_for(3) == pytest.approx((3 * m + p - 1) * (tf + tb), rel=1e-12)


def test_uniform_steady_state_with_an_update_cost_adds_it_once_per_update():
    state = two_bw_steady_state(4, 4, forward_seconds=1.0, backward_seconds=2.0, update_seconds=0.5)
    assert state.update_seconds == pytest.approx(4 * 3.0 + 0.5, rel=1e-12)


def _random_costs(rng: random.Random, p: int, communication: bool) -> dict:
    costs = {
        "forward_seconds": [rng.uniform(0.1, 3.0) for _ in range(p)],
        "backward_seconds": [rng.uniform(0.1, 5.0) for _ in range(p)],
    }
    if communication:
        costs["send_forward_seconds"] = [rng.uniform(0.0, 2.0) for _ in range(p - 1)]
        costs["send_backward_seconds"] = [rng.uniform(0.0, 2.0) for _ in range(p - 1)]
        costs["update_seconds"] = [rng.uniform(0.0, 1.0) for _ in range(p)]
    return costs


@pytest.mark.parametrize("seed", range(6))
def test_unequal_stages_free_communication_run_at_the_slowest_stages_rate(seed):
    rng = random.Random(seed)
    p = rng.randint(2, 6)
    m = rng.randint(p - 1, 9)
    costs = _random_costs(rng, p, communication=False)
    state = two_bw_steady_state(p, m, **costs)
    slowest = max(f + b for f, b in zip(costs["forward_seconds"], costs["backward_seconds"]))
    assert state.update_seconds == pytest.approx(m * slowest, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_with_communication_the_steady_state_is_the_long_run_rate(seed):
    """Intervals between updates can alternate once communication costs; the reported figure is the
    mean rate, the same as over a run ten times as long."""
    rng = random.Random(100 + seed)
    p = rng.randint(2, 6)
    m = rng.randint(p - 1, 8)
    costs = _random_costs(rng, p, communication=True)
    state = two_bw_steady_state(p, m, **costs)
    long = simulate_two_bw_run(p, m, 201, **costs)
    rate = max((ends[199] - ends[79]) / 120 for ends in long.update_ends)
    assert state.update_seconds == pytest.approx(rate, rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_times_agree_with_the_projects_step_simulator_on_the_same_order(seed):
    """Without update cost, a run of n updates is 1F1B over n·m micro-batches with one flush at the
    end: `pipectl.plan.simulate` times that order independently."""
    rng = random.Random(200 + seed)
    p = rng.randint(1, 5)
    m = rng.randint(max(p - 1, 1), 6)
    updates = 3
    costs = _random_costs(rng, p, communication=p > 1)
    costs.pop("update_seconds", None)
    run = simulate_two_bw_run(p, m, updates, **costs)
    sends_f = costs.get("send_forward_seconds", [])
    sends_b = costs.get("send_backward_seconds", [])
    stage_costs = StageCosts(
        forward_seconds=costs["forward_seconds"], backward_seconds=costs["backward_seconds"],
        recompute_seconds=costs["forward_seconds"], send_forward_seconds=sends_f, send_backward_seconds=sends_b,
        allreduce_seconds=[0.0] * p, optimizer_seconds=[0.0] * p,
    )  # fmt: skip
    timeline = simulate(one_f_one_b(p, updates * m), stage_costs)
    expected = {
        (r.action.kind.value, r.rank, r.action.microbatch): (r.start, r.end)
        for r in timeline.records
        if r.action.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)
    }
    got = {(e.op.kind, e.stage, e.op.index): (e.start, e.end) for e in run.events if e.op.kind != UPDATE}
    assert got.keys() == expected.keys()
    for key, (start, end) in expected.items():
        assert got[key] == pytest.approx((start, end), rel=1e-12, abs=1e-12), key
    assert run.run_seconds == pytest.approx(timeline.step_seconds, rel=1e-12)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 3), (4, 4), (4, 8), (6, 5)])
def test_memory_two_weight_versions_and_p_minus_s_in_flight(p, m):
    state = two_bw_steady_state(p, m, forward_seconds=1.0, backward_seconds=2.0)
    assert state.peak_in_flight == tuple(p - s for s in range(p))
    # a flushed step empties the pipe: 1F1B's min(p − s, m); without the flush stage 0 keeps p at m = p − 1
    flushed = simulate_two_bw_run(p, m, 1, forward_seconds=1.0, backward_seconds=2.0)
    assert flushed.peak_in_flight == tuple(min(p - s, m) for s in range(p))
    parameters = [1000 * (s + 1) for s in range(p)]
    memory = two_bw_memory(state, parameters, [10] * p)
    assert [entry.weight_bytes for entry in memory] == [2 * b for b in parameters]
    assert [entry.activation_bytes for entry in memory] == [10 * (p - s) for s in range(p)]
    assert two_bw_memory(state, parameters)[0].activation_bytes is None
    with pytest.raises(ScheduleError, match="one value per stage"):
        two_bw_memory(state, parameters[:-1])


def test_recompute_runs_r_before_b_except_on_the_last_stage_and_costs_its_time():
    orders = two_bw_order(3, 3, 2, recompute=True)
    for s, order in orders.items():
        for i in range(6):
            b = order.index(TwoBWOp(BACKWARD, i))
            assert (order[b - 1] == TwoBWOp(RECOMPUTE, i)) == (s < 2)
    state = two_bw_steady_state(3, 3, forward_seconds=1.0, backward_seconds=2.0, recompute=True)
    assert state.update_seconds == pytest.approx(3 * (1.0 + 2.0 + 1.0), rel=1e-12)  # stages 0, 1 recompute


def test_one_step_of_the_generator_is_the_first_window_of_the_run():
    """`generate(2bw)` is one flushed step; the run's first window is the same F/B order when the
    run has one update."""
    p, m = 4, 5
    schedule = generate(ScheduleKind.PIPEDREAM_2BW, p, m)
    orders = two_bw_order(p, m, 1)
    for s in range(p):
        ours = [f"{s}{op}" for op in orders[s] if op.kind != UPDATE]
        assert ours == [str(a) for a in schedule.compute_order(s)]
