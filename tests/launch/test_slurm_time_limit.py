"""A Slurm job's signal lead time (`--signal=B:USR1@S`, slurm.signal_seconds) must be shorter than its
time limit (`--time-limit`, slurm.time): a script that asked to be told 120 s before a one-minute
limit was written as if nothing were wrong, and its job would be killed with no checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cli_process import pipectl
from pipectl.artifacts.cluster import slurm_time_seconds
from builders import write_plan


CPU_CLUSTER = """\
schema_version: 1
name: cpu-nodes
node_types:
  - {{name: cpus, device: cpu, devices_per_node: 2, nodes: 2}}
slurm:
  partition: batch
{slurm}"""


@pytest.mark.parametrize(
    "value, seconds",
    [("1", 60), ("90", 5400), ("0:30", 60), ("2:30", 180), ("1:00:00", 3600), ("01:02:03", 3780), ("2-0", 172800),
     ("1-12", 129600), ("1-00:30", 88200), ("2-00:00:00", 172800), ("0", None), ("unlimited", None), ("INFINITE", None)],
)  # fmt: skip
def test_slurm_time_limits_are_read_in_every_format_sbatch_takes(value, seconds):
    # Slurm counts whole minutes (seconds round up), and 0 means no limit (sbatch(1), --time).
    assert slurm_time_seconds(value) == seconds


def launch_slurm(folder: Path, *flags: str) -> subprocess.CompletedProcess:
    write_plan(folder / "plan.json")
    return pipectl("launch", "plan.json", "--run-dir", "runs/t", "--engine", "slurm", *flags, "--dry-run", cwd=folder)


def refused(done: subprocess.CompletedProcess) -> str:
    said = f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 2, said
    assert "Traceback" not in said, said
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, said
    return errors[0]


def test_a_time_limit_shorter_than_the_signal_lead_time_is_refused(tmp_path):
    line = refused(launch_slurm(tmp_path, "--time-limit", "1"))
    assert "time limit 1 " in line and "120 s" in line, line
    assert not (tmp_path / "runs").exists()


def test_a_cluster_files_signal_lead_time_not_shorter_than_its_time_limit_is_refused(tmp_path):
    (tmp_path / "mine.yaml").write_text(CPU_CLUSTER.format(slurm='  time: "01:00:00"\n  signal_seconds: 7200\n'))
    line = refused(launch_slurm(tmp_path, "--cluster", "mine.yaml"))
    assert "01:00:00" in line and "7200 s" in line, line
    # As long as the limit: the signal would come as the job starts.
    (tmp_path / "mine.yaml").write_text(CPU_CLUSTER.format(slurm='  time: "2:00"\n  signal_seconds: 120\n'))
    refused(launch_slurm(tmp_path, "--cluster", "mine.yaml"))


@pytest.mark.parametrize("limit", ["3", "0", "unlimited", "1-00"])
def test_a_time_limit_longer_than_the_signal_lead_time_or_none_is_written(tmp_path, limit):
    done = launch_slurm(tmp_path, "--time-limit", limit)
    assert done.returncode == 0, done.stderr
    assert f"#SBATCH --time={limit}" in done.stdout and "#SBATCH --signal=B:USR1@120" in done.stdout


def test_the_time_limit_given_to_launch_wins_over_the_cluster_files_in_the_check(tmp_path):
    (tmp_path / "mine.yaml").write_text(CPU_CLUSTER.format(slurm='  time: "01:00:00"\n  signal_seconds: 7200\n'))
    done = launch_slurm(tmp_path, "--cluster", "mine.yaml", "--time-limit", "1-00")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --time=1-00" in done.stdout and "#SBATCH --signal=B:USR1@7200" in done.stdout
