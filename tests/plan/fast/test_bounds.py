"""The in-flight loop bound of 1F1B's order and Varuna's warm-up and cool-down bound never exceed
the simulated step, and prune."""

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from builders import head_start_costs, random_stage_costs
from pipectl.cluster import load_cluster
from pipectl.plan.fast import varuna_flags
from pipectl.plan.fast.bounds import has_pair_loops, pair_loop_bound_seconds, varuna_bound_seconds
from pipectl.plan.costs import hardware_for
from pipectl.plan.evaluate import Evaluator
from pipectl.artifacts.plan import PlanRequest
from pipectl.plan.space import enumerate_specs, search_space
from pipectl.plan.simulate import simulate
from pipectl.plan.stage_costs import uniform_costs
from pipectl.testing.profiles import synthetic_profile
from pipectl.schedule import generate
from pipectl.schedule.ir import ScheduleKind

LOOP_KINDS = [ScheduleKind.ONE_F_ONE_B, ScheduleKind.PIPEDREAM_2BW, ScheduleKind.INTERLEAVED]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(LOOP_KINDS),
    st.integers(2, 9),
    st.integers(0, 40),
    st.booleans(),
    st.sampled_from([1.0, 0.05, 0.0]),
    st.randoms(use_true_random=False),
)
def test_never_above_the_simulated_step(kind, p, extra, recompute, spread, rng):
    m = p + extra
    assert has_pair_loops(kind, p, m, 1)
    costs = random_stage_costs(p, 1, rng, spread)
    step = simulate(generate(kind, p, m, 1, recompute), costs).step_seconds
    assert pair_loop_bound_seconds(m, recompute, costs) <= step * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(0, 200), st.floats(1e-4, 0.5), st.floats(-0.1, 0.2), st.booleans(),
       st.randoms(use_true_random=False))
def test_never_above_the_simulated_step_on_nearly_equal_stages(p, extra, slower, heavier_last, recompute, rng):
    m = p + extra
    costs = head_start_costs(p, p, slower, heavier_last, rng)
    step = simulate(generate(ScheduleKind.ONE_F_ONE_B, p, m, 1, recompute), costs).step_seconds
    assert pair_loop_bound_seconds(m, recompute, costs) <= step * (1 + 1e-12)


def test_exact_for_equal_stages_and_free_links():
    for p, m in [(2, 2), (4, 8), (7, 30)]:
        assert pair_loop_bound_seconds(m, False, uniform_costs(p, 1, 1.0, 2.0)) == (m + p - 1) * 3.0


def test_slow_links_raise_the_rate_above_the_slowest_stage():
    """Equal stages, slow links: the loop through all p ranks carries p micro-batches for
    p(f + b) + 2(p − 1)c, a rate the per-rank work bound (f + b per micro-batch) misses."""
    p, m, send = 8, 200, 0.25
    costs = uniform_costs(p, 1, 1.0, 2.0, send=send)
    step = simulate(generate(ScheduleKind.ONE_F_ONE_B, p, m), costs).step_seconds
    bound = pair_loop_bound_seconds(m, False, costs)
    per_rank_work = (m + p - 1) * 3.0 + 2 * (p - 1) * send  # the chains and m micro-batches of work
    loop_rate = 3.0 + 2 * (p - 1) * send / p
    assert per_rank_work < m * loop_rate <= bound <= step


def test_only_1f1b_orders_with_a_full_warm_up():
    assert has_pair_loops(ScheduleKind.ONE_F_ONE_B, 4, 4, 1)
    assert not has_pair_loops(ScheduleKind.ONE_F_ONE_B, 4, 3, 1)
    assert not has_pair_loops(ScheduleKind.ONE_F_ONE_B, 1, 8, 1)
    assert not has_pair_loops(ScheduleKind.INTERLEAVED, 4, 8, 2)
    assert not has_pair_loops(ScheduleKind.GPIPE, 4, 8, 1)
    assert not has_pair_loops(ScheduleKind.VARUNA, 4, 8, 1)


def test_the_evaluators_bound_holds_for_every_schedule():
    profile = synthetic_profile(blocks=6, micro_batch_sizes=[1, 2],
                                block_forward_seconds=[0.01, 0.012, 0.01, 0.015, 0.01, 0.011])
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    request = PlanRequest(global_batch=16, schedules=["1f1b", "gpipe", "interleaved", "varuna", "2bw", "zb-h1"])
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 8).specs
    assert {spec.variant.kind for spec in specs} == set(ScheduleKind) - {ScheduleKind.ZBV}  # zbv: not planned yet
    evaluator = Evaluator(hardware, 16, reference=True)  # the bounds hold for the simulation itself
    tighter = 0
    for spec in random.Random(3).sample(specs, min(len(specs), 150)):
        bound = evaluator.tighter_bound_seconds(spec)
        assert spec.lower_bound_seconds <= bound
        tighter += bound > spec.lower_bound_seconds
        assert bound <= evaluator.step_seconds(spec) or math.isclose(bound, evaluator.step_seconds(spec), rel_tol=1e-12)
    assert tighter > 0


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 9), st.integers(1, 60), st.sampled_from([1.0, 0.05, 0.0]), st.randoms(use_true_random=False))
def test_varuna_bound_never_above_the_simulated_step(p, m, spread, rng):
    costs = random_stage_costs(p, 1, rng, spread)
    step = simulate(generate(ScheduleKind.VARUNA, p, m), costs).step_seconds
    assert varuna_bound_seconds(m, *varuna_flags.order_ends(p, m), costs) <= step * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 14), st.integers(1, 200), st.floats(-0.3, 0.5), st.floats(-0.1, 0.2),
       st.randoms(use_true_random=False))
def test_varuna_bound_never_above_the_simulated_step_on_nearly_equal_stages(p, m, slower, heavier_last, rng):
    # Stages as a balanced cut of a transformer leaves them: nearly equal, the ends lighter or heavier.
    costs = head_start_costs(p, p, slower, heavier_last, rng)
    step = simulate(generate(ScheduleKind.VARUNA, p, m), costs).step_seconds
    assert varuna_bound_seconds(m, *varuna_flags.order_ends(p, m), costs) <= step * (1 + 1e-12)


def test_varuna_bound_sees_the_cool_down_the_chains_miss():
    """Equal stages, free links: the chains give 2(f + b) + m(f + r + b) = 70 for p = 4, m = 16;
    Varuna's last micro-batches leave rank 2 waiting, which the cool-down path counts."""
    costs = uniform_costs(4, 1, 1.0, 2.0)
    step = simulate(generate(ScheduleKind.VARUNA, 4, 16), costs).step_seconds
    assert 70.0 < varuna_bound_seconds(16, *varuna_flags.order_ends(4, 16), costs) == step


def test_the_evaluators_varuna_bound_is_tighter_and_holds_on_planner_specs():
    profile = synthetic_profile(blocks=12, micro_batch_sizes=[1, 2],
                                block_forward_seconds=[0.01, 0.0101] * 6)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    request = PlanRequest(global_batch=96, schedules=["varuna"])
    specs = [s for s in enumerate_specs(profile, hardware, search_space(request, profile, hardware), 64).specs
             if s.shape.pipeline_parallel > 1]
    evaluator = Evaluator(hardware, 96, reference=True)
    tighter = 0
    for spec in random.Random(5).sample(specs, min(len(specs), 60)):
        bound = evaluator.tighter_bound_seconds(spec)
        tighter += bound > spec.lower_bound_seconds
        assert bound <= evaluator.step_seconds(spec) * (1 + 1e-12)
    assert tighter > 0
