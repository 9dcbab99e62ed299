"""`pipectl resize` of a Slurm run, from the login node: the new job is submitted anew, so it asks
for the nodes the new layout fills (its devices over the cluster's devices per node), with the
cluster file's Slurm settings, and a dry run refuses exactly what the resize refuses.

It kept the job's node count: 16 ranks on a job of 3 nodes were refused (after the dry run had
accepted them, and leaving RUN/live/resize.lock behind), 12 ranks became 3 nodes x 4 GPUs with
each node's other 4 idle, and the rewritten job.sbatch lost the cluster file's partition, account
and set-up. GPT-2 2.5B (derived for A100s) on a cluster file of 4 nodes x 8 A100s, planned for 24
devices (3 nodes), stands in for GPT-3 175B on 384 nodes: the same code, in seconds. No sbatch runs
here: a stand-in prints the id Slurm would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

_SCRIPT = Path(sys.executable).with_name("pipectl")
PIPECTL = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "pipectl"]

CLUSTER = """\
schema_version: 1
name: a100-4x8
node_types:
  - {name: a100-nodes, device: a100-80gb, devices_per_node: 8, nodes: 4}
slurm:
  partition: gpu
  account: llm
  time: "2-00:00:00"
  setup:
    - module load cuda/12.4
"""


def pipectl(*args: object, cwd: Path, path: Path | None = None) -> subprocess.CompletedProcess:
    """`pipectl ARGS` in `cwd`, as a user's shell runs it (tests/e2e/test_first_hour.py's helper);
    `path`: a folder put first on PATH (the stand-in sbatch)."""
    env = {**os.environ, "COLUMNS": "100", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("PIPECTL_MODEL_PATH", None)
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    return subprocess.run([*PIPECTL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def said(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """A folder holding runs/big, a Slurm run of 24 A100s (3 nodes x 8) written from a login node."""
    folder = tmp_path_factory.mktemp("login")
    (folder / "mine.yaml").write_text(CLUSTER)
    np.random.default_rng(0).integers(0, 50000, 400_000).astype("uint16").tofile(folder / "tokens.bin")
    for argv in (
        ["profile", "gpt2-2.5b", "--derive", "--device", "a100-80gb", "-o", "p.json"],
        ["plan", "--profile", "p.json", "--cluster", "mine.yaml", "--devices", "24", "--global-batch", "96", "-o", "plan.json"],
        ["launch", "plan.json", "--run-dir", "runs/big", "--engine", "slurm", "--steps", "1000", "--data", "tokens.bin"],
    ):  # fmt: skip
        done = pipectl(*argv, cwd=folder)
        assert done.returncode == 0, said(done)
    assert "#SBATCH --nodes=3" in (folder / "runs/big/job.sbatch").read_text()
    return folder


@pytest.fixture
def login(launched, tmp_path) -> Path:
    """A fresh copy of the launched folder for one test."""
    folder = tmp_path / "login"
    shutil.copytree(launched, folder)
    return folder


def sbatch_options(run: Path) -> dict[str, str]:
    lines = (run / "job.sbatch").read_text().splitlines()
    return dict(line.removeprefix("#SBATCH --").split("=", 1) for line in lines if line.startswith("#SBATCH --") and "=" in line)


@pytest.mark.parametrize("devices, nodes, per_node", [(16, 2, 8), (12, 2, 6), (32, 4, 8)])
def test_a_slurm_resize_asks_for_the_nodes_the_new_layout_fills(login, devices, nodes, per_node):
    dry = pipectl("resize", "runs/big", "--devices", devices, "--dry-run", cwd=login)
    assert dry.returncode == 0, said(dry)
    assert f"{nodes} nodes x {per_node}" in dry.stdout, said(dry)
    done = pipectl("resize", "runs/big", "--devices", devices, cwd=login)
    assert done.returncode == 0, said(done)
    run = login / "runs/big"
    job = json.loads((run / "job.json").read_text())
    assert (job["world_size"], job["nodes"], job["ranks_per_node"]) == (devices, nodes, per_node)
    options = sbatch_options(run)
    assert (options["nodes"], options["gpus-per-node"]) == (str(nodes), str(per_node))
    # The cluster file's settings are the new script's as they were the first one's.
    assert (options["partition"], options["account"], options["time"]) == ("gpu", "llm", "2-00:00:00")
    assert "module load cuda/12.4" in (run / "job.sbatch").read_text()
    assert f"{devices} ranks, {nodes} nodes x {per_node} GPU ranks" in (run / "job.sbatch").read_text()


def test_a_submitted_slurm_resize_submits_the_rewritten_script(login):
    bin_dir = login / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\necho "$1" > "$(dirname "$0")/submitted"\necho "Submitted batch job 77"\n')
    (bin_dir / "sbatch").chmod(0o755)
    done = pipectl("resize", "runs/big", "--devices", 16, "--submit", cwd=login, path=bin_dir)
    assert done.returncode == 0, said(done)
    assert "submitted it as Slurm job 77" in " ".join(done.stdout.split()), said(done)
    assert (bin_dir / "submitted").read_text().strip() == str(login / "runs/big/job.sbatch")
    assert sbatch_options(login / "runs/big")["nodes"] == "2"


def test_a_layout_that_fills_no_whole_nodes_is_refused_alike_by_the_dry_run_and_the_resize(login):
    """27 devices (t1p9d3) over nodes of 8 would be 4 nodes of 6.75 ranks: refused, naming the values,
    by the dry run as by the resize, which then leaves the run as it was and no lock behind."""
    run = login / "runs/big"
    before = {name: (run / name).read_text() for name in ("job.json", "plan.json", "job.sbatch")}
    answers = [pipectl("resize", "runs/big", "--devices", 27, *dry, cwd=login) for dry in (["--dry-run"], [])]
    for done in answers:
        assert done.returncode == 2 and "Traceback" not in done.stderr, said(done)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "27" in errors[0] and "8" in errors[0], said(done)
    assert answers[0].stderr == answers[1].stderr
    assert {name: (run / name).read_text() for name in before} == before
    assert not (run / "live").exists() and not (run / "stop_requested").exists()
