"""Elastic morphing with torchrun (issue 5): two agents on loopback act as two nodes. The job grows
from 1 rank to 2 when the second agent joins, shrinks back when that agent is killed (SIGKILL, as
a lost node), and grows again when it is started anew. Each restart takes the morph table's plan
for the world size it finds and loads the newest checkpoint.

Checked: every step 1..N is in the metrics once; a step trained again after a restart (steps after
the last checkpoint are recomputed) has the same loss as the first time; and the whole trajectory
matches an uninterrupted single-rank run to 1e-4 relative: no step was skipped or repeated in the
data order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipectl.artifacts.plan import Candidate, MorphEntry, Plan
from pipectl.artifacts.run import ElasticRange, Engine
from pipectl.launch import LaunchOptions, prepare_launch, run_engine
from pipectl.rundir.checkpoints import STOP_FILE
from pipectl.rundir.metrics import read_metrics
from builders import plan_of

pytestmark = pytest.mark.multiprocess  # about a minute: CI runs it (issue 5 asks for it)

EVENT_TIMEOUT_SECONDS = 120
RELATIVE_TOLERANCE = 1e-4


def candidate(p: int) -> Candidate:
    return Candidate(
        devices=p, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=1,
        micro_batch_size=2, micro_batches=4, schedule="1f1b", recompute=False, zero_stage=1,
        stage_layers=[(0, 9)] if p == 1 else [(0, 4), (4, 9)], predicted_step_seconds=0.05,
        samples_per_second=160.0, tflops_per_device=0.0, peak_memory_bytes=[1] * p, bubble_fraction=0.0,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip


def elastic_plan() -> Plan:
    """One rank per agent: 1 agent -> p=1, 2 agents -> p=2 (the same micro-batches: B = 8)."""
    table = {1: candidate(1), 2: candidate(2)}
    return plan_of(table[1], global_batch=8, morph_table=[MorphEntry(devices=n, candidate=c) for n, c in table.items()])


def start_agent(prepared, name: str) -> subprocess.Popen:
    log = (prepared.run_dir / "logs" / f"agent_{name}.log").open("ab")
    return subprocess.Popen(
        prepared.command.argv,
        cwd=prepared.run_dir,
        env={**os.environ, **prepared.command.env},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and every rank it started, at once: a lost node."""
    for pid in process_tree(agent.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=30)


def wait_for_steps(run_dir: Path, world_size: int, count: int, after_unix: float) -> None:
    """Until `count` steps were completed by a group of `world_size` ranks after `after_unix`."""
    deadline = time.monotonic() + EVENT_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        done = [m for m in read_metrics(run_dir) if m.world_size == world_size and m.time_unix > after_unix]
        if len(done) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {count} steps on {world_size} ranks within {EVENT_TIMEOUT_SECONDS} s")


def raw_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_kill_an_agent_training_continues_replanned_then_grows_back(tmp_path):
    run = tmp_path / "elastic"
    prepared = prepare_launch(
        elastic_plan(),
        run,
        LaunchOptions(
            engine=Engine.TORCHRUN,
            elastic=ElasticRange(min_nodes=1, max_nodes=2, max_restarts=6),
            master_addr="127.0.0.1",  # both agents run here: the rendezvous head is this machine
            steps=100_000,  # stopped through the stop file once the scenario is done
            checkpoint_every=5,  # saving also paces the job, so that events land mid-run
        ),
    )
    assert prepared.job.ranks_per_node == 1
    agents = {}
    try:
        agents["a"] = start_agent(prepared, "a")  # hosts the rendezvous store: it must survive
        wait_for_steps(run, 1, 3, 0.0)
        agents["b"] = start_agent(prepared, "b")
        wait_for_steps(run, 2, 3, time.time())  # grown to 2 ranks (p=2)
        killed_at = time.time()
        kill_node(agents["b"])
        wait_for_steps(run, 1, 3, killed_at)  # re-planned onto the surviving rank (p=1)
        agents["c"] = start_agent(prepared, "c")
        wait_for_steps(run, 2, 3, time.time())  # grown back
        (run / STOP_FILE).write_text("scenario done\n")
        assert agents["a"].wait(timeout=EVENT_TIMEOUT_SECONDS) == 0
        agents["c"].wait(timeout=EVENT_TIMEOUT_SECONDS)
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill_node(agent)

    metrics = read_metrics(run)
    final_step = metrics[-1].step
    assert [m.step for m in metrics] == list(range(1, final_step + 1))
    layouts = [m["world_size"] for m in sorted(raw_lines(run), key=lambda m: m["time_unix"])]
    changes = [w for i, w in enumerate(layouts) if i == 0 or layouts[i - 1] != w]
    assert changes[:4] == [1, 2, 1, 2], changes

    # A step trained twice (after a restart) saw the same data and weights both times.
    first_loss: dict[int, float] = {}
    for line in raw_lines(run):
        if line["step"] in first_loss:
            assert line["loss"] == pytest.approx(first_loss[line["step"]], rel=RELATIVE_TOLERANCE), line["step"]
        first_loss.setdefault(line["step"], line["loss"])

    # The uninterrupted trajectory, on one rank, for as many steps.
    baseline_plan = elastic_plan()
    reference = prepare_launch(baseline_plan, tmp_path / "uninterrupted", LaunchOptions(steps=final_step))
    assert run_engine(reference.command, reference.run_dir, timeout_seconds=300) == 0
    expected = {m.step: m.loss for m in read_metrics(reference.run_dir)}
    for m in metrics:
        assert m.loss == pytest.approx(expected[m.step], rel=RELATIVE_TOLERANCE), m.step
