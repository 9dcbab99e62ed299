"""The Slurm script of a plan split over device kinds, run as written on this machine.

`launch --engine slurm` writes a heterogeneous job for a split: one component per node type, in
rank order, and one srun over all components whose torchrun agents take their node rank from
Slurm's task number. No Slurm here: `fake_slurm/srun` starts the step's command once per node of
the allocation with the variables Slurm sets (SLURM_PROCID, SLURMD_NODENAME), and
`fake_slurm/scontrol` lists the first component's hosts. Everything else is real and unedited:
bash runs job.sbatch, torchrun's static rendezvous, DeepSpeed's engine, gloo.

Two node types of one CPU rank each, one emulated twice as slow (`compute_slowdown`), B = 16 split
11 + 5: the losses equal the one-rank run's, and each rank ran on a node of its replica's kind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from pipectl.artifacts.run import Engine
from pipectl.launch import LaunchOptions, prepare_launch
from pipectl.rundir.metrics import read_metrics
from builders import gpt_tiny_candidate, mixed_candidate, plan_of, train_run

pytestmark = pytest.mark.multiprocess

FAKE_SLURM = Path(__file__).parent / "fake_slurm"
GLOBAL_BATCH = 16
STEPS = 6
WARMUP_STEPS = 15
RUN_TIMEOUT_SECONDS = 150
RELATIVE_TOLERANCE = 1e-4

TWO_KINDS = """\
schema_version: 1
name: two-kinds
description: two single-rank CPU nodes, the second emulating a device twice as slow
node_types:
  - name: fast-nodes
    device: cpu
    devices_per_node: 1
    nodes: 1
    slurm: {partition: fast}
  - name: slow-nodes
    device: cpu
    devices_per_node: 1
    nodes: 1
    compute_slowdown: 2
    slurm: {partition: slow, constraint: old}
"""


def _run_sbatch(script: Path, nodes: list[str], timeout_seconds: float) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "127.0.0.1",
        "FAKE_SLURM_NODES": " ".join(nodes),
    }
    process = subprocess.Popen(
        ["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"job.sbatch ran past {timeout_seconds} s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def test_the_heterogeneous_slurm_script_runs_each_replica_on_its_kinds_nodes(tmp_path):
    cluster = tmp_path / "two-kinds.yaml"
    cluster.write_text(TWO_KINDS)
    prepared = prepare_launch(
        plan_of(mixed_candidate(), cluster=str(cluster)),
        tmp_path / "split",
        # The one-rank run's schedule and weight decay: a job on two nodes would default to a real training's.
        LaunchOptions(engine=Engine.SLURM, steps=STEPS, seed=0, warmup_steps=WARMUP_STEPS, lr_schedule="constant", weight_decay=0.0),
    )
    script = prepared.run_dir / "job.sbatch"
    text = script.read_text()
    assert "#SBATCH hetjob" in text and "#SBATCH --partition=fast" in text and "#SBATCH --constraint=old" in text

    done = _run_sbatch(script, ["fast-node-1", "slow-node-1"], RUN_TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stdout[-3000:]

    one = train_run(plan_of(gpt_tiny_candidate(1, 1, b=1, global_batch=GLOBAL_BATCH)), tmp_path / "one-rank",
                    STEPS, warmup_steps=WARMUP_STEPS, timeout_seconds=RUN_TIMEOUT_SECONDS)  # fmt: skip
    expected = {m.step: m.loss for m in read_metrics(one)}
    metrics = read_metrics(prepared.run_dir)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m.loss == pytest.approx(expected[m.step], rel=RELATIVE_TOLERANCE), m.step
        placed = {(r.rank, r.device, r.host, r.samples) for r in m.ranks}
        assert placed == {(0, "cpu", "fast-node-1", 11), (1, "cpu-slowed-2x", "slow-node-1", 5)}
