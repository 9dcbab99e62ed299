"""`pipectl status` of a Slurm run whose job waits in the queue says so; `--follow` waits, instead
of ending at once on a run that has not started. squeue is a stand-in on PATH that holds the job
PENDING for its first three answers, then lists nothing (the job gone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipectl.io import write_json_atomic
from builders import gpt_tiny_candidate, plan_of

SQUEUE = """#!/usr/bin/env python3
import sys
from pathlib import Path
asked = Path(__file__).with_name("asked")
count = int(asked.read_text()) if asked.exists() else 0
asked.write_text(str(count + 1))
assert "--name" in sys.argv and sys.argv[sys.argv.index("--name") + 1] == "job", sys.argv
if count < 3:
    print("4242 PENDING")
"""


def _cli(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipectl", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_status_says_and_follow_waits_while_the_slurm_job_is_queued(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(SQUEUE)
    (bin_dir / "squeue").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    write_json_atomic(tmp_path / "plan.json", plan_of(gpt_tiny_candidate(p=2)))
    launched = _cli(tmp_path, "launch", "plan.json", "--run-dir", "runs/job", "--engine", "slurm", "--nodes", "2",
                    "--steps", "2", env=env)  # fmt: skip
    assert launched.returncode == 0, launched.stdout + launched.stderr

    shown = _cli(tmp_path, "status", "runs/job", env=env)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "not started" in shown.stdout
    assert "Slurm job 4242 (job) is pending: waiting for its ranks" in shown.stderr, shown.stderr
    as_json = _cli(tmp_path, "status", "runs/job", "--json", env=env)
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    said = json.loads(as_json.stdout)
    assert said["slurm_queue"] == {"job_id": "4242", "state": "PENDING"} and said["state"] == "not-started", said

    started = time.monotonic()
    followed = _cli(tmp_path, "status", "runs/job", "--follow", env=env)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "Slurm job 4242 (job) is pending: waiting for its ranks" in followed.stderr, followed.stderr
    assert (bin_dir / "asked").read_text() == "4"  # asked again after waiting, then the job was gone
    assert time.monotonic() - started >= 10  # QUEUE_POLL_SECONDS
    assert "not started" in followed.stdout
