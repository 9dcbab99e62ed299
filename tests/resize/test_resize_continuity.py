"""Continuity, the central promise of a resize (docs/design.md, 'Resize and recovery'; issue 5): gpt-tiny trained 20 steps without
interruption, and again with a resize after step 10, must give the same losses for steps 11..20
(within 1e-4 relative, fp32) and the same final weights.

Real ranks (torchrun, gloo) through the run-directory contract: `prepare_launch` + `run_engine`
for the first 10 steps, `resize_run` for the rest. Cases: 2 ranks p=2 -> 1 rank; 1 rank -> 2 ranks
p=2; 2 ranks p=2 -> 2 ranks d=2 (the plan's morph table says so for 2 devices). One uninterrupted
baseline and one first half per starting layout are shared across cases (module fixtures).

Every run warms its learning rate up linearly over 15 steps (DeepSpeed's WarmupLR): the resize at
step 10 falls inside the warm-up, so the scheduler's step must cross the resize with the optimizer
state (a scheduler restarted at 0 would change every later loss).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipectl.artifacts.plan import Candidate, MorphEntry, Plan
from pipectl.launch.prepare import read_run
from pipectl.rundir.morph_history import read_history
from pipectl.resize.restart import resize_run
from pipectl.rundir.metrics import read_metrics
from builders import assert_same_weights, final_weights, gpt_tiny_candidate, plan_of, train_run

pytestmark = pytest.mark.multiprocess

STEPS, RESIZE_AT = 20, 10
RUN_TIMEOUT_SECONDS = 150
RELATIVE_TOLERANCE = 1e-4
WARMUP_STEPS = 15


candidate = gpt_tiny_candidate


P1 = candidate(1, 1, m=4)
P2 = candidate(2, 1, m=4)
D2 = candidate(1, 2, m=2)  # B = 8 = b 2 x m 2 x d 2


def plan_with(chosen: Candidate, table: dict[int, Candidate]) -> Plan:
    return plan_of(chosen, global_batch=8, morph_table=[MorphEntry(devices=n, candidate=c) for n, c in sorted(table.items())])


def train(plan: Plan, run_dir: Path, steps: int) -> Path:
    return train_run(plan, run_dir, steps, warmup_steps=WARMUP_STEPS, timeout_seconds=RUN_TIMEOUT_SECONDS)


def losses(run_dir: Path) -> dict[int, float]:
    return {m.step: m.loss for m in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("continuity")


@pytest.fixture(scope="module")
def baseline(workspace):
    run = train(plan_with(P2, {1: P1, 2: P2}), workspace / "uninterrupted", STEPS)
    return losses(run), final_weights(run, STEPS)


@pytest.fixture(scope="module")
def first_halves(workspace):
    """Runs stopped after 10 steps, by starting layout. The p=2 run's plan says d=2 for 2 devices."""
    return {
        "p2": train(plan_with(P2, {1: P1, 2: D2}), workspace / "half-p2", RESIZE_AT),
        "p1": train(plan_with(P1, {1: P1, 2: P2}), workspace / "half-p1", RESIZE_AT),
    }


@pytest.mark.parametrize(
    "start, devices, expected_layout",
    [("p2", 1, "t1p1d1 1f1b b2 m4"), ("p1", 2, "t1p2d1 1f1b b2 m4"), ("p2", 2, "t1p1d2 1f1b b2 m2")],
    ids=["p2-to-1-rank", "1-rank-to-p2", "p2-to-d2"],
)
def test_losses_and_weights_continue_across_a_resize(baseline, first_halves, workspace, start, devices, expected_layout):
    expected_losses, expected_weights = baseline
    run = workspace / f"resized-{start}-{devices}"
    shutil.copytree(first_halves[start], run)

    result = resize_run(run, devices, steps=STEPS, run_timeout_seconds=RUN_TIMEOUT_SECONDS)
    assert result.exit_code == 0, (run / "logs" / "engine.log").read_text()[-3000:]

    resumed = read_metrics(run)
    assert [m.step for m in resumed] == list(range(1, STEPS + 1))  # none skipped, none repeated
    assert {m.layout for m in resumed if m.step > RESIZE_AT} == {expected_layout}
    assert all(m.global_batch == 8 for m in resumed)
    got = losses(run)
    for step in range(RESIZE_AT + 1, STEPS + 1):
        assert got[step] == pytest.approx(expected_losses[step], rel=RELATIVE_TOLERANCE), step

    assert_same_weights(final_weights(run, STEPS), expected_weights, RELATIVE_TOLERANCE)

    assert read_run(run).ds_config["scheduler"]["params"]["warmup_num_steps"] == WARMUP_STEPS  # kept by the resize
    (record,) = read_history(run)
    assert record.resume_step == RESIZE_AT and record.to_layout == expected_layout
    assert record.downtime_seconds is not None and record.downtime_seconds > 0
