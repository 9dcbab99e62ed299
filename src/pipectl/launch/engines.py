"""The real command lines that start the ranks (`launch.supervise` runs them).

Every engine starts the same worker, `python -m pipectl.runtime.worker --run-dir RUN`, through a
real launcher (no home-made process manager):

- `local`: torchrun with `--nproc_per_node N` on this machine (the embedded default), its
  rendezvous and stores on 127.0.0.1 only (`runtime/engines/loopback.py`).
- `torchrun`: a c10d rendezvous on `master_addr:master_port`, static (`--nnodes N`) or elastic
  (`--nnodes MIN:MAX --max_restarts R`). Measured here (shared/DEEPSPEED-ON-CPU.md): restarted
  gloo workers read stale addresses from torchrun's shared rendezvous store unless
  `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (1 of 3 recoveries without, 4 of 4 with), and an elastic
  range waits the 30 s `last_call_timeout` at every rendezvous unless it is set to 1 s.
- `deepspeed`: DeepSpeed's launcher with a hostfile. On CPU it needs `--no_ssh_check` and an
  explicit `--master_addr` for `localhost slots=N`; `--no_local_rank` because the worker reads
  LOCAL_RANK from the environment. On several nodes its pdsh runner exports only a few variable
  families (PYTHON*, ...) to the remote ranks plus the `KEY=VALUE` lines of `.deepspeed_env` in
  its working directory (DeepSpeed's launcher/runner.py), so the rank environment is written
  there too (the run directory is the launcher's working directory).
- `slurm`: an sbatch script running `srun` + torchrun, one agent per node, that requeues itself
  (run under stand-ins of sbatch, srun and scontrol in tests/launch).

Commands are argument lists (no shell). `launch.sh` in the run directory is the same command,
quoted for a shell, so a run can be restarted by hand.

    >>> from pipectl.launch.engines import rank_environment
    >>> rank_environment(gpus=False)["OMP_NUM_THREADS"]
    '1'
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipectl.artifacts.cluster import SlurmSpec, slurm_time_seconds
from pipectl.artifacts.run import (
    HOSTFILE,
    LOGS_DIR,
    REQUEUE_FILE,
    SBATCH_FILE,
    SLURM_JOB_ID_FILE,
    Engine,
    JobSpec,
    NodeGroup,
    is_loopback_address,
)
from pipectl.errors import LaunchError, UserInputError
from pipectl.rundir.processes import WORKER_MODULE
from pipectl.paths import HF_PREFIX, MODEL_PATH_VARIABLE
from pipectl.rundir.checkpoints import STOP_FILE
from pipectl.runtime.engines.dsinit import cuda_available
from pipectl.words import count

ENGINE_LOG = "engine.log"
DEEPSPEED_ENV_FILE = ".deepspeed_env"  # read by DeepSpeed's multi-node launcher from its working directory
ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"  # GPU ranks' allocator unless the user sets one


@dataclass(frozen=True)
class LaunchCommand:
    """What to run (argv, extra environment) and the side files the engine needs."""

    engine: Engine
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # run-dir relative name -> content
    runnable_here: bool = True  # slurm: the script is submitted with sbatch, not run by pipectl
    submit_hint: str = ""

    def shell_line(self) -> str:
        """The command as one shell line (environment assignments first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join(self.argv)
        return f"{env} {cmd}" if env else cmd


def rank_environment(*, gpus: bool, import_root: str | None = None) -> dict[str, str]:
    """Variables every rank needs: one OpenMP thread (2 threads made 20 steps 5x slower on 2 cores),
    DeepSpeed's accelerator (cpu without a GPU, which silences its auto-detection warning), and the
    folder a user's `package.module:factory` model is imported from: the job's `import_root`, the
    folder the run was first launched from (ranks run inside the run directory, and a resume or a
    resize may be started from anywhere); this process's directory for a job without one. `PYTHONSAFEPATH` (Python 3.11+) keeps `python -m` from
    putting the working directory, the run directory, first on `sys.path`: a file planted there
    (a `torch.py`) is never imported.

    GPU ranks get PyTorch's expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`)
    unless the launching environment sets its own allocator configuration: a pipeline rank
    allocates activations of several sizes (micro-batches in flight, the head's fp32 logits, the
    optimizer's transient buffers), and fixed-size segments left the caching allocator holding
    far more than it handed out (1.83 B GPT on an H100: reserved 29.7 % above the predicted peak
    where allocated was 3.5 % above it); expandable segments grow one mapping instead (PyTorch's
    CUDA memory notes, "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF").
    """
    env = {"OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1", MODEL_PATH_VARIABLE: import_root or os.getcwd()}
    if gpus:
        env[ALLOCATOR_VARIABLE] = os.environ.get(ALLOCATOR_VARIABLE, EXPANDABLE_SEGMENTS)
    # Named either way: sbatch hands the job the submitting shell's environment (--export=ALL, its
    # default), and a login node without GPUs may well have DS_ACCELERATOR=cpu set, which would put
    # DeepSpeed on its CPU accelerator on the GPU nodes.
    env["DS_ACCELERATOR"] = "cuda" if gpus else "cpu"
    return env


def _worker_args(run_dir: Path) -> list[str]:
    return ["-m", WORKER_MODULE, "--run-dir", str(run_dir)]


REQUEUE_MODULE = "pipectl.launch.requeue"  # the batch script's last step: requeue the job or not
REPLICAS_MODULE = "pipectl.resize.replicas"  # one torchrun per replica (`launch --recover-in-memory`)


def local_command(job: JobSpec, run_dir: Path, *, python: str = sys.executable, gpus: bool = False) -> LaunchCommand:
    """torchrun `--nproc_per_node N -m pipectl.runtime.worker --run-dir RUN` on loopback
    (`standalone_torchrun`). A job that recovers a lost replica in memory runs
    `python -m pipectl.resize.replicas --run-dir RUN` instead: one such torchrun per replica.
    """
    if job.recover_in_memory and job.world_size > 1:
        argv = [python, "-m", REPLICAS_MODULE, "--run-dir", str(run_dir)]
    else:
        argv = standalone_torchrun(python, job.world_size, run_dir)
    return LaunchCommand(Engine.LOCAL, argv, rank_environment(gpus=gpus, import_root=job.import_root))


LOOPBACK_TORCHRUN = "pipectl.runtime.engines.loopback"  # torchrun with its stores on 127.0.0.1 (`runtime/engines/loopback.py`)


def standalone_torchrun(python: str, ranks: int, run_dir: Path) -> list[str]:
    """torchrun on this machine alone, starting `ranks` workers of the run (the local engine's
    command, and each replica's under the replicas agent): a c10d rendezvous on a free port of
    127.0.0.1 (so concurrent local jobs never collide), this node's address 127.0.0.1, and every
    store bound to loopback (`runtime.engines.loopback`: torchrun's own binds every interface)."""
    return [
        python, "-m", LOOPBACK_TORCHRUN,
        "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "127.0.0.1:0",
        "--rdzv_id", run_dir.name or "local",
        "--local_addr", "127.0.0.1",
        "--nnodes", "1",
        "--nproc_per_node", str(ranks),
        *_worker_args(run_dir),
    ]  # fmt: skip


def torchrun_command(
    job: JobSpec, run_dir: Path, *, python: str = sys.executable, gpus: bool = False
) -> LaunchCommand:
    """torchrun with a c10d rendezvous: static `--nnodes N` or elastic `--nnodes MIN:MAX`.

    Run the same command on every node (each is one agent with `ranks_per_node` workers). A
    rendezvous on a loopback address (one node) keeps every store on 127.0.0.1, as the local
    engine does (`runtime.engines.loopback`).
    """
    env = rank_environment(gpus=gpus, import_root=job.import_root)
    one_node = job.nodes == 1 and (job.elastic is None or job.elastic.max_nodes == 1)
    if one_node and is_loopback_address(job.master_addr):
        argv = [python, "-m", LOOPBACK_TORCHRUN, "--local_addr", "127.0.0.1"]
    else:
        argv = [python, "-m", "torch.distributed.run"]
    if job.elastic is not None:
        argv += [
            "--nnodes", f"{job.elastic.min_nodes}:{job.elastic.max_nodes}",
            "--max_restarts", str(job.elastic.max_restarts),
            # Without it every rendezvous with a node range waits the 30 s default.
            "--rdzv_conf", "last_call_timeout=1",
        ]  # fmt: skip
        # Restarted gloo workers otherwise read stale addresses from the shared store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        argv += ["--nnodes", str(job.nodes)]
    argv += [
        "--nproc_per_node", str(job.ranks_per_node),
        "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f"{job.master_addr}:{job.master_port}",
        "--rdzv_id", job.name,
        *_worker_args(run_dir),
    ]  # fmt: skip
    return LaunchCommand(Engine.TORCHRUN, argv, env)


def hostfile_text(hosts: list[str], slots: int, groups: list[NodeGroup] = ()) -> str:
    """DeepSpeed hostfile: one `host slots=N` line per node. DeepSpeed's launcher numbers ranks in
    the file's order, so a split plan's node groups (`job.node_groups`) follow one another, each
    under a comment naming the node type its hosts must be.

    >>> hostfile_text(["localhost"], 2)
    'localhost slots=2\\n'
    """
    if not groups:
        return "".join(f"{host} slots={slots}\n" for host in hosts)
    lines, start = [], 0
    for group in groups:
        lines.append(f"# {count(group.nodes, group.node_type + ' node')} ({group.device}): {group.replica_words()}")
        lines += [f"{host} slots={slots}" for host in hosts[start : start + group.nodes]]
        start += group.nodes
    return "\n".join(lines) + "\n"


def allocation_hosts() -> list[str]:
    """The hosts of the Slurm allocation this process runs in, in Slurm's order; [] outside one."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    return done.stdout.split() if done.returncode == 0 else []


def deepspeed_command(
    job: JobSpec,
    run_dir: Path,
    *,
    hosts: list[str] | None = None,
    python: str = sys.executable,
    gpus: bool = False,
) -> LaunchCommand:
    """DeepSpeed's launcher over a hostfile of `hosts` (`launch.node_hosts`; `localhost` for
    one node)."""
    hosts = hosts or (["localhost"] if job.nodes == 1 else [])
    if not hosts:
        raise UserInputError(
            f"DeepSpeed's launcher needs the names of the job's {count(job.nodes, 'node')}",
            hint="pass --hosts h1,h2,... or launch inside a Slurm allocation (salloc), where they are read from it",
        )
    if len(hosts) != job.nodes:
        raise UserInputError(f"{count(len(hosts), 'host')} given ({', '.join(hosts)}) for a job on {count(job.nodes, 'node')}")
    if job.nodes > 1:
        check_pdsh_words(run_dir, python)
    argv = [
        python, "-m", "deepspeed.launcher.runner",
        "--hostfile", str(run_dir / HOSTFILE),
        "--no_ssh_check",
        "--master_addr", job.master_addr,
        "--master_port", str(job.master_port),
        "--no_local_rank",
        "--module", WORKER_MODULE,
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = rank_environment(gpus=gpus, import_root=job.import_root)
    return LaunchCommand(
        Engine.DEEPSPEED,
        argv,
        env,
        files={
            HOSTFILE: hostfile_text(hosts, job.ranks_per_node, job.node_groups),
            DEEPSPEED_ENV_FILE: "".join(f"{key}={value}\n" for key, value in sorted(env.items())),
        },
    )


# What DeepSpeed's pdsh runner writes into the line each node's shell runs without quoting it (the
# folder it runs in, after `cd`, and the Python): anything but these characters breaks that line
# there. Its own quoting of exported values uses the same set (`MultiNodeRunner.add_export`).
_PDSH_SAFE = re.compile(r"[\w@%+=:,./-]+")


def check_pdsh_words(run_dir: Path, python: str) -> None:
    """A multi-node DeepSpeed launch runs `cd RUN_DIR; PYTHON -u -m deepspeed.launcher.launch ...`
    on every node through pdsh, unquoted (`PDSHRunner.get_cmd`): a blank or a shell character in
    either is refused here, before anything is written, not found in a node's shell."""
    for name, value in (("--run-dir", str(Path(run_dir).resolve())), ("the Python", python)):
        if not _PDSH_SAFE.fullmatch(value):
            raise UserInputError(
                f"{name} {value}: DeepSpeed's multi-node launcher (pdsh) runs it on each node unquoted, and it holds "
                "a blank or a shell character",
                hint="use a path of letters, digits and ._-/ only, or launch with --engine torchrun or slurm",
            )


