"""ZeRO-2 for one-stage plans in DeepSpeed's ordinary engine (`runtime/plain.py`, issue 17).

Real ranks through the run-directory contract: gpt-tiny, B = 8, two data-parallel replicas of one
stage. With ZeRO-2 (gradients reduce-scattered and partitioned, DeepSpeed's ordinary engine) every
step's loss and the final weights equal ZeRO-1's in the pipeline engine (fp32: only the order of
the gradient sums differs); its checkpoint, written from the ZeRO-2 optimizer's partitions,
resumes on one ZeRO-1 rank in the pipeline engine with the losses of the uninterrupted ZeRO-1 run.
"""

from __future__ import annotations

import json
import shutil

import pytest

from builders import assert_same_weights, final_weights, gpt_tiny_candidate, plan_of, train_run
from pipectl.artifacts.plan import MorphEntry
from pipectl.runtime.metrics import read_metrics

pytestmark = pytest.mark.multiprocess

STEPS, HALF = 6, 3
TOLERANCE = 1e-5  # losses: only the order of the gradient sums differs
WEIGHT_TOLERANCE = 1e-4  # per tensor, relative to its norm (Adam amplifies those sums' rounding near zero)
ZERO1 = gpt_tiny_candidate(1, 2, m=2)
ZERO2 = ZERO1.model_copy(update={"zero_stage": 2})
P1 = gpt_tiny_candidate(1, 1, m=4)


def run(tmp_path, name, chosen, steps, table=()):
    plan = plan_of(chosen, global_batch=8, morph_table=[MorphEntry(devices=c.devices, candidate=c) for c in table])
    return train_run(plan, tmp_path / name, steps, warmup_steps=0, timeout_seconds=150)


def losses(run_dir):
    return {m.step: m.loss for m in read_metrics(run_dir)}


def test_zero2_in_the_ordinary_engine_trains_as_zero1_and_its_checkpoint_resumes_in_the_pipeline_engine(tmp_path):
    from pipectl.resize.morph import resize_run

    reference = run(tmp_path, "zero1", ZERO1, STEPS)
    zero2 = run(tmp_path, "zero2", ZERO2, STEPS)
    assert json.loads((zero2 / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
    expected = losses(reference)
    assert sorted(losses(zero2)) == list(range(1, STEPS + 1))
    for step, loss in losses(zero2).items():
        assert loss == pytest.approx(expected[step], rel=TOLERANCE), step
    assert_same_weights(final_weights(zero2, STEPS), final_weights(reference, STEPS), WEIGHT_TOLERANCE)

    # The ZeRO-2 run's checkpoint after step 3 (each replica's half of the partitions), resumed on
    # one rank with ZeRO-1 in the pipeline engine.
    half = run(tmp_path, "zero2-half", ZERO2, HALF, table=(P1, ZERO2))
    resized = tmp_path / "resized"
    shutil.copytree(half, resized)
    result = resize_run(resized, 1, steps=STEPS, run_timeout_seconds=150)
    assert result.exit_code == 0, (resized / "logs" / "engine.log").read_text()[-3000:]
    after = {m.step: (m.loss, m.layout) for m in read_metrics(resized)}
    assert [after[s][1].split()[0] for s in range(1, STEPS + 1)] == ["t1p1d2"] * HALF + ["t1p1d1"] * (STEPS - HALF)
    for step in range(HALF + 1, STEPS + 1):
        assert after[step][0] == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.slow
def test_a_job_moves_live_into_and_out_of_zero2(tmp_path):
    """Live resizes hand the ZeRO-2 optimizer's partitions over as ZeRO-1's: p = 2 (ZeRO-1) -> d = 2
    (ZeRO-2, the ordinary engine) -> one rank, every loss the one-rank run's."""
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "resize"))
    from test_resize_live import BackgroundJob  # noqa: E402

    from pipectl.resize.live import live_resize
    from pipectl.resize.morph import decide_resize

    p2 = gpt_tiny_candidate(2, 1, m=4)
    table = [MorphEntry(devices=1, candidate=P1), MorphEntry(devices=2, candidate=ZERO2)]
    job = BackgroundJob(plan_of(p2, global_batch=8, morph_table=table), tmp_path / "live")
    job.wait_for_step(3)
    for devices, layout in [(2, "t1p1d2 1f1b b2 m2"), (1, "t1p1d1 1f1b b2 m4")]:
        result = live_resize(decide_resize(job.run_dir, devices), requested_unix=time.time())
        assert result.record.to_layout == layout and result.record.path == "live"
        job.wait_for_step(result.record.resume_step + 3)
    job.stop()
    reference = BackgroundJob(plan_of(P1, global_batch=8), tmp_path / "reference")
    metrics = read_metrics(job.run_dir)
    reference.wait_for_step(metrics[-1].step)
    reference.stop()
    expected = losses(reference.run_dir)
    for m in metrics:
        assert m.loss == pytest.approx(expected[m.step], rel=1e-4), m.step
