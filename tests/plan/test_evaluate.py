"""Evaluator: a spec's recorded candidate is the same whether or not its step was timed first, and
the reference's (every spec simulated) to rounding."""

from __future__ import annotations

from pipectl.cluster import load_cluster
from pipectl.plan.costs import hardware_for
from pipectl.plan.evaluate import Evaluator
from pipectl.artifacts.plan import PlanRequest
from pipectl.plan.space import enumerate_specs, search_space
from pipectl.testing.profiles import synthetic_profile


def _specs():
    profile = synthetic_profile(blocks=6, micro_batch_sizes=[1, 2],
                                block_forward_seconds=[0.01, 0.012, 0.01, 0.015, 0.01, 0.011])
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    request = PlanRequest(global_batch=16, schedules=["1f1b", "gpipe", "interleaved", "varuna"])
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 8).specs
    return hardware, specs


def test_candidate_after_a_step_equals_a_fresh_candidate_and_the_simulator():
    hardware, specs = _specs()
    kinds = {spec.variant.kind for spec in specs}
    assert len(kinds) == 4  # every kind's path is exercised
    warm, cold = Evaluator(hardware, 16, reference=False), Evaluator(hardware, 16, reference=False)
    reference = Evaluator(hardware, 16, reference=True)
    for spec in specs[::7]:
        step = warm.step_seconds(spec)
        recorded = warm.candidate(spec)
        assert recorded == cold.candidate(spec)
        assert recorded.predicted_step_seconds == step
        simulated = reference.candidate(spec)
        assert abs(step - simulated.predicted_step_seconds) <= 1e-12 * simulated.predicted_step_seconds
        assert abs(recorded.bubble_fraction - simulated.bubble_fraction) <= 1e-9
    assert warm.simulations == len(specs[::7])
