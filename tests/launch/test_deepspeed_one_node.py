"""`--engine deepspeed` on one machine without `--hosts`: the job meets on loopback, as the local
engine's does. Its master address was '' (as for several nodes, where DeepSpeed's launcher needs
the hosts), and DeepSpeed's runner then asked `ssh localhost hostname -I` for one: a traceback on
any machine without an ssh server to itself."""

from __future__ import annotations

import json

import pytest

from cli_process import pipectl
from pipectl.artifacts.run import Engine
from pipectl.launch import LaunchOptions, master_address
from builders import write_plan



def test_a_one_node_deepspeed_job_without_a_master_meets_on_loopback():
    options = LaunchOptions(engine=Engine.DEEPSPEED)
    assert master_address(options, nodes=1) == "127.0.0.1"
    assert master_address(options, nodes=2) == ""  # several nodes: DeepSpeed's launcher refuses without hosts


@pytest.mark.multiprocess
def test_deepspeed_on_one_machine_without_hosts_trains(tmp_path):
    write_plan(tmp_path / "plan.json")
    done = pipectl("launch", "plan.json", "--run-dir", "runs/ds", "--engine", "deepspeed", "--steps", "4", cwd=tmp_path)
    said = f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, said
    assert "Traceback" not in done.stderr, said
    launch_sh = (tmp_path / "runs/ds/launch.sh").read_text()
    assert "--master_addr 127.0.0.1" in launch_sh, launch_sh
    assert json.loads((tmp_path / "runs/ds/job.json").read_text())["master_addr"] == "127.0.0.1"  # a resize's too
    steps = [json.loads(line)["step"] for line in (tmp_path / "runs/ds/metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4, steps
