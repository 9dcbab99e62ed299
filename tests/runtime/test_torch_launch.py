"""The torch engine as a launch engine: `pipectl launch` (the run-directory contract:
`prepare_launch` + `run_engine`, real torchrun and gloo ranks) runs an engine-torch plan through
PyTorch's pipelining runtime with DeepSpeed's data order, metrics and checkpoints.

gpt-tiny, 2 local ranks, B = 8 = b 2 x m 4, fp32, the learning rate warmed up over 10 steps
(DeepSpeed's WarmupLR on both engines, so each resume falls inside the warm-up). One
uninterrupted DeepSpeed 1F1B run (p = 2) of 12 steps is the reference:

- interleaved (p = 2, v = 2) and zb-h1 (p = 2) launched from scratch for 4 steps give its losses
  at every step, and each rank's executed compute order (recorded by the stages torch's runtime
  called) is the planned one;
- the interleaved run, resized (restart path) into DeepSpeed 1F1B after step 4, and that DeepSpeed
  run resized back into interleaved after step 8, continue with its losses at every step and end
  with its weights: one checkpoint format, re-cut across the two engines, AdamW state and the
  learning-rate schedule included.

- zbv (p = 2, two chunks per rank placed as a V) launched from scratch for 4 steps gives its losses
  and runs the planned order; its checkpoint (rank 0 wrote stages 0 and 3, the tied embedding and
  head once) resumes in DeepSpeed 1F1B with the reference's losses through step 8.

Seven launches in all, shared through module fixtures; two more under `slow` (torch 1f1b and gpipe).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipectl.artifacts.plan import Candidate, MorphEntry, Plan
from pipectl.resize.restart import resize_run
from pipectl.rundir.metrics import read_metrics
from pipectl.runtime.engines.torch_stages import planned_compute_order
from pipectl.schedule import generate
from builders import assert_same_weights, final_weights, gpt_tiny_candidate, gpt_tiny_torch_candidate, plan_of, train_run

pytestmark = pytest.mark.multiprocess

STEPS, FIRST_RESIZE, SECOND_RESIZE, WARMUP_STEPS = 12, 4, 8, 10
RUN_TIMEOUT_SECONDS = 150
RELATIVE_TOLERANCE = 1e-4

ONE_F_ONE_B = gpt_tiny_candidate(2, 1, m=4)
INTERLEAVED = gpt_tiny_torch_candidate("interleaved", 2, v=2)
ZB_H1 = gpt_tiny_torch_candidate("zb-h1", 2)
ZBV = gpt_tiny_torch_candidate("zbv", 2, v=2)
INTERLEAVED_LAYOUT, ZB_H1_LAYOUT, ONE_F_ONE_B_LAYOUT = (
    "t1p2d1 interleaved b2 m4 v2 torch", "t1p2d1 zb-h1 b2 m4 torch", "t1p2d1 1f1b b2 m4"
)


def plan_with(chosen: Candidate, on_two_devices: Candidate) -> Plan:
    """A plan choosing `chosen`, whose morph table picks `on_two_devices` for a resize to 2 devices."""
    return plan_of(chosen, global_batch=8, morph_table=[MorphEntry(devices=2, candidate=on_two_devices)])


def train(chosen: Candidate, run_dir: Path, steps: int, then: Candidate | None = None) -> Path:
    return train_run(plan_with(chosen, then or chosen), run_dir, steps, warmup_steps=WARMUP_STEPS,
                     timeout_seconds=RUN_TIMEOUT_SECONDS)  # fmt: skip


def resized(source: Path, run: Path, steps: int) -> Path:
    """A copy of the run at `source`, resized to 2 devices (the layout its plan's morph table names
    there) and trained to `steps`."""
    shutil.copytree(source, run)
    result = resize_run(run, 2, steps=steps, run_timeout_seconds=RUN_TIMEOUT_SECONDS)
    assert result.exit_code == 0, (run / "logs" / "engine.log").read_text()[-3000:]
    return run


def losses(run_dir: Path) -> dict[int, float]:
    return {m.step: m.loss for m in read_metrics(run_dir)}


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=RELATIVE_TOLERANCE), (step, got[step], want[step])


def assert_ran_the_planned_order(run: Path, candidate: Candidate) -> list[str]:
    schedule = generate(candidate.schedule, 2, candidate.micro_batches, candidate.chunks)
    executed = []
    for rank in range(2):
        executed = (run / f"schedule_rank{rank}.txt").read_text().split()
        assert executed == planned_compute_order(schedule, rank), rank
    return executed


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torch-launch")


@pytest.fixture(scope="module")
def reference(workspace):
    """DeepSpeed 1F1B, p = 2, 12 steps without interruption: losses and final weights."""
    run = train(ONE_F_ONE_B, workspace / "deepspeed-1f1b", STEPS)
    got = losses(run)
    assert len(set(got.values())) == STEPS  # the weights move: a different loss every step
    return got, final_weights(run, STEPS)


@pytest.fixture(scope="module")
def interleaved_start(workspace):
    """Interleaved from scratch for 4 steps; its plan resizes into DeepSpeed 1F1B."""
    return train(INTERLEAVED, workspace / "interleaved", FIRST_RESIZE, then=ONE_F_ONE_B)


@pytest.fixture(scope="module")
def to_deepspeed(workspace, interleaved_start):
    """Steps 5..8 in DeepSpeed 1F1B from the interleaved run's checkpoint; its plan (the resize
    rewrote it: 1F1B chosen) is given back the interleaved layout for 2 devices."""
    run = resized(interleaved_start, workspace / "to-deepspeed", SECOND_RESIZE)
    from pipectl.io import load_model, write_json_atomic

    plan = load_model(Plan, run / "plan.json")
    write_json_atomic(run / "plan.json", plan.model_copy(update={"morph_table": [MorphEntry(devices=2, candidate=INTERLEAVED)]}))
    return run


@pytest.fixture(scope="module")
def back_to_torch(workspace, to_deepspeed):
    """Steps 9..12 in interleaved again, from the DeepSpeed run's checkpoint."""
    return resized(to_deepspeed, workspace / "back-to-torch", STEPS)


