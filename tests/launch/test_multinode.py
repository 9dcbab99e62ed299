"""Multi-node without a cluster: the per-node torchrun command `launch --engine torchrun` writes,
run as two "nodes" on this machine (two agents, one rank each, c10d rendezvous on the first), and
DeepSpeed's launcher over the hostfile launch writes, each train exactly like the single-node run
of the same plan."""

from __future__ import annotations

import os
import subprocess

import pytest

from pipectl.artifacts.run import Engine
from pipectl.launch import LaunchOptions, prepare_launch, run_engine
from pipectl.runtime.engines.dsinit import free_port
from pipectl.rundir.metrics import read_metrics
from builders import gpt_tiny_candidate, plan_of


# A job on several nodes defaults to a real training's schedule (`resolve_defaults`): the same
# settings as the one-node run, named.
ONE_NODE_TRAINING = {"lr_schedule": "constant", "weight_decay": 0.0}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The plan, and its 4-step single-node (local engine) run."""
    plan = plan_of(gpt_tiny_candidate(p=2))
    one = prepare_launch(plan, tmp_path_factory.mktemp("one") / "run", LaunchOptions(steps=4))
    try:
        assert run_engine(one.command, one.run_dir, timeout_seconds=240) == 0
    finally:
        one.lock.release()
    return plan, {m.step: m.loss for m in read_metrics(one.run_dir)}


@pytest.mark.multiprocess
def test_two_torchrun_nodes_train_like_one_node(one_node, tmp_path):
    plan, single = one_node

    options = LaunchOptions(engine=Engine.TORCHRUN, nodes=2, master_addr="127.0.0.1", master_port=free_port(), steps=4,
                            **ONE_NODE_TRAINING)  # fmt: skip
    two = prepare_launch(plan, tmp_path / "two", options)
    two.lock.release()  # each "node" below is a separate agent, as on a cluster
    assert (two.job.nodes, two.job.ranks_per_node) == (2, 1)
    argv = two.command.argv
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--nproc_per_node") + 1] == "1"
    env = {**os.environ, **two.command.env}
    logs = [(two.run_dir / f"node{i}.log").open("w") for i in range(2)]
    nodes = [subprocess.Popen(argv, cwd=two.run_dir, env=env, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    try:
        codes = [node.wait(timeout=240) for node in nodes]
    finally:
        for node, log in zip(nodes, logs):
            node.kill()
            log.close()
    assert codes == [0, 0], (two.run_dir / "node0.log").read_text()[-2000:]

    multi = {m.step: m.loss for m in read_metrics(two.run_dir)}
    assert sorted(multi) == [1, 2, 3, 4]
    for step in multi:
        assert multi[step] == pytest.approx(single[step], rel=1e-6, abs=0), step
    assert {r.rank for r in read_metrics(two.run_dir)[-1].ranks} == {0, 1}


@pytest.mark.multiprocess
def test_deepspeeds_launcher_runs_the_generated_hostfile_like_one_node(one_node, tmp_path):
    """`--engine deepspeed --hosts localhost`: DeepSpeed's own launcher reads the hostfile launch
    wrote (`localhost slots=2`) and starts the ranks; the losses are the local engine's."""
    plan, single = one_node
    prepared = prepare_launch(plan, tmp_path / "ds", LaunchOptions(engine=Engine.DEEPSPEED, hosts=["localhost"], steps=4))
    try:
        assert (prepared.run_dir / "hostfile").read_text() == "localhost slots=2\n"
        assert run_engine(prepared.command, prepared.run_dir, timeout_seconds=240, lock=prepared.lock) == 0
    finally:
        prepared.lock.release()
    losses = {m.step: m.loss for m in read_metrics(prepared.run_dir)}
    assert sorted(losses) == [1, 2, 3, 4]
    for step in losses:
        assert losses[step] == pytest.approx(single[step], rel=1e-6, abs=0), step
