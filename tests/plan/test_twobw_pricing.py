"""The planner prices PipeDream-2BW in steady state: `two_bw_steady_state`'s figure per update.

A 2bw candidate's `predicted_step_seconds` is the time per update of m micro-batches with no flush,
the figure `pipectl.plan.twobw_steady_state.two_bw_steady_state` gives on the candidate's own stage costs
(`stage_costs_for`, what `pipectl simulate` re-simulates). The planner computes it in waves
(`pipectl.plan.fast.twobw`); these tests hold that equal to the event simulation, check the closed
form of the uniform case, the flushed step kept in the notes, the memory (p − s micro-batches in
flight on stage s, never drained) and the rejection of m < p − 1.
"""

from __future__ import annotations

import math
import random

import pytest

from pipectl.artifacts.plan import PlanRequest
from pipectl.cluster import load_cluster
from pipectl.errors import InfeasibleError
from pipectl.plan.candidates import Rejection
from pipectl.plan.spec_costs import state_bytes, step_bytes
from pipectl.plan.costs import hardware_for
from pipectl.plan.cost_table import stage_costs_for
from pipectl.plan.evaluate import Evaluator
from pipectl.plan.fast import twobw
from pipectl.plan.memory import in_flight_units
from pipectl.plan.search import plan
from pipectl.plan.stage_costs import uniform_costs
from pipectl.plan.space import enumerate_specs, search_space
from pipectl.testing.profiles import synthetic_profile
from pipectl.plan.timing import two_bw_summary_of
from pipectl.schedule import ScheduleKind
from pipectl.plan.twobw_steady_state import simulate_two_bw_run, steady_state_window, two_bw_steady_state
from pipectl.words import count
from builders import head_start_costs, random_stage_costs

TWO_BW = ScheduleKind.PIPEDREAM_2BW


def _steady_state(p, m, recompute, costs):
    """`two_bw_steady_state` on a planner cost table (the update: all-reduce + optimizer step)."""
    return two_bw_steady_state(
        p, m, forward_seconds=costs.forward_seconds, backward_seconds=costs.backward_seconds,
        recompute_seconds=costs.recompute_seconds, send_forward_seconds=costs.send_forward_seconds,
        send_backward_seconds=costs.send_backward_seconds,
        update_seconds=[a + o for a, o in zip(costs.allreduce_seconds, costs.optimizer_seconds)],
        recompute=recompute,
    )  # fmt: skip


@pytest.fixture(scope="module")
def profile():
    return synthetic_profile(blocks=8, micro_batch_sizes=[1, 2, 4],
                             block_forward_seconds=[0.01, 0.012, 0.011, 0.01, 0.013, 0.01, 0.012, 0.01])


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("a100-8x8")


@pytest.fixture(scope="module")
def every_candidate(profile, cluster):
    """Every feasible 1f1b and 2bw candidate on up to 16 A100s, B = 32."""
    request = PlanRequest(global_batch=32, devices=16, schedules=["1f1b", "2bw"], include_all=True,
                          for_deepspeed=False, morph=False, workers=1)
    return plan(profile, cluster, request)