@pytest.fixture(scope="module")
def zb_h1_run(workspace):
    return train(ZB_H1, workspace / "zb-h1", FIRST_RESIZE)


@pytest.fixture(scope="module")
def zbv_run(workspace):
    """zbv from scratch for 4 steps; its plan resizes into DeepSpeed 1F1B."""
    from pipectl.runtime.engines.dsconfig import ZBV_MIN_TORCH, installed_torch

    if (installed_torch() or ZBV_MIN_TORCH) < ZBV_MIN_TORCH:
        pytest.skip("zbv needs torch 2.12 or later on engine torch (launch refuses it)")
    return train(ZBV, workspace / "zbv", FIRST_RESIZE, then=ONE_F_ONE_B)


def test_interleaved_launch_gives_the_deepspeed_1f1b_losses_and_runs_the_planned_order(reference, interleaved_start):
    records = read_metrics(interleaved_start)
    assert [m.step for m in records] == list(range(1, FIRST_RESIZE + 1))
    assert {m.layout for m in records} == {INTERLEAVED_LAYOUT}
    assert_same_losses(losses(interleaved_start), reference[0], range(1, FIRST_RESIZE + 1))
    # The same per-rank fields as a DeepSpeed run writes, timed from what torch's runtime ran.
    for record in records:
        assert [(r.rank, r.stage, r.samples) for r in record.ranks] == [(0, 0, 8), (1, 1, 8)]
        assert all(r.forward_seconds > 0 and r.backward_seconds > 0 and r.p2p_seconds is not None for r in record.ranks)
        assert all(0 < r.optimizer_seconds <= r.end_of_step_seconds and r.checkpoint_seconds == 0.0 for r in record.ranks)
    assert_ran_the_planned_order(interleaved_start, INTERLEAVED)


def test_zb_h1_launch_gives_the_deepspeed_1f1b_losses_and_splits_the_backward(reference, zb_h1_run):
    assert {m.layout for m in read_metrics(zb_h1_run)} == {ZB_H1_LAYOUT}
    assert_same_losses(losses(zb_h1_run), reference[0], range(1, FIRST_RESIZE + 1))
    executed = assert_ran_the_planned_order(zb_h1_run, ZB_H1)
    assert any("I" in action for action in executed) and any("W" in action for action in executed)


def test_a_torch_interleaved_checkpoint_resumes_in_deepspeed_1f1b_with_the_same_losses(reference, to_deepspeed):
    records = read_metrics(to_deepspeed)
    assert [m.step for m in records] == list(range(1, SECOND_RESIZE + 1))  # none skipped, none repeated
    assert {m.layout for m in records if m.step > FIRST_RESIZE} == {ONE_F_ONE_B_LAYOUT}
    assert_same_losses(losses(to_deepspeed), reference[0], range(1, SECOND_RESIZE + 1))


def test_a_deepspeed_1f1b_checkpoint_resumes_in_torch_interleaved_with_the_same_losses_and_weights(reference, back_to_torch):
    expected_losses, expected_weights = reference
    records = read_metrics(back_to_torch)
    assert [m.step for m in records] == list(range(1, STEPS + 1))
    assert {m.layout for m in records if m.step > SECOND_RESIZE} == {INTERLEAVED_LAYOUT}
    assert_same_losses(losses(back_to_torch), expected_losses, range(1, STEPS + 1))
    assert_same_weights(final_weights(back_to_torch, STEPS), expected_weights, RELATIVE_TOLERANCE)
    assert_ran_the_planned_order(back_to_torch, INTERLEAVED)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_other_torch_schedules_launch_with_the_deepspeed_1f1b_losses(reference, workspace, schedule):
    candidate = gpt_tiny_torch_candidate(schedule, 2)
    run = train(candidate, workspace / f"torch-{schedule}", FIRST_RESIZE)
    assert {m.layout for m in read_metrics(run)} == {f"t1p2d1 {schedule} b2 m4 torch"}
    assert_same_losses(losses(run), reference[0], range(1, FIRST_RESIZE + 1))
    assert_ran_the_planned_order(run, candidate)


def test_zbv_launch_gives_the_deepspeed_1f1b_losses_on_its_v(reference, zbv_run):
    """ZBV: rank 0 runs stages 0 and 3 (the embedding and the tied head on one rank), rank 1 stages 1 and 2."""
    assert_same_losses(losses(zbv_run), reference[0], range(1, FIRST_RESIZE + 1))
    assert_ran_the_planned_order(zbv_run, ZBV)
    for rank, stages in ((0, {"0", "3"}), (1, {"1", "2"})):
        assert {a[0] for a in (zbv_run / f"schedule_rank{rank}.txt").read_text().split()} == stages


def test_a_zbv_checkpoint_resumes_in_deepspeed_1f1b_with_the_same_losses(reference, workspace, zbv_run):
    run = resized(zbv_run, workspace / "zbv-to-deepspeed", SECOND_RESIZE)
    records = read_metrics(run)
    assert [m.step for m in records] == list(range(1, SECOND_RESIZE + 1))
    assert {m.layout for m in records if m.step > FIRST_RESIZE} == {ONE_F_ONE_B_LAYOUT}
    assert_same_losses(losses(run), reference[0], range(1, SECOND_RESIZE + 1))
