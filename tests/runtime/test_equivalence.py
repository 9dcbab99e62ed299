"""The virtual-node promise with real DeepSpeed ranks: the same global batch and seed give the same
loss at every step whatever the layout (pipeline degree, cut, data-parallel degree, schedule,
recomputation, ZeRO stage, even or uneven data-parallel replicas); each rank executes exactly the planned compute order; and gpt-tiny
learns (its loss falls) on a two-stage pipeline.

All layouts train gpt-tiny on the built-in byte corpus, B = 8, fp32, 12 steps, and run once per
module (about 5 s each on two cores).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipectl.artifacts.layout import Layout
from pipectl.runtime.job import TrainingJob
from pipectl.runtime.worker import spawn_ranks
from pipectl.schedule import generate
from pipectl.schedule.ir import ScheduleKind
from builders import training_config

STEPS = 12
GLOBAL_BATCH = 8
TIMEOUT_SECONDS = 120


def ds_config(layout: Layout, zero_stage: int) -> dict:
    """What `pipectl launch` emits, in the parts that matter here (AdamW, clipping at 1.0)."""
    return training_config(layout, zero_stage=zero_stage, weight_decay=0.01)


@dataclass(frozen=True)
class Case:
    name: str
    layout: Layout
    zero_stage: int = 1


CASES = [
    Case("p1 d1 (reference)", Layout(1, 1, 2, 4, ((0, 9),), ScheduleKind.ONE_F_ONE_B)),
    Case("p2 d1 1f1b cut 4", Layout(2, 1, 2, 4, ((0, 4), (4, 9)), ScheduleKind.ONE_F_ONE_B)),
    Case("p2 d1 gpipe cut 2, ZeRO-0", Layout(2, 1, 2, 4, ((0, 2), (2, 9)), ScheduleKind.GPIPE), zero_stage=0),
    Case("p2 d1 varuna b4 m2", Layout(2, 1, 4, 2, ((0, 5), (5, 9)), ScheduleKind.VARUNA, recompute=True)),
    Case("p1 d2", Layout(1, 2, 2, 2, ((0, 9),), ScheduleKind.ONE_F_ONE_B)),
    # A heterogeneous plan: replica 0 takes 6 of the 8 samples, replica 1 the other 2.
    Case("p1 d2 uneven 3x2 + 1x2", Layout(1, 2, 2, 2, ((0, 9),), replica_shares=((3, 2), (1, 2)))),
]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[int, tuple[int, list[float], list[str]]]]:
    return {
        case.name: {
            rank: (outcome.stage, outcome.losses, outcome.executed_order)
            for rank, outcome in spawn_ranks(
                TrainingJob("gpt-tiny", case.layout, ds_config(case.layout, case.zero_stage), steps=STEPS, seed=7),
                timeout_seconds=TIMEOUT_SECONDS,
            ).items()
        }
        for case in CASES
    }


@pytest.mark.multiprocess
def test_every_layout_gives_the_reference_loss_at_every_step(runs):
    reference = runs[CASES[0].name][0][1]
    assert len(reference) == STEPS
    for case in CASES[1:]:
        for rank, (_, losses, _) in runs[case.name].items():
            assert len(losses) == STEPS
            for step, (got, want) in enumerate(zip(losses, reference), start=1):
                assert abs(got - want) <= 1e-4 * abs(want), f"{case.name} rank {rank} step {step}: {got} vs {want}"


@pytest.mark.multiprocess
def test_each_rank_executes_the_planned_compute_order(runs):
    for case in CASES:
        layout = case.layout
        planned = generate(layout.schedule, layout.pipeline_parallel, layout.micro_batches, recompute=layout.recompute)
        for rank, (stage, _, order) in runs[case.name].items():
            assert order == [str(a) for a in planned.compute_order(stage)], f"{case.name} rank {rank}"
    # The schedules really differ: GPipe runs all forwards first, Varuna recomputes.
    gpipe_rank0 = runs["p2 d1 gpipe cut 2, ZeRO-0"][0][2]
    assert gpipe_rank0[:4] == ["0F0", "0F1", "0F2", "0F3"]
    assert any(a.startswith("0R") for a in runs["p2 d1 varuna b4 m2"][0][2])


@pytest.mark.multiprocess
def test_gpt_tiny_learns_on_two_stages(runs):
    losses = runs["p2 d1 1f1b cut 4"][1][1]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.3, losses