def test_a_2bw_candidate_is_priced_at_two_bw_steady_state_on_its_stage_costs(profile, cluster, every_candidate):
    two_bw = [c for c in every_candidate.candidates if c.schedule is TWO_BW and c.pipeline_parallel > 1]
    assert len(two_bw) >= 10
    for candidate in two_bw[:: len(two_bw) // 10][:10]:  # ten, from the fastest to the slowest
        costs = stage_costs_for(candidate, profile, cluster)
        state = _steady_state(candidate.pipeline_parallel, candidate.micro_batches, candidate.recompute, costs)
        assert math.isclose(candidate.predicted_step_seconds, state.update_seconds, rel_tol=1e-12), candidate
        # ... and every figure derived from it is per update
        assert math.isclose(candidate.samples_per_second, 32 / state.update_seconds, rel_tol=1e-12)


def test_a_2bw_candidate_beats_the_flushed_1f1b_of_the_same_layout_and_its_notes_say_by_how_much(every_candidate):
    def layout(c):
        return (c.tensor_parallel, c.pipeline_parallel, c.data_parallel, c.micro_batch_size, c.recompute,
                c.checkpoint_layers, c.selective_recompute, c.zero_stage, tuple(map(tuple, c.stage_layers)))

    flushed = {layout(c): c for c in every_candidate.candidates if c.schedule is ScheduleKind.ONE_F_ONE_B}
    compared = 0
    for candidate in every_candidate.candidates:
        if candidate.schedule is not TWO_BW or candidate.pipeline_parallel == 1:
            continue
        one_f_one_b = flushed.get(layout(candidate))
        if one_f_one_b is None:
            continue  # another cut (2BW's second weight copy needs more memory)
        assert candidate.predicted_step_seconds < one_f_one_b.predicted_step_seconds
        note = next(n for n in candidate.notes if n.startswith("2BW steady state"))
        assert (f"2BW steady state {candidate.predicted_step_seconds:.4g} s per update of "
                f"{count(candidate.micro_batches, 'micro-batch')}, no flush (flushed 1F1B: "
                f"{one_f_one_b.predicted_step_seconds:.4g} s per step") in note
        assert any("1-stale" in n for n in candidate.notes) and not candidate.deepspeed_runnable
        compared += 1
    assert compared >= 5


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_path_equals_the_event_simulation_on_random_costs(seed):
    rng = random.Random(seed)
    p = rng.randint(1, 9)
    m = rng.randint(max(p - 1, 1), 60)
    recompute = rng.random() < 0.5
    if seed % 2:
        costs = random_stage_costs(p, 1, rng, rng.choice([1.0, 0.05, 0.0]))
    else:  # nearly equal stages: long transients, linear stretches before the state repeats
        costs = head_start_costs(p, p, rng.uniform(-0.3, 0.5), rng.uniform(-0.1, 0.2), rng)
    fast = two_bw_summary_of(p, m, recompute, costs)
    reference = two_bw_summary_of(p, m, recompute, costs, reference=True)
    assert math.isclose(fast.step_seconds, _steady_state(p, m, recompute, costs).update_seconds, rel_tol=1e-12)
    assert math.isclose(fast.step_seconds, reference.step_seconds, rel_tol=1e-12)
    for mine, theirs in zip(fast.communication_seconds_per_rank, reference.communication_seconds_per_rank):
        assert abs(mine - theirs) <= 1e-12 * reference.step_seconds
    for mine, theirs in zip(fast.bubble_fraction, reference.bubble_fraction):
        assert abs(mine - theirs) <= 1e-12


def test_the_fast_path_reads_the_event_simulations_window_where_it_is_shortened():
    p, m = 10, 1000  # 20,010 events per update: the event simulation runs 19 updates, not 21
    window = steady_state_window(p, m)
    assert window == (9, 9)
    costs = random_stage_costs(p, 1, random.Random(p), 0.05)
    assert math.isclose(twobw.steady_state(p, m, False, costs, window).update_seconds,
                        _steady_state(p, m, False, costs).update_seconds, rel_tol=1e-12)


@pytest.mark.parametrize("p, m", [(1, 4), (2, 1), (4, 3), (4, 4), (8, 7), (8, 64), (16, 300)])
@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (0.5, 1.5)])
def test_uniform_stages_and_free_communication_give_m_times_tf_plus_tb_per_update(p, m, tf, tb):
    summary = two_bw_summary_of(p, m, False, uniform_costs(p, 1, tf, tb))
    assert math.isclose(summary.step_seconds, m * (tf + tb), rel_tol=1e-12)
    assert all(abs(fraction) <= 1e-12 for fraction in summary.bubble_fraction)  # no flush: no bubble
    # the update (all-reduce + optimizer step) once per update
    costs = uniform_costs(p, 1, tf, tb, allreduce=0.25, optimizer=0.125)
    assert math.isclose(two_bw_summary_of(p, m, False, costs).step_seconds, m * (tf + tb) + 0.375, rel_tol=1e-12)


def test_uniform_beyond_what_the_event_simulation_takes():
    assert steady_state_window(128, 1024) is None  # two_bw_steady_state refuses it; the planner does not
    assert math.isclose(two_bw_summary_of(128, 1024, False, uniform_costs(128, 1, 1.0, 2.0)).step_seconds,
                        1024 * 3.0, rel_tol=1e-12)


