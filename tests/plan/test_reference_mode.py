"""Reference mode (`PIPECTL_PLAN_REFERENCE=1`) simulates every candidate; the fast paths give the same plans.

"The same" is up to rounding, not byte for byte: the fast paths equal the simulation to ~1e-14
relative (closed forms and skipped periods add in another order), so a figure may differ in its
last digits, and candidates whose times tie exactly (p = 1 with another b, GPipe and 1F1B with
one micro-batch) may swap places. Every other part of the plan is identical: the candidates
chosen, ranked and put in the morph table, their configurations, memory, notes and rejections.
"""

import json
import math

import pytest

from pipectl.artifacts.plan import Objective, Plan, PlanRequest
from pipectl.cluster import load_cluster, local_cluster
from pipectl.plan.fast import varuna, waves
from pipectl.plan.search import plan
from pipectl.testing.profiles import synthetic_profile
from pipectl.models.registry import load_model_config
from pipectl.profile.derive import derive_profile
from pipectl.plan.timing import REFERENCE_ENV
from pipectl.schedule import ScheduleKind

EVERY_SCHEDULE = list(ScheduleKind)  # every schedule the planner prices
FIGURES = ("predicted_step_seconds", "samples_per_second", "tflops_per_device", "cost_per_million_samples")
FRACTIONS = ("bubble_fraction", "communication_fraction")  # of the step: compared to 1e-12 absolute


def _searches():
    uneven = synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], block_forward_seconds=[0.01, 0.012, 0.014] * 2)
    return {
        "a100, every schedule, all kept": (
            uneven, load_cluster("a100-8x8"),
            PlanRequest(global_batch=32, schedules=EVERY_SCHEDULE, include_all=True, for_deepspeed=False, workers=1),
        ),
        "a100, cost, top 5": (
            synthetic_profile(blocks=12), load_cluster("a100-8x8"),
            PlanRequest(global_batch=128, schedules=EVERY_SCHEDULE, chunks=[2], objective=Objective.COST, top=5, workers=1),
        ),
        "local gloo ranks (blocking sends), all kept": (
            synthetic_profile(blocks=6, device="cpu", dtype="float32"), local_cluster(4),
            PlanRequest(global_batch=16, schedules=EVERY_SCHEDULE, include_all=True, for_deepspeed=False, workers=1),
        ),
        "a100, derived block shards (t = 2, 4), every schedule, all kept": (
            derive_profile(load_model_config("gpt-small"), "a100-80gb", [1, 2]), load_cluster("a100-8x8"),
            PlanRequest(global_batch=16, devices=16, schedules=EVERY_SCHEDULE, chunks=[2], include_all=True,
                        for_deepspeed=False, workers=1),
        ),
        "heterogeneous": (
            synthetic_profile(blocks=8), load_cluster("mixed-v100-p100"), PlanRequest(global_batch=64, workers=1),
        ),
    }  # fmt: skip


def _configuration(candidate: dict) -> str:
    return json.dumps({k: v for k, v in candidate.items() if k not in FIGURES + FRACTIONS}, sort_keys=True)


def _assert_same_figures(fast: dict, reference: dict) -> None:
    for name in FIGURES:
        assert math.isclose(fast[name], reference[name], rel_tol=1e-12), (name, fast[name], reference[name])
    for name in FRACTIONS:
        assert abs(fast[name] - reference[name]) <= 1e-12, (name, fast[name], reference[name])


def _assert_same_or_tied(fast: dict, reference: dict, ranked_by: str) -> None:
    """The same candidate with the same figures, or two whose objective figure ties."""
    if _configuration(fast) == _configuration(reference):
        _assert_same_figures(fast, reference)
    else:
        assert math.isclose(fast[ranked_by], reference[ranked_by], rel_tol=1e-12), (fast, reference)


def assert_same_plan(fast: Plan, reference: Plan) -> None:
    a, b = fast.model_dump(mode="json"), reference.model_dump(mode="json")
    for name in a.keys() - {"chosen", "candidates", "morph_table"}:
        assert a[name] == b[name], name
    ranked_by = "predicted_step_seconds" if fast.objective is Objective.TIME else "cost_per_million_samples"
    _assert_same_or_tied(a["chosen"], b["chosen"], ranked_by)
    assert len(a["candidates"]) == len(b["candidates"])
    for mine, theirs in zip(a["candidates"], b["candidates"]):
        _assert_same_or_tied(mine, theirs, ranked_by)
    by_configuration = {_configuration(c): c for c in b["candidates"]}
    for candidate in a["candidates"]:
        if _configuration(candidate) in by_configuration:
            _assert_same_figures(candidate, by_configuration[_configuration(candidate)])
    assert [(e["devices"], e["note"]) for e in a["morph_table"]] == [(e["devices"], e["note"]) for e in b["morph_table"]]
    for mine, theirs in zip(a["morph_table"], b["morph_table"]):
        _assert_same_or_tied(mine["candidate"], theirs["candidate"], "predicted_step_seconds")


@pytest.mark.parametrize("name", list(_searches()))
def test_fast_paths_and_the_reference_give_the_same_plan(name, monkeypatch):
    profile, cluster, request = _searches()[name]
    monkeypatch.delenv(REFERENCE_ENV, raising=False)
    fast = plan(profile, cluster, request)
    monkeypatch.setenv(REFERENCE_ENV, "1")
    reference = plan(profile, cluster, request)
    assert_same_plan(fast, reference)
    if name.startswith("a100, derived block shards"):
        assert profile.has_shards and {c.tensor_parallel for c in fast.candidates} >= {1, 2, 4}
    if name == "a100, every schedule, all kept":
        assert {c.schedule for c in fast.candidates} == set(EVERY_SCHEDULE)
        assert {c.recompute for c in fast.candidates} == {False, True}


def test_reference_mode_takes_no_fast_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a fast path ran in reference mode")

    for module in (waves, varuna):
        monkeypatch.setattr(module, "step_seconds", refuse)
        monkeypatch.setattr(module, "summary", refuse)
    monkeypatch.setenv(REFERENCE_ENV, "1")
    profile, cluster, request = _searches()["a100, cost, top 5"]
    assert plan(profile, cluster, request).candidates
    monkeypatch.setenv(REFERENCE_ENV, "0")
    with pytest.raises(AssertionError, match="fast path ran"):
        plan(profile, cluster, request)
