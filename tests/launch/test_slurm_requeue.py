"""A Slurm job that requeues itself, run as written on this machine: two "nodes" under stand-ins
of sbatch, srun and scontrol (tests/launch/fake_slurm) that run job.sbatch's steps on local CPU
ranks. Everything else is real and unedited: bash runs the script `pipectl launch --engine slurm`
wrote, one torchrun agent per "node" with c10d's rendezvous on the allocation's first node,
DeepSpeed's engine, gloo.

The pre-timeout signal (`--signal=B:USR1@S`) is delivered to the batch shell mid-run: the ranks
stop at the step's end with a checkpoint, the script requeues the job, and the requeued start
resumes and trains to the end with the losses of a run never interrupted. A step that fails at
every start stops requeueing after `requeue_limit` and says why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipectl.io import write_json_atomic
from pipectl.rundir.run import read_requeues
from pipectl.artifacts.run import RequeueOutcome
from pipectl.rundir.metrics import read_metrics
from builders import gpt_tiny_candidate, plan_of, train_run

FAKE_SLURM = Path(__file__).parent / "fake_slurm"
STEPS = 6
WARMUP_STEPS = 15
JOB_SECONDS = 240


def _cli(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipectl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def _slurm_env(state: Path, **extra: str) -> dict[str, str]:
    state.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_STATE": str(state),
        "FAKE_SLURM_NODES": "node-a node-b",
        "FAKE_SLURM_NODELIST": "127.0.0.1,127.0.0.1",  # what `scontrol show hostnames` lists: the first is the head
        "COLUMNS": "200",
        **extra,
    }


def _wait_for(condition, what: str, seconds: float = JOB_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.1)


def _submit(tmp_path: Path, env: dict[str, str], *launch_args: str) -> tuple[Path, str]:
    """`pipectl launch plan.json --run-dir runs/job --engine slurm`, then `sbatch` as the launch
    says, from a temporary working directory with relative paths."""
    write_json_atomic(tmp_path / "plan.json", plan_of(gpt_tiny_candidate(p=2)))
    launched = _cli(tmp_path, "launch", "plan.json", "--run-dir", "runs/job", "--engine", "slurm", "--nodes", "2",
                    "--steps", str(STEPS), "--warmup-steps", str(WARMUP_STEPS), "--lr-schedule", "constant",
                    "--weight-decay", "0", *launch_args, env=env)  # the local run's settings, not a 2-node job's defaults
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "submit it with: sbatch" in launched.stdout
    submitted = subprocess.run(["sbatch", "runs/job/job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    return tmp_path / "runs" / "job", submitted.stdout.split()[-1]


@pytest.mark.multiprocess
def test_the_time_limits_signal_requeues_the_job_and_it_resumes_with_the_same_losses(tmp_path):
    state = tmp_path / "slurm"
    env = _slurm_env(state)
    run, job_id = _submit(tmp_path, env, "--requeue-limit", "2")
    script = (run / "job.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@120" in script

    _wait_for(lambda: (m := read_metrics(run)) and m[-1].step >= 2, "step 2")
    os.kill(int((state / f"{job_id}.batch.pid").read_text()), signal.SIGUSR1)  # 120 s before the time limit
    _wait_for(lambda: (state / f"{job_id}.exit").exists(), "the job's end")
    output = (run / "logs" / f"slurm-{job_id}.out").read_text()
    assert (state / f"{job_id}.exit").read_text() == "0", output[-3000:]

    (stopped, finished) = read_requeues(run)
    assert stopped.outcome is RequeueOutcome.REQUEUED and stopped.exit_code == 0 and stopped.restart_count == 0
    assert "with checkpoint step" in stopped.ended and stopped.checkpoint_step == stopped.steps_done < STEPS
    assert stopped.ended.endswith("(time limit in 120 s (Slurm USR1))"), stopped.ended  # its own words, not a resize's
    assert finished.outcome is RequeueOutcome.FINISHED and finished.restart_count == 1 and finished.steps_done == STEPS
    assert f"requeued: it resumes from checkpoint step {stopped.checkpoint_step}" in output

    metrics = read_metrics(run)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))  # none lost, none trained twice
    assert {r.host for m in metrics for r in m.ranks} == {"node-a", "node-b"}
    reference = train_run(plan_of(gpt_tiny_candidate(p=2)), tmp_path / "uninterrupted", STEPS,
                          warmup_steps=WARMUP_STEPS, timeout_seconds=JOB_SECONDS)  # fmt: skip
    expected = {m.step: m.loss for m in read_metrics(reference)}
    for m in metrics:
        assert m.loss == pytest.approx(expected[m.step], rel=1e-6, abs=0), m.step

    status = _cli(tmp_path, "status", "runs/job", env=env)
    assert status.returncode == 0 and "requeued 1 time" in " ".join(status.stdout.split()), status.stdout


def test_a_job_failing_at_every_start_stops_requeueing_after_its_limit_and_says_why(tmp_path):
    state = tmp_path / "slurm"
    env = _slurm_env(state, FAKE_SLURM_SRUN_EXIT="1")  # every start's step fails at once
    run, job_id = _submit(tmp_path, env, "--requeue-limit", "2")
    _wait_for(lambda: (state / f"{job_id}.exit").exists(), "the job's end", seconds=120)
    assert (state / f"{job_id}.exit").read_text() == "1"
    records = read_requeues(run)
    assert [r.outcome for r in records] == [RequeueOutcome.REQUEUED] * 2 + [RequeueOutcome.STOPPED]
    assert [r.restart_count for r in records] == [0, 1, 2]
    assert "requeued 2 times in a row without getting past checkpoint step 0: not again" in records[-1].reason
    output = (run / "logs" / f"slurm-{job_id}.out").read_text()
    assert "not requeued: requeued 2 times in a row" in output
    status = _cli(tmp_path, "status", "runs/job", "--json", env=env)
    assert json.loads(status.stdout)["slurm"]["requeues"] == 2
