"""Engine command lines (pure), the Slurm script by content, and running a command with logs,
exit code, signal forwarding and a time limit."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pipectl.artifacts.run import ElasticRange, Engine, JobSpec
from pipectl.errors import LaunchError, UserInputError
from pipectl.runtime.engines.dsinit import free_port
from pipectl.launch.engines import LaunchCommand, build_command, launch_script, slurm_script
from pipectl.launch.supervise import JobEnded, run_engine

RUN = Path("/runs/demo")


def job(engine=Engine.LOCAL, world=2, nodes=1, elastic=None, port=29555) -> JobSpec:
    return JobSpec(
        name="demo", model="gpt-tiny", steps=10, engine=engine,
        world_size=world, nodes=nodes, ranks_per_node=world // nodes, master_port=port, elastic=elastic,
    )  # fmt: skip


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_local_is_torchrun_on_loopback_of_the_worker_with_one_thread_per_rank():
    cmd = build_command(job(world=4), RUN, python="py", gpus=False)
    assert cmd.argv[:3] == ["py", "-m", "pipectl.runtime.engines.loopback"]  # torchrun, its stores on 127.0.0.1
    assert option(cmd.argv, "--rdzv_endpoint") == "127.0.0.1:0" and option(cmd.argv, "--local_addr") == "127.0.0.1"
    assert option(cmd.argv, "--nproc_per_node") == "4"
    assert cmd.argv[-4:] == ["-m", "pipectl.runtime.worker", "--run-dir", "/runs/demo"]
    assert cmd.env == {
        "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONSAFEPATH": "1", "PIPECTL_MODEL_PATH": os.getcwd()
    }
    assert build_command(job(), RUN, python="py", gpus=True).env["DS_ACCELERATOR"] == "cuda"


def test_local_with_in_memory_recovery_runs_the_replicas_agent():
    recovering = job(world=4).model_copy(update={"recover_in_memory": True})
    cmd = build_command(recovering, RUN, python="py", gpus=False)
    assert cmd.argv == ["py", "-m", "pipectl.resize.replicas", "--run-dir", "/runs/demo"]
    assert cmd.env["OMP_NUM_THREADS"] == "1"
    alone = build_command(job(world=1).model_copy(update={"recover_in_memory": True}), RUN, python="py", gpus=False)
    assert "pipectl.runtime.engines.loopback" in alone.argv  # one rank: nothing to recover from


def test_local_refuses_several_nodes():
    with pytest.raises(UserInputError, match="one node"):
        build_command(job(world=4, nodes=2), RUN, python="py", gpus=False)


def test_static_torchrun_uses_c10d_rendezvous_on_the_master_port():
    cmd = build_command(job(Engine.TORCHRUN, world=4, nodes=2, port=29601), RUN, python="py", gpus=False)
    assert option(cmd.argv, "--nnodes") == "2"
    assert option(cmd.argv, "--nproc_per_node") == "2"
    assert option(cmd.argv, "--rdzv_backend") == "c10d"
    assert option(cmd.argv, "--rdzv_endpoint") == "127.0.0.1:29601"
    assert "--max_restarts" not in cmd.argv
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in cmd.env
    assert cmd.argv[:3] == ["py", "-m", "torch.distributed.run"]  # several nodes: the stores serve the network
    one_node = build_command(job(Engine.TORCHRUN, world=2, port=29601), RUN, python="py", gpus=False)
    assert one_node.argv[:3] == ["py", "-m", "pipectl.runtime.engines.loopback"]  # on loopback: listening there only
    assert option(one_node.argv, "--local_addr") == "127.0.0.1"


def test_elastic_torchrun_has_node_range_restarts_and_the_gloo_restart_fixes():
    elastic = ElasticRange(min_nodes=1, max_nodes=2, max_restarts=5)
    cmd = build_command(job(Engine.TORCHRUN, world=2, elastic=elastic), RUN, python="py", gpus=False)
    assert option(cmd.argv, "--nnodes") == "1:2"
    assert option(cmd.argv, "--max_restarts") == "5"
    assert option(cmd.argv, "--rdzv_conf") == "last_call_timeout=1"
    assert cmd.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_deepspeed_launcher_gets_hostfile_and_cpu_workarounds():
    cmd = build_command(job(Engine.DEEPSPEED, world=2, port=29700), RUN, python="py", gpus=False)
    assert cmd.argv[:3] == ["py", "-m", "deepspeed.launcher.runner"]
    assert option(cmd.argv, "--hostfile") == "/runs/demo/hostfile"
    assert option(cmd.argv, "--master_addr") == "127.0.0.1"
    assert option(cmd.argv, "--master_port") == "29700"
    assert "--no_ssh_check" in cmd.argv and "--no_local_rank" in cmd.argv
    assert option(cmd.argv, "--module") == "pipectl.runtime.worker"
    assert cmd.files["hostfile"] == "localhost slots=2\n"
    # Remote ranks get the rank environment through the launcher's .deepspeed_env.
    exported = dict(line.split("=", 1) for line in cmd.files[".deepspeed_env"].splitlines())
    assert exported == cmd.env and exported["OMP_NUM_THREADS"] == "1"
    two = build_command(job(Engine.DEEPSPEED, world=4, nodes=2), RUN, hosts=["n1", "n2"], python="py", gpus=False)
    assert two.files["hostfile"] == "n1 slots=2\nn2 slots=2\n"
    with pytest.raises(UserInputError, match="3 hosts"):
        build_command(job(Engine.DEEPSPEED, world=4, nodes=2), RUN, hosts=["a", "b", "c"], python="py", gpus=False)


def test_slurm_script_content():
    script = slurm_script(job(Engine.SLURM, world=8, nodes=2, port=29800), RUN, python="/venv/bin/python", gpus=True)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "#SBATCH --nodes=2" in lines
    assert "#SBATCH --ntasks-per-node=1" in lines
    assert "#SBATCH --gpus-per-node=4" in lines
    assert "#SBATCH --signal=B:USR1@120" in lines and "#SBATCH --requeue" in lines  # it requeues itself
    assert "#SBATCH --open-mode=append" in lines  # a requeued start's output follows the first's
    assert "export OMP_NUM_THREADS=1" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert srun.endswith(" &")  # in the background: the USR1 trap runs at once, not when srun ends
    srun = srun.removesuffix(" &")
    assert "/venv/bin/python -m torch.distributed.run" in srun
    assert '--nnodes "$SLURM_JOB_NUM_NODES"' in srun
    assert "--nproc_per_node 4" in srun
    assert '--rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"' in srun
    assert srun.endswith("-m pipectl.runtime.worker --run-dir /runs/demo")
    assert "MASTER_PORT=29800" in lines
    cpu = slurm_script(job(Engine.SLURM, world=2), RUN, python="py", gpus=False)
    assert "--gpus-per-node" not in cpu and "export DS_ACCELERATOR=cpu" in cpu
    cmd = build_command(job(Engine.SLURM, world=2), RUN, python="py", gpus=False)
    assert not cmd.runnable_here and "sbatch /runs/demo/job.sbatch" in cmd.submit_hint
    assert "job.sbatch" in cmd.files


def test_a_cpu_jobs_unset_partition_and_constraint_have_cpu_examples():
    lines = slurm_script(job(Engine.SLURM, world=4, nodes=2), RUN, python="py", gpus=False).splitlines()
    assert "##SBATCH --partition=cpu   # TODO unset (slurm.partition or launch --partition)" in lines
    assert not any("gpu" in line or "a100" in line for line in lines if line.startswith("##SBATCH"))


def test_a_slurm_script_that_does_not_requeue_says_so_in_its_header():
    from pipectl.artifacts.cluster import SlurmSpec

    script = slurm_script(job(Engine.SLURM, world=8, nodes=2), RUN, python="py", gpus=True, slurm=SlurmSpec(requeue_limit=0))
    lines = script.splitlines()
    assert "#SBATCH --no-requeue" in lines and not any("requeues itself" in line for line in lines)
    assert lines[2].startswith("# It checkpoints and stops 120 s before its time limit and does not requeue itself")


def test_elastic_slurm_script_allows_a_node_range():
    elastic = ElasticRange(min_nodes=2, max_nodes=4)
    script = slurm_script(job(Engine.SLURM, world=4, nodes=2, elastic=elastic), RUN, python="py", gpus=False)
    assert "#SBATCH --nodes=2-4" in script
    assert "--nnodes 2:4" in script and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script


def test_launch_script_is_the_exact_command_quoted(tmp_path):
    cmd = LaunchCommand(Engine.LOCAL, ["py", "-m", "x", "--run-dir", str(tmp_path / "a b")], {"OMP_NUM_THREADS": "1"})
    text = launch_script(cmd, tmp_path)
    assert "export OMP_NUM_THREADS=1" in text
    assert f"exec py -m x --run-dir '{tmp_path / 'a b'}' \"$@\"" in text


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_run_engine_logs_output_and_returns_exit_code(tmp_path):
    cmd = LaunchCommand(Engine.LOCAL, [sys.executable, "-c", "import os; print('hello', os.environ['X_TEST']); raise SystemExit(3)"], {"X_TEST": "42"})
    ticks = []
    assert run_engine(cmd, tmp_path, on_tick=lambda: ticks.append(1), tick_seconds=0.05) == 3
    assert "hello 42" in (tmp_path / "logs" / "engine.log").read_text()
    assert ticks  # the final tick at least


def test_run_engine_forwards_sigterm_to_the_job(tmp_path):
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
        "sys.exit(1)\n"
    )
    cmd = LaunchCommand(Engine.LOCAL, [sys.executable, "-c", script])
    log = tmp_path / "logs" / "engine.log"

    def send_term_when_ready() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (log.is_file() and "ready" in log.read_text()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_term_when_ready, daemon=True).start()
    started = time.monotonic()
    assert run_engine(cmd, tmp_path, tick_seconds=0.05) == 0
    assert time.monotonic() - started < 15
    assert "got TERM" in log.read_text()


def test_run_engine_stops_a_job_past_its_time_limit(tmp_path):
    cmd = LaunchCommand(Engine.LOCAL, [sys.executable, "-c", "import time; time.sleep(30)"])
    with pytest.raises(JobEnded, match="ran past its --timeout of 1 s"):  # ended as a stop: resume goes on
        run_engine(cmd, tmp_path, tick_seconds=0.05, timeout_seconds=1)


def test_slurm_is_not_run_by_pipectl(tmp_path):
    cmd = build_command(job(Engine.SLURM), tmp_path, python="py", gpus=False)
    with pytest.raises(LaunchError, match="sbatch"):
        run_engine(cmd, tmp_path)


def test_a_module_planted_in_the_run_directory_is_not_imported_by_a_rank(tmp_path):
    # Ranks start with `python -m` inside the run directory; without PYTHONSAFEPATH Python would put
    # that directory first on sys.path, and a planted module would shadow the real one.
    import subprocess
    import sys

    from pipectl.launch.engines import rank_environment

    (tmp_path / "platform.py").write_text("raise SystemExit('planted module ran')\n")
    env = {**os.environ, **rank_environment(gpus=False)}
    result = subprocess.run([sys.executable, "-m", "platform"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0 and "planted" not in result.stdout + result.stderr
    env.pop("PYTHONSAFEPATH")
    planted = subprocess.run([sys.executable, "-m", "platform"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "planted module ran" in planted.stderr  # the check can fail: without the variable it does


def test_gpu_ranks_get_expandable_segments_unless_the_user_set_an_allocator(monkeypatch, tmp_path):
    from pipectl.launch.engines import rank_environment

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert rank_environment(gpus=True)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_environment(gpus=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert rank_environment(gpus=True)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