def slurm_script(
    job: JobSpec,
    run_dir: Path,
    *,
    python: str = sys.executable,
    gpus: bool = False,
    slurm: SlurmSpec | None = None,
    components: list[SlurmSpec] | None = None,
) -> str:
    """An sbatch script a Slurm user submits unedited: one torchrun agent per node via srun, c10d
    rendezvous on the allocation's first node, the cluster file's set-up and environment, and a
    job that requeues itself.

    The allocation follows from the job: `--nodes` (a range for elastic jobs), one task per node
    (the torchrun agent) with `--cpus-per-task` = ranks per node x cores per rank, and
    `--gpus-per-node` = ranks per node when the plan's devices are GPUs. Partition, account, time
    limit, QoS, constraint, reservation, container, set-up lines, environment, network interface
    and the compute nodes' Python come from `slurm` (the cluster file's `slurm:` section, the
    config file's `[slurm]`, launch's flags); each one unset that a site usually needs is a line
    marked `TODO` saying where it would go.

    Time limits and pre-emption (`launch/requeue.py`): `--signal=B:USR1@S` tells the batch shell
    S seconds before the time limit; its trap writes the run's stop file, so every rank stops at
    the same step boundary after a checkpoint (the stop the ranks already agree on at each step,
    `runtime.checkpoint.ranks.step_boundary`). Signalling torchrun instead makes it end its workers 30 s
    later whatever they are doing. srun runs in the background so that the trap runs at once
    (bash runs a trap only between commands). When srun has ended, `pipectl.launch.requeue`
    decides from the run itself: trained to the end, done; stopped or failed with progress since
    the last requeue, `scontrol requeue` (`--requeue` makes the job requeueable; `--open-mode=append`
    keeps the earlier starts' output). A pre-emption under `PreemptMode=REQUEUE` is Slurm's own
    requeue; the ranks' SIGTERM handler checkpoints within Slurm's grace time if it can. Either
    way the requeued script starts the same ranks, which resume from the newest checkpoint that
    loads.

    A plan split over device kinds (`job.node_groups`) becomes a heterogeneous job: one component
    per node group, in rank order, each with its node type's partition and constraint
    (`components`), one `srun --het-group=0,1,...` over all of them. Slurm numbers the tasks of
    such a step component by component, and each agent passes its task number to a static
    rendezvous as its node rank, so the first component's nodes run the first ranks
    (`launch.placement`). c10d's rendezvous would number the nodes by host name instead.
    """
    slurm = slurm or SlurmSpec()
    # Inside a container the login node's venv is not there: its own `python`, as after set-up lines.
    python = slurm.python or ("python" if slurm.setup or slurm.container_image else python)
    groups = job.node_groups
    if any(c.isspace() for c in str(run_dir)):
        raise UserInputError(
            f"the run directory {str(run_dir)!r} holds a blank, which #SBATCH lines cannot quote",
            hint="give the Slurm run a directory without spaces",
        )
    cpus_per_rank = slurm.cpus_per_rank or (8 if gpus else 1)
    cpus_per_task = job.ranks_per_node * cpus_per_rank
    signal_seconds = slurm.signal_seconds or SlurmSpec.DEFAULT_SIGNAL_SECONDS
    for spec in [slurm, *(components or [])]:
        _check_signal_before_time_limit(spec.time, signal_seconds)
    requeue_limit = SlurmSpec.DEFAULT_REQUEUE_LIMIT if slurm.requeue_limit is None else slurm.requeue_limit

    def sbatch(option: str, value: str | None, example: str, flag: str = "") -> str:
        if value:
            return f"#SBATCH --{option}={value}"
        where = f"slurm.{option.replace('-', '_')}" + (f" or launch {flag}" if flag else "")
        return f"##SBATCH --{option}={example}   # TODO unset ({where})"

    def resources(nodes: str, spec: SlurmSpec) -> list[str]:
        return [
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --cpus-per-task={cpus_per_task}",
            *([f"#SBATCH --gpus-per-node={job.ranks_per_node}"] if gpus else []),
            sbatch("partition", spec.partition, "gpu" if gpus else "cpu", "--partition"),
            sbatch("account", spec.account, "my-project", "--account"),
            sbatch("time", spec.time, "2-00:00:00", "--time-limit"),
            sbatch("qos", spec.qos, "normal"),
            sbatch("constraint", spec.constraint, "a100" if gpus else "skylake"),
            *([f"#SBATCH --reservation={spec.reservation}"] if spec.reservation else []),
            "#SBATCH --exclusive",
        ]  # fmt: skip

    env = _slurm_rank_environment(job, slurm, gpus)
    # Slurm 22.05 and later no longer pass sbatch's --cpus-per-task on to srun: say it again there.
    srun = ["srun", "--kill-on-bad-exit=1", f"--cpus-per-task={cpus_per_task}"]
    container = _container_options(slurm, run_dir)
    srun += container
    first_nodes = "$SLURM_JOB_NODELIST"
    if groups:
        if components is None or len(components) != len(groups):
            raise ValueError(f"{len(groups)} node groups need as many Slurm components, got {components!r}")
        allocation = []
        for index, (group, spec) in enumerate(zip(groups, components)):
            if index:
                allocation.append("#SBATCH hetjob")
            allocation.append(
                f"# component {index}: {count(group.nodes, group.node_type + ' node')} ({group.device}): {group.replica_words()}"
            )
            allocation += resources(str(group.nodes), spec)
        first_nodes = "$SLURM_JOB_NODELIST_HET_GROUP_0"
        srun.insert(1, "--het-group=" + ",".join(map(str, range(len(groups)))))
        torchrun = _static_rendezvous_agents(job, run_dir, python, srun)
    else:
        nodes = f"{job.elastic.min_nodes}-{job.elastic.max_nodes}" if job.elastic else str(job.nodes)
        allocation = resources(nodes, slurm)
        torchrun = _c10d_rendezvous_agents(job, run_dir, python, srun)
    # `sed -n 1p` reads every name: `head -n 1` may close the pipe while scontrol still writes,
    # and under pipefail scontrol's SIGPIPE would end the script.
    master = (
        f"MASTER_ADDR={shlex.quote(job.master_addr)}"
        if job.master_addr
        else f'MASTER_ADDR="$(scontrol show hostnames "{first_nodes}" | sed -n 1p)"'
    )
    setup = _slurm_setup(slurm, python)
    # The decision runs where the ranks' Python is: inside the container when there is one.
    decide = shlex.join([*(["srun", "--nodes=1", "--ntasks=1", *container] if container else []),
                         python, "-m", REQUEUE_MODULE, "--run-dir", str(run_dir), "--limit", str(requeue_limit)])  # fmt: skip
    stop_file = shlex.quote(str(run_dir / STOP_FILE))
    lines = [
        *_slurm_header(job, run_dir, gpus, signal_seconds, requeue_limit, slurm),
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --output={run_dir / LOGS_DIR}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        # The job's own options before the first component: a heterogeneous job's batch shell runs
        # in component 0, and Slurm carries options to the components after, never before.
        *(["#SBATCH --requeue"] if requeue_limit else ["#SBATCH --no-requeue"]),
        f"#SBATCH --signal=B:USR1@{signal_seconds}",
        *allocation,
        "set -euo pipefail",
        *setup,
        "# The ranks' environment",
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
        master,
        f"MASTER_PORT={job.master_port}",
        # Exported apart from the assignment, so that a failing scontrol stops the script (set -e).
        *(["export MASTER_ADDR MASTER_PORT"] if groups else []),
        f'echo "$SLURM_JOB_ID" > {shlex.quote(str(run_dir / SLURM_JOB_ID_FILE))}',
        f"rm -f {stop_file}  # a stop asked of an earlier start is not this one's",
        f"trap 'echo \"time limit in {signal_seconds} s (Slurm USR1)\" > {stop_file}' USR1",
        f"{torchrun} &",
        'ranks=$! status=0',
        'wait "$ranks" || status=$?',
        'while kill -0 "$ranks" 2>/dev/null; do status=0; wait "$ranks" || status=$?; done  # a trap cut the wait short',
        f'decision="$({decide} --exit-code "$status")" || decision=stop',
        'if [ "$decision" = requeue ]; then scontrol requeue "$SLURM_JOB_ID"; exit 0; fi',
        'if [ "$decision" = finished ]; then exit 0; fi',
        'exit $(( status ? status : 1 ))',
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _check_signal_before_time_limit(time: str | None, signal_seconds: int) -> None:
    """Refuse a signal lead time not shorter than the time limit: Slurm would signal the job as it
    starts or never (the limit comes first), and the ranks would stop at once or be killed without
    a checkpoint. The value is checked here, where the cluster file and launch's flags have met."""
    limit = slurm_time_seconds(time) if time else None
    if limit is not None and signal_seconds >= limit:
        raise UserInputError(
            f"the Slurm time limit {time} ({limit} s; Slurm counts whole minutes) is not longer than the signal lead "
            f"time {signal_seconds} s (slurm.signal_seconds, default {SlurmSpec.DEFAULT_SIGNAL_SECONDS})",
            hint=f"give a time limit longer than {signal_seconds} s (launch --time-limit, slurm.time) or a shorter "
            "slurm.signal_seconds",
        )


def _slurm_rank_environment(job: JobSpec, slurm: SlurmSpec, gpus: bool) -> dict[str, str]:
    """The environment the batch script exports to the ranks: pipectl's, the cluster file's network
    interface, then the cluster file's own variables."""
    env = rank_environment(gpus=gpus, import_root=job.import_root)
    if slurm.network_interface:
        env.update(NCCL_SOCKET_IFNAME=slurm.network_interface, GLOO_SOCKET_IFNAME=slurm.network_interface)
    if job.elastic:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(slurm.env or {})  # the user's word wins
    return env


def unmounted_files(job: JobSpec, slurm: SlurmSpec, run_dir: Path) -> list[str]:
    """The job's model and data files a container would not see: outside the run directory and
    every host side of `container_mounts`; [] without a container."""
    if not slurm.container_image:
        return []
    mounted = [run_dir, *(Path(mount.split(":", 1)[0]) for mount in slurm.container_mounts or [])]
    files = [job.model.removeprefix(HF_PREFIX) if Path(job.model.removeprefix(HF_PREFIX)).is_absolute() else None,
             job.data.path]
    return [f for f in files if f and not any(Path(f).is_relative_to(folder) for folder in mounted)]


def _container_options(slurm: SlurmSpec, run_dir: Path) -> list[str]:
    """srun's options that run a step in the cluster file's container, the run directory mounted; [] without one."""
    if not slurm.container_image:
        return []
    mounts = ",".join([f"{run_dir}:{run_dir}", *(slurm.container_mounts or [])])
    return [f"--container-image={slurm.container_image}", f"--container-mounts={mounts}"]


def _static_rendezvous_agents(job: JobSpec, run_dir: Path, python: str, srun: list[str]) -> str:
    """A heterogeneous job's step: one torchrun agent per node, its node rank the task number Slurm
    gives it (component by component), so the first component's nodes run the first ranks."""
    agent = shlex.join([python, "-m", "torch.distributed.run"]) + (
        f" --nnodes {job.nodes} --nproc_per_node {job.ranks_per_node} --rdzv_backend static"
        ' --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --node_rank "$SLURM_PROCID" '
        + shlex.join(_worker_args(run_dir))
    )
    # Each task expands its own $SLURM_PROCID: the command goes through a shell on the node.
    return shlex.join([*srun, "bash", "-c", "exec " + agent])


def _c10d_rendezvous_agents(job: JobSpec, run_dir: Path, python: str, srun: list[str]) -> str:
    """The step of a job on one kind of node: one torchrun agent per node meeting at a c10d
    rendezvous, over a range of node counts when the job is elastic."""
    nnodes = f"{job.elastic.min_nodes}:{job.elastic.max_nodes}" if job.elastic else '"$SLURM_JOB_NUM_NODES"'
    return (
        shlex.join([*srun, python, "-m", "torch.distributed.run"])
        + f" --nnodes {nnodes}"
        + (f" --max_restarts {job.elastic.max_restarts} --rdzv_conf last_call_timeout=1" if job.elastic else "")
        + f" --nproc_per_node {job.ranks_per_node}"
        + ' --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID"'
        + " " + shlex.join(_worker_args(run_dir))
    )  # fmt: skip


def _slurm_setup(slurm: SlurmSpec, python: str) -> list[str]:
    """The script's set-up lines (module loads, an activation), or a TODO naming the Python the nodes run."""
    if slurm.setup:
        # Environment modules and conda's activation read variables they never set.
        return ["# Set-up (the cluster file's slurm.setup)", "set +u", *slurm.setup, "set -u"]
    return [f"# TODO set-up unset (slurm.setup: module loads, a venv or conda activation): the nodes run {python}"]


def _slurm_header(
    job: JobSpec, run_dir: Path, gpus: bool, signal_seconds: int, requeue_limit: int, slurm: SlurmSpec
) -> list[str]:
    """The script's first lines: what it runs, how to submit it, and what it does at its time limit."""
    log = run_dir / LOGS_DIR / REQUEUE_FILE
    ranks = count(job.ranks_per_node, "GPU rank" if gpus else "CPU rank")
    return [
        "#!/bin/bash",
        f"# Written by pipectl launch for run {job.name}: {count(job.world_size, 'rank')}, {count(job.nodes, 'node')} x "
        f"{ranks}, {job.precision.value}. Submit: sbatch {run_dir / SBATCH_FILE}",
        f"# It requeues itself {signal_seconds} s before its time limit and after a failure "
        f"(at most {count(requeue_limit, 'time')} in a row without a newer checkpoint): {log}"
        if requeue_limit
        else f"# It checkpoints and stops {signal_seconds} s before its time limit and does not requeue itself "
        f"(slurm requeue_limit 0): {log}",
        *(f"# TODO {path} is outside the container's mounts (the run directory, slurm.container_mounts): "
          "mount its folder" for path in unmounted_files(job, slurm, run_dir)),
    ]


def slurm_command(
    job: JobSpec,
    run_dir: Path,
    *,
    python: str = sys.executable,
    gpus: bool = False,
    slurm: SlurmSpec | None = None,
    components: list[SlurmSpec] | None = None,
) -> LaunchCommand:
    script = slurm_script(job, run_dir, python=python, gpus=gpus, slurm=slurm, components=components)
    return LaunchCommand(
        Engine.SLURM,
        ["sbatch", str(run_dir / SBATCH_FILE)],
        files={SBATCH_FILE: script},
        runnable_here=False,
        submit_hint=f"submit it with: sbatch {run_dir / SBATCH_FILE}",
    )


def submit_slurm(run_dir: Path) -> str:
    """`sbatch RUN/job.sbatch` (from the run directory); the id Slurm gave the job."""
    script = Path(run_dir) / SBATCH_FILE
    try:
        done = subprocess.run(["sbatch", str(script)], cwd=run_dir, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise LaunchError("sbatch is not on this host's PATH", hint=f"submit it where Slurm's commands are: sbatch {script}") from None
    words = done.stdout.split()
    if done.returncode != 0 or not words or not words[-1].isdigit():
        raise LaunchError(f"sbatch {script} failed: {(done.stderr or done.stdout).strip()[:400]}")
    return words[-1]  # "Submitted batch job 4242"


def slurm_queue_state(job_name: str) -> tuple[str, str] | None:
    """(job id, state) of this user's newest job named `job_name` that Slurm still holds (pending,
    configuring, running, requeued, ...), as `squeue` reports it; None when there is none, or no
    squeue on this host (then nothing can be said about a queue)."""
    import getpass

    try:
        done = subprocess.run(
            ["squeue", "--noheader", "--user", getpass.getuser(), "--name", job_name, "--format", "%i %T"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    jobs: dict[int, tuple[str, str]] = {}  # by the job's number (an array task's id is NUMBER_TASK)
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        words = line.split()
        if len(words) == 2 and words[0].split("_")[0].isdigit():
            jobs.setdefault(int(words[0].split("_")[0]), (words[0], words[1]))
    return jobs[max(jobs)] if jobs else None


def build_command(
    job: JobSpec,
    run_dir: Path,
    *,
    hosts: list[str] | None = None,
    python: str = sys.executable,
    gpus: bool | None = None,
    slurm: SlurmSpec | None = None,
    components: list[SlurmSpec] | None = None,
) -> LaunchCommand:
    """The command for `job.engine`. `run_dir` should be absolute (ranks may start elsewhere).

    GPUs or CPU ranks follow the plan's device (`job.accelerator`), never the host that launches:
    a script written on a CPU login node is for the GPU nodes. Files without the field fall back
    to what this host has.
    """
    if gpus is None:
        gpus = job.accelerator == "cuda" if job.accelerator is not None else cuda_available()
    run_dir = Path(run_dir).resolve()
    if job.engine is Engine.LOCAL:
        if job.nodes != 1 or job.elastic is not None:
            raise UserInputError(
                f"the local engine runs one node; this job wants {count(job.nodes, 'node')}"
                + (" (elastic)" if job.elastic else ""),
                hint="use --engine torchrun for elastic or multi-node jobs",
            )
        return local_command(job, run_dir, python=python, gpus=gpus)
    if job.engine is Engine.TORCHRUN:
        return torchrun_command(job, run_dir, python=python, gpus=gpus)
    if job.engine is Engine.DEEPSPEED:
        return deepspeed_command(job, run_dir, hosts=hosts, python=python, gpus=gpus)
    return slurm_command(job, run_dir, python=python, gpus=gpus, slurm=slurm, components=components)


def launch_script(command: LaunchCommand, run_dir: Path) -> str:
    """launch.sh: the exact command, runnable from any directory."""
    lines = ["#!/usr/bin/env bash", "# Written by pipectl launch: the exact command that starts this run.", "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(command.env.items())]
    if command.submit_hint:
        lines.append(f"# {command.submit_hint}")
    lines.append(f"cd {shlex.quote(str(Path(run_dir).resolve()))}")
    lines.append(f'exec {shlex.join(command.argv)} "$@"')
    return "\n".join(lines) + "\n"
