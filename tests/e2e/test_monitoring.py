"""Monitoring a run as a user does: `pipectl launch ... --tensorboard --log-every 2` from a
temporary folder, then the metrics lines, rank 0's step lines, TensorBoard's own reader and
`pipectl status` (`--follow`, and a run whose ranks are still starting)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from pipectl.artifacts.run import RankHeartbeat, RankState
from pipectl.rundir.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).parent))  # test_first_hour, beside this file
from test_first_hour import pipectl, said, succeeded  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """A 2-rank gpt-tiny run with a warming-up cosine schedule, step lines every 2 steps and
    TensorBoard scalars."""
    folder = tmp_path_factory.mktemp("monitored")
    profiled = pipectl("profile", "gpt-tiny", "-o", "profile.json", cwd=folder)
    assert succeeded(profiled), said(profiled)
    planned = pipectl("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2", "--pipeline-parallel",
                      "2", "--global-batch", "8", "-o", "plan.json", cwd=folder)  # fmt: skip
    assert succeeded(planned), said(planned)
    launched = pipectl("launch", "plan.json", "--run-dir", "runs/watched", "--steps", STEPS, "--lr-schedule",
                       "warmup-cosine", "--warmup-steps", "2", "--tensorboard", "--log-every", "2", cwd=folder)  # fmt: skip
    assert succeeded(launched), said(launched)
    return folder, folder / "runs" / "watched", launched


@pytest.mark.multiprocess
def test_each_step_line_holds_the_learning_rate_gradient_norm_and_throughput(monitored):
    folder, run, launched = monitored
    assert "chosen by default: lr 0.001; weight decay 0; checkpoint every 0" in " ".join(launched.stdout.split())
    metrics = read_metrics(run)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))
    # The rate each step trained with is what DeepSpeed's own scheduler gives for it.
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    params = json.loads((run / "ds_config.json").read_text())["scheduler"]["params"]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule, expected = WarmupCosineLR(optimizer, **params), []
    for _ in range(STEPS):
        expected.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    assert [m.learning_rate for m in metrics] == pytest.approx(expected) and expected[0] < max(expected)  # it warms up
    assert all(m.grad_norm is not None and m.grad_norm > 0 for m in metrics)  # clipping at 1.0 computes it
    assert all(len(m.stage_peak_memory_bytes) == 2 and min(m.stage_peak_memory_bytes) > 0 for m in metrics)
    seq_len = json.loads((run / "plan.json").read_text())["model_shape"]["seq_len"]
    for m in metrics:
        assert m.tokens_per_second == pytest.approx(m.samples_per_second * seq_len)
        # Where each rank's step went: its optimizer step timed apart from the gradient reductions.
        assert all(r.optimizer_seconds is not None and 0 < r.optimizer_seconds <= r.end_of_step_seconds for r in m.ranks)
    engine_log = (run / "logs" / "engine.log").read_text()
    printed = [line for line in engine_log.splitlines() if " step 2/4 loss " in f" {line}" or " step 4/4 loss " in f" {line}"]
    assert len(printed) == 2 and "lr " in printed[0] and "grad-norm" in printed[0], engine_log[-2000:]
    assert "step 1/4 loss" not in engine_log  # every 2 steps, and the last


@pytest.mark.multiprocess
def test_tensorboards_own_reader_reads_every_step(monitored):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run, _ = monitored
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    expected = {m.step: m.loss for m in read_metrics(run)}
    assert sorted(losses) == sorted(expected)
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6)
    assert {"train/learning_rate", "train/grad_norm", "speed/tokens_per_second", "time/step_seconds",
            "memory/stage1_peak_gib"} <= set(
        events.Tags()["scalars"]
    )


@pytest.mark.multiprocess
def test_status_follows_until_the_end_and_tells_starting_from_not_started(monitored):
    folder, run, _ = monitored
    followed = pipectl("status", "runs/watched", "--follow", cwd=folder, timeout=60)
    assert succeeded(followed) and "4 / 4 steps (finished)" in followed.stdout, said(followed)

    # The same run as it looked before its first step: ranks beating, no metrics line nor checkpoint yet.
    (run / "metrics.jsonl").write_text("")
    (run / "checkpoints").rename(run / "checkpoints.away")
    now = time.time()
    for rank in (0, 1):
        beat = RankHeartbeat(rank=rank, pid=1, state=RankState.RUNNING, started_unix=now, beat_unix=now, progress_unix=now)
        (run / "logs" / f"heartbeat-rank{rank}.json").write_text(beat.model_dump_json())
    starting = pipectl("status", "runs/watched", cwd=folder)
    assert "0 / 4 steps (starting: the ranks are up, the first step is not done yet)" in " ".join(starting.stdout.split())
    for rank in (0, 1):
        (run / "logs" / f"heartbeat-rank{rank}.json").unlink()
    quiet = pipectl("status", "runs/watched", cwd=folder)
    (run / "checkpoints.away").rename(run / "checkpoints")
    assert "0 / 4 steps (not started)" in " ".join(quiet.stdout.split()), said(quiet)


@pytest.mark.multiprocess
def test_one_weights_and_biases_run_across_a_resume_offline(monitored, monkeypatch, tmp_path):
    folder = monitored[0]
    monkeypatch.setenv("HOME", str(tmp_path))  # no `wandb login` here
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    planned = pipectl("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "1", "--global-batch", "8",
                      "-o", "one.json", cwd=folder)  # fmt: skip
    assert succeeded(planned), said(planned)
    refused = pipectl("launch", "one.json", "--run-dir", "runs/wb", "--wandb", "pipectl-tests", "--dry-run", cwd=folder)
    assert refused.returncode == 2 and "--wandb pipectl-tests needs a Weights & Biases login" in refused.stderr, said(refused)

    monkeypatch.setenv("WANDB_MODE", "offline")
    first = pipectl("launch", "one.json", "--run-dir", "runs/wb", "--steps", "2", "--wandb", "pipectl-tests", cwd=folder)
    assert succeeded(first), said(first)
    assert "left behind" not in said(first)  # W&B's helpers outlive rank 0: not ranks left behind
    resumed = pipectl("launch", "one.json", "--run-dir", "runs/wb", "--resume", "--steps", "3", cwd=folder)
    assert succeeded(resumed), said(resumed)
    run = folder / "runs" / "wb"
    run_id = json.loads((run / "job.json").read_text())["wandb_run_id"]
    starts = sorted((run / "wandb").glob("offline-run-*"))
    assert len(starts) == 2 and all(start.name.endswith(f"-{run_id}") for start in starts), starts
    assert all((start / f"run-{run_id}.wandb").stat().st_size > 0 for start in starts)


@pytest.mark.multiprocess
def test_tensorboard_shows_steps_trained_again_after_a_resume_once(monitored):
    """A resume from an older checkpoint trains its later steps again: TensorBoard's own reader sees
    each step once, from the start that trained it last (the first event files would add a second)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = monitored[0]
    planned = pipectl("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "1", "--global-batch", "8",
                      "-o", "single.json", cwd=folder)  # fmt: skip
    assert succeeded(planned), said(planned)
    first = pipectl("launch", "single.json", "--run-dir", "runs/tb", "--steps", "4", "--checkpoint-every", "2",
                    "--tensorboard", cwd=folder)  # fmt: skip
    assert succeeded(first), said(first)
    run = folder / "runs" / "tb"
    newest = run / "checkpoints" / "step00000004"
    assert newest.is_dir(), sorted(p.name for p in (run / "checkpoints").iterdir())
    shutil.rmtree(newest)  # steps 3 and 4 are trained again from step 2's checkpoint
    resumed = pipectl("launch", "single.json", "--run-dir", "runs/tb", "--resume", cwd=folder)
    assert succeeded(resumed), said(resumed)
    assert "resumed from step 2" in resumed.stdout, said(resumed)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [step for step, _ in losses] == [1, 2, 3, 4], losses
    assert [loss for _, loss in losses] == pytest.approx([m.loss for m in read_metrics(run)], rel=1e-6)