@pytest.mark.parametrize("p, m", [(2, 1), (3, 2), (4, 3), (4, 4), (5, 9), (8, 7)])
def test_in_flight_units_are_p_minus_s_as_the_run_without_a_flush_holds(p, m):
    run = simulate_two_bw_run(p, m, 4, forward_seconds=1.0, backward_seconds=2.0)
    assert in_flight_units(TWO_BW, p, m) == run.peak_in_flight == tuple(p - s for s in range(p))
    # at m = p - 1 stage 0 holds p micro-batches, more than the m of one update
    if m == p - 1:
        assert run.peak_in_flight[0] == m + 1


def test_2bw_specs_are_priced_for_p_minus_s_in_flight_and_two_weight_versions(profile, cluster):
    hardware = hardware_for(cluster, profile)
    request = PlanRequest(global_batch=32, schedules=["2bw"], workers=1)
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 16).specs
    assert specs
    for spec in specs:
        p = spec.shape.pipeline_parallel
        held = state_bytes(profile.dtype, spec.zero_stage, spec.data_parallel, TWO_BW)
        assert held == state_bytes(profile.dtype, spec.zero_stage, spec.data_parallel, ScheduleKind.ONE_F_ONE_B) \
            + 2  # the second 16-bit weight copy, per parameter
        allocated = spec.shape.memory.per_rank_bytes(
            held, step_bytes(profile.dtype, spec.zero_stage, spec.data_parallel, TWO_BW), tuple(range(p, 0, -1))
        )
        assert list(spec.peak_memory_bytes) == [int(x) for x in hardware.memory_budget.reserved(allocated)]


def test_2bw_bounds_never_exceed_its_steady_state(profile, cluster):
    hardware = hardware_for(cluster, profile)
    request = PlanRequest(global_batch=32, schedules=["2bw"], workers=1)
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 16).specs
    reference = Evaluator(hardware, 32, reference=True)
    for spec in random.Random(0).sample(specs, min(40, len(specs))):
        step = reference.step_seconds(spec)
        assert spec.lower_bound_seconds <= step * (1 + 1e-12)
        assert reference.tighter_bound_seconds(spec) <= step * (1 + 1e-12)


def test_fewer_than_p_minus_1_micro_batches_per_update_are_rejected_with_the_reason(profile, cluster):
    # p = 8 on 16 devices: d = 2 runs 8 micro-batches of b = 2 per replica (>= 7), d = 4 and 8 too few
    request = PlanRequest(global_batch=32, schedules=["2bw"], pipeline_parallel=8, micro_batch_size=2,
                          for_deepspeed=False, morph=False, include_all=True, workers=1)
    result = plan(profile, cluster, request)
    assert result.infeasible[Rejection.TWO_BW_MICRO_BATCHES.value] >= 1
    assert all(c.micro_batches >= 7 for c in result.candidates)
    with pytest.raises(InfeasibleError, match=r"needs at least p - 1 micro-batches per update .*"
                                              r"p=8 d=4 b=4 2bw: 1 micro-batch per update < p - 1 = 7"):
        plan(profile, cluster, PlanRequest(global_batch=16, schedules=["2bw"], pipeline_parallel=8, data_parallel=4,
                                           micro_batch_size=4, for_deepspeed=False, morph=False, workers=1))


def test_2bw_is_not_chosen_unless_any_engine_and_the_note_names_it(profile, cluster):
    request = PlanRequest(global_batch=32, devices=16, pipeline_parallel=4, schedules=["1f1b", "2bw"], morph=False,
                          workers=1)
    fastest = plan(profile, cluster, request.model_copy(update={"for_deepspeed": False}))
    assert fastest.chosen.schedule is TWO_BW
    assert any(note.startswith("2BW steady state") for note in fastest.chosen.notes)
    chosen_for_deepspeed = plan(profile, cluster, request)
    assert chosen_for_deepspeed.chosen.schedule is ScheduleKind.ONE_F_ONE_B
    c = fastest.chosen
    named = (f"fastest overall is t={c.tensor_parallel} p=4 d={c.data_parallel} b={c.micro_batch_size} "
             f"m={c.micro_batches} 2bw")
    assert any(note.startswith(named) and f"({c.predicted_step_seconds:.4g} s per update, 2BW steady state)"
               in note and "which DeepSpeed cannot run" in note for note in chosen_for_deepspeed.notes)
