"""The run directory's artifacts: job.json (`JobSpec`), metrics.jsonl lines (`StepMetrics`) and the
per-checkpoint manifest.json (`CheckpointManifest`).

A run directory `runs/NAME/` holds everything one training job needs and produces:

    plan.json          copy of the plan (the worker cuts the model at `chosen.stage_layers`)
    job.json           JobSpec: what to train, for how long, where to checkpoint, which engine
    ds_config.json     the DeepSpeed config, validated by DeepSpeed's parser before launch
    launch.sh          the exact command that was (or would be) run
    hostfile           deepspeed engine only;  job.sbatch: slurm engine only
    metrics.jsonl      one StepMetrics line per optimizer step (rank 0 writes it)
    checkpoints/       TAG/ (a safetensors file per rank + manifest.json, written last), latest
    schedule_rank{R}.txt  the compute order rank R executed
    logs/              engine and per-rank output; failure-rank{R}.json (`RankFailure`) when rank R
                       failed (the traceback itself stays in the engine log); resume.json
                       (`ResumeRecord`): the step the ranks started from and the checkpoints skipped;
                       heartbeat-rank{R}.json (`RankHeartbeat`): rank R's liveness, every second
"""

from __future__ import annotations

import ipaddress
import os
import re
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipectl.artifacts.base import Artifact, Sha256, Strict
from pipectl.artifacts.layout import Layout, LayoutLabel
from pipectl.artifacts.profile import HostState

JOB_FILE = "job.json"
PLAN_FILE = "plan.json"
DS_CONFIG_FILE = "ds_config.json"
LAUNCH_SCRIPT = "launch.sh"
HOSTFILE = "hostfile"
SBATCH_FILE = "job.sbatch"
SLURM_JOB_ID_FILE = "slurm_job_id"  # written by job.sbatch when it starts: what resize may scancel
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
MANIFEST_FILE = "manifest.json"
RANK_FILE = re.compile(r"rank-(\d{5})\.safetensors")  # one per rank in a checkpoint folder


def rank_file_name(rank: int) -> str:
    """`rank-00003.safetensors`: names sort in rank order."""
    return f"rank-{rank:05d}.safetensors"


FAILURE_FILE = "failure-rank{rank}.json"  # in LOGS_DIR
RESUME_FILE = "resume.json"  # in LOGS_DIR
PREVIOUS_RESUME_FILE = "resume-previous.json"  # in LOGS_DIR: the record of the start before, kept by the next
HEARTBEAT_FILE = "heartbeat-rank{rank}.json"  # in LOGS_DIR
# In LOGS_DIR: one line per spell when metrics.jsonl could not be written (`WriteRefusal`), added
# once the disk takes lines again; `pipectl launch` names it on the terminal.
REFUSALS_FILE = "refused-writes.jsonl"
# In LOGS_DIR: each step's per-rank timings and memory (`RankDetail`), apart from metrics.jsonl so
# that a step's line stays the same size at any world size; `read_metrics` joins them back.
RANKS_FILE = "ranks.jsonl"
# In LOGS_DIR: one line per end of a Slurm batch script, what it decided (`RequeueRecord`).
REQUEUE_FILE = "requeues.jsonl"
LOCK_FILE = "job.lock"  # the pids of the launch that holds the run (`rundir.lock.lock_run_dir`)
# What `launch` writes at a run directory's top and the run reads back (its profile copies and
# per-rank schedules by pattern): no other command's output may replace them.
RUN_OWN_FILES = frozenset({JOB_FILE, PLAN_FILE, DS_CONFIG_FILE, LAUNCH_SCRIPT, HOSTFILE, SBATCH_FILE,
                           SLURM_JOB_ID_FILE, METRICS_FILE, LOCK_FILE})
RUN_OWN_PATTERN = re.compile(r"profile-[0-9a-f]{12}\.json|schedule_rank\d+\.txt")


def is_run_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is one of a run directory's own files: at its top (beside a job.json) by
    name, or anywhere in a folder below it (checkpoints/, logs/, a run nested in a run)."""
    path = Path(path).absolute()
    own = path.name in RUN_OWN_FILES or RUN_OWN_PATTERN.fullmatch(path.name) is not None
    try:
        return (own and (path.parent / JOB_FILE).is_file()) or run_holding(path.parent) is not None
    except OSError:
        return False


def run_holding(folder: str | os.PathLike[str]) -> Path | None:
    """The run directory `folder` lies inside (not `folder` itself: an ancestor holding a job.json), or None.
    Walked up from the path as given (a `..` after a link leads where the link's target does), and
    returned without the `..` it passed (`cfg/../qs/runs/mine` is named `qs/runs/mine`)."""
    above = next((above for above in Path(folder).absolute().parents if (above / JOB_FILE).is_file()), None)
    return None if above is None else Path(os.path.normpath(above))


class Engine(str, Enum):
    """How the ranks are started."""

    LOCAL = "local"  # torchrun --standalone on this machine (the embedded default)
    TORCHRUN = "torchrun"  # torchrun with a c10d rendezvous, static or elastic
    DEEPSPEED = "deepspeed"  # DeepSpeed's launcher with a hostfile (multi-node)
    SLURM = "slurm"  # an sbatch script running srun torchrun


class Precision(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"  # with dynamic loss scaling: devices without bf16 (V100, P100)


class LrSchedule(str, Enum):
    """The learning-rate schedule (DeepSpeed's own schedulers, stepped once per optimizer step)."""

    CONSTANT = "constant"  # no scheduler; with warmup_steps: DeepSpeed's WarmupLR
    WARMUP_DECAY = "warmup-decay"  # WarmupDecayLR: linear warm-up, then linear decay to 0 at the last step
    WARMUP_COSINE = "warmup-cosine"  # WarmupCosineLR: linear warm-up, then cosine decay to min_lr_ratio


class TrainingSettings(Strict):
    """The optimizer (AdamW), its learning-rate schedule and gradient clipping: the user's
    hyper-parameters, kept in job.json so that every resume and resize writes the same DeepSpeed
    sections (ds_config.json is derived from the plan and these)."""

    learning_rate: float = Field(default=1e-3, gt=0, le=10, description="AdamW's peak learning rate.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW's betas.")
    eps: float = Field(default=1e-8, gt=0, le=1, description="AdamW's epsilon.")
    weight_decay: float = Field(default=0.0, ge=0, le=10, description="AdamW's decoupled weight decay.")
    gradient_clipping: float = Field(default=1.0, ge=0, le=1e6, description="Global gradient-norm clip; 0: none.")
    lr_schedule: LrSchedule = LrSchedule.CONSTANT
    warmup_steps: int = Field(default=0, ge=0, le=2**31, description="Steps of linear warm-up from 0 to the learning rate.")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="warmup-cosine: the floor, as a fraction of the peak.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {list(betas)}")
        return betas


class DataKind(str, Enum):
    BUILTIN = "builtin"  # a corpus that ships with pipectl (no download)
    SYNTHETIC = "synthetic"  # random tokens/features from the model's `make_batch` (benchmarks)
    FILE = "file"  # the user's token or text file (`--data PATH`)
    DATASET = "dataset"  # the user's dataset function (`--data package.module:function`): code


# A host name: RFC 1123 labels. `JobSpec.master_addr` takes one, an IPv4 or IPv6 address, or ''
# (Slurm's first node).
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")

def is_loopback_address(host: str) -> bool:
    """'localhost', 127.0.0.0/8 or ::1: an address only this machine reaches.

    >>> is_loopback_address("127.1.2.3"), is_loopback_address("node7")
    (True, False)
    """
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host_address(value: str) -> str:
    """A host name, an IPv4 or IPv6 address, or '' (Slurm's first node); else ValueError."""
    if value and not HOST_NAME.fullmatch(value):
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a host name or an IP address") from None
    return value


# Generators are seeded with seed x SEED_STRIDE + a sample or step index (`runtime/data.py`,
# `runtime/engines/torch_pipeline.py`): with indices below 2^40 that must fit a signed 64-bit integer.
SEED_STRIDE = 1_000_003
MAX_SEED = (2**63 - 2**40) // SEED_STRIDE


class DataSpec(Strict):
    """Where the training samples come from. The samples of step s depend on (seed, s, B) only."""

    kind: DataKind = Field(default=DataKind.BUILTIN, description="builtin corpus, synthetic, a file, or a dataset.")
    path: str | None = Field(default=None, description="Absolute path of the token or text file (kind=file).")
    reference: str | None = Field(
        default=None, description="The dataset function, package.module:function (kind=dataset): code that ranks import."
    )

    @model_validator(mode="after")
    def _path_iff_file(self) -> "DataSpec":
        if (self.kind is DataKind.FILE) != (self.path is not None):
            raise ValueError(f"data kind {self.kind.value!r} {'needs' if self.path is None else 'takes no'} path")
        if (self.kind is DataKind.DATASET) != (self.reference is not None):
            raise ValueError(f"data kind {self.kind.value!r} {'needs' if self.reference is None else 'takes no'} reference")
        return self

    def source(self) -> str | None:
        """What `runtime.data.make_source` takes: None (builtin: the byte corpus for a language
        model, synthetic batches for another), 'synthetic', 'dataset:REF' or the path."""
        if self.kind is DataKind.DATASET:
            return f"dataset:{self.reference}"
        return {DataKind.BUILTIN: None, DataKind.SYNTHETIC: "synthetic"}.get(self.kind, self.path)


class ElasticRange(Strict):
    """torchrun elastic membership: between `min_nodes` and `max_nodes` agents of `ranks_per_node`."""

    min_nodes: int = Field(gt=0)
    max_nodes: int = Field(gt=0)
    max_restarts: int = Field(default=3, ge=0, description="Group restarts torchrun allows.")

    @model_validator(mode="after")
    def _ordered(self) -> "ElasticRange":
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"elastic range {self.min_nodes}:{self.max_nodes} has MIN > MAX")
        return self


class NodeGroup(Strict):
    """Consecutive nodes of one type running consecutive replicas: a plan split over device kinds
    is launched as one group per kind, in replica (and so rank) order."""

    node_type: str = Field(description="The cluster file's node type the group's nodes are.")
    device: str = Field(description="The device kind the plan put the group's replicas on.")
    nodes: int = Field(gt=0)
    first_replica: int = Field(ge=0)
    replicas: int = Field(gt=0)

    def replica_words(self) -> str:
        """'replica 0', 'replicas 1-3'."""
        last = self.first_replica + self.replicas - 1
        return f"replica {last}" if self.replicas == 1 else f"replicas {self.first_replica}-{last}"


class JobSpec(Artifact):
    """job.json: everything the worker needs besides the plan and the DeepSpeed config.

    Paths of sibling files are relative to the run directory.
    """

    schema_version: Literal[1] = 1
    name: str = Field(description="Run name (the run directory's name).")
    model: str = Field(
        description="Model reference for pipectl.models.build_model: a shipped name, an absolute YAML path, "
        "hf:ABSOLUTE-DIR or package.module:factory (imported from `import_root`)."
    )
    import_root: str | None = Field(
        default=None,
        description="Absolute folder a model or dataset factory (package.module:function) is imported from: the "
        "directory the run was first launched from, kept by every resume and resize so that they work from any "
        "directory. None in files written before it was recorded: the directory the command runs in.",
    )
    as_given: dict[str, str] = Field(
        default_factory=dict,
        description="The model and data as the user typed them (`mine.yaml`, `corpus.txt`), beside the absolute "
        "references the ranks use; for people.",
    )
    steps: int = Field(gt=0, description="Optimizer steps to train in total (a resumed run stops here too).")
    checkpoint_every: int = Field(
        default=0, ge=0, description="Checkpoint every K optimizer steps; 0 = only at the end (and on SIGTERM)."
    )
    checkpoint_every_seconds: float = Field(
        default=0.0, ge=0, description="Also checkpoint once this much wall time has passed since the last one; 0 = off."
    )
    checkpoint_auto: bool = Field(
        default=False,
        description="Choose the wall-time interval from the measured checkpoint stall and `mtbf_hours` (Young/Daly).",
    )
    mtbf_hours: float | None = Field(
        default=None, gt=0, description="Expected hours between failures of the whole job (for the automatic "
        "interval); None: DEVICE_MTBF_HOURS / world size (runtime/checkpoint/checkpointer.py).",
    )
    keep_checkpoints: int = Field(default=3, gt=0, description="Verified checkpoints kept; older ones are removed.")
    train_without_checkpoints: bool = Field(
        default=False,
        description="When the disk has no room for the run's first checkpoint, train on without one instead of "
        "stopping there (a failure then loses every step).",
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed of weights init and of the data order.")
    data: DataSpec = Field(default_factory=DataSpec)
    engine: Engine = Field(default=Engine.LOCAL)
    world_size: int = Field(gt=0, description="Ranks at launch: t * p * d of plan.chosen.")
    nodes: int = Field(default=1, gt=0, description="Nodes (agents) at launch.")
    ranks_per_node: int = Field(gt=0, description="Processes per node.")
    master_addr: str = Field(
        default="127.0.0.1",
        description="Rendezvous / master address (a host name, IPv4 or IPv6 address); '' for slurm: the first "
        "node of the allocation.",
    )
    master_port: int = Field(gt=0, lt=65536, description="Rendezvous / master port (distinct per concurrent job).")
    precision: Precision = Field(default=Precision.FP32)
    accelerator: Literal["cuda", "cpu"] | None = Field(
        default=None,
        description="What the ranks run on, from the plan's device (catalog); None in files written before it "
        "was recorded: whatever the launching host has.",
    )
    elastic: ElasticRange | None = Field(default=None, description="Elastic torchrun membership, if any.")
    recover_in_memory: bool = Field(
        default=False,
        description="Each data-parallel replica runs under its own torchrun and every rank keeps a copy of its "
        "neighbour replica's state after each step, so that the loss of a replica is recovered from the survivors' "
        "memory without a checkpoint (local engine, d >= 2: `launch --recover-in-memory`).",
    )
    compute_slowdowns: dict[str, float] = Field(
        default_factory=dict,
        description="Emulated device kinds of the cluster (node types with compute_slowdown) and their factors: "
        "a rank of a replica on such a kind waits out (k - 1) times each forward and backward it runs.",
    )
    node_groups: list[NodeGroup] = Field(
        default_factory=list,
        description="A plan split over device kinds: the nodes of each kind in rank order (the launcher numbers "
        "ranks node by node, so each group's nodes run its replicas). Empty when every node is alike.",
    )
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    ds_config_overlay: dict[str, Any] = Field(
        default_factory=dict,
        description="The user's DeepSpeed config overlay (launch --ds-config-overlay), merged into every config "
        "this run writes; keys the plan owns are refused.",
    )
    collective_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        le=7 * 24 * 3600,
        description="How long a rank waits in a collective for a silent peer before it fails; None: pipectl's "
        "default for the plan (runtime/liveness.py).",
    )
    log_every: int = Field(
        default=10, ge=0, le=2**31, description="Rank 0 prints a one-line step summary every this many steps (0: never)."
    )
    tensorboard: bool = Field(default=False, description="Rank 0 writes TensorBoard scalars to RUN/tensorboard/.")
    wandb_project: str | None = Field(default=None, description="The Weights & Biases project rank 0 logs to.")
    wandb_run_id: str | None = Field(
        default=None, pattern=r"^[a-z0-9]{1,64}$", description="The W&B run: made at the first launch, kept by every resume."
    )
    host_at_launch: HostState | None = Field(
        default=None, description="How busy the launching host was when the job started (engine local); None: other."
    )
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The launch's options as chosen, by config-file section and key (what `pipectl launch "
        "--print-config` writes), before the plan and the host filled them in; `launch --resume` reads them back. "
        "Empty in files written before they were recorded.",
    )
    plan_file: str = Field(default=PLAN_FILE)
    ds_config_file: str = Field(default=DS_CONFIG_FILE)
    pipectl_version: str = Field(default="", description="pipectl version that wrote the file.")
    global_batch_changes: list[str] = Field(
        default_factory=list,
        description="Deliberate changes of the global batch on a resume (launch --resume "
        "--change-global-batch), one line each: 'B 8 -> 16 after step 4'.",
    )

    @field_validator("master_addr")
    @classmethod
    def _host_address(cls, value: str) -> str:
        return check_host_address(value)

    @field_validator("plan_file", "ds_config_file")
    @classmethod
    def _inside_the_run(cls, name: str) -> str:
        """Sibling files are plain names inside the run directory: no folder, no '..'."""
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(f"{name!r} is not a file name inside the run directory")
        return name

    @model_validator(mode="after")
    def _ranks_cover_world(self) -> "JobSpec":
        if self.elastic is None and self.nodes * self.ranks_per_node != self.world_size:
            raise ValueError(
                f"nodes {self.nodes} x ranks_per_node {self.ranks_per_node} != world_size {self.world_size}"
            )
        if self.node_groups:
            if sum(g.nodes for g in self.node_groups) != self.nodes:
                raise ValueError(f"node_groups hold {sum(g.nodes for g in self.node_groups)} nodes, the job {self.nodes}")
            if self.elastic is not None:
                raise ValueError("a job of node groups (a split over device kinds) is not elastic")
        return self


class RankTiming(Strict):
    """One rank's compute time and memory in one step: the heartbeat used to spot stragglers.

    The memory fields are None in files written before they existed, and the CUDA ones on CPU.
    """

    rank: int = Field(ge=0)
    stage: int = Field(ge=0, description="Pipeline stage the rank runs.")
    samples: int | None = Field(
        default=None, gt=0,
        description="Samples the rank's replica processed this step (its share of the global batch: uneven "
        "replicas differ). None in files written before it existed.",
    )
    device: str | None = Field(
        default=None,
        description="The device kind the plan put the rank's replica on (a heterogeneous plan's differ; ranks are "
        "compared with peers of their own kind). None in files written before it existed.",
    )
    host: str | None = Field(
        default=None,
        description="The node the rank ran on (Slurm's node name under Slurm, else the host name). None in files "
        "written before it existed.",
    )
    forward_seconds: float = Field(ge=0, description="Sum of the rank's forward (and recompute) time this step.")
    backward_seconds: float = Field(ge=0, description="Sum of the rank's backward time this step.")
    p2p_seconds: float | None = Field(
        default=None, ge=0,
        description="The rank's time in sends and receives this step, waiting for its peers included (the pipeline's "
        "bubble and the transfers). None in files written before it existed.",
    )
    end_of_step_seconds: float | None = Field(
        default=None, ge=0,
        description="The rank's gradient reductions (tied and data-parallel) and optimizer step, with the step's "
        "wait for a checkpoint's copies. None in files written before it existed.",
    )
    optimizer_seconds: float | None = Field(
        default=None, ge=0,
        description="The optimizer step alone, part of end_of_step_seconds (DeepSpeed's ordinary engine reduces the "
        "gradients in the last backward: its end of step is its optimizer step). None in files written before it existed.",
    )
    checkpoint_seconds: float | None = Field(
        default=None, ge=0,
        description="The optimizer step's wait for a checkpoint's copies to host memory, part of end_of_step_seconds "
        "(on a GPU the copies overlap the step after the checkpoint; 0 in other steps and where the copy is taken "
        "between steps). None in files written before it existed.",
    )
    peak_allocated_bytes: int | None = Field(
        default=None,
        ge=0,
        description="CUDA: torch.cuda.max_memory_allocated over this step (peak stats reset at the step's "
        "start, so each step reports its own peak; tensors only). None on CPU.",
    )
    peak_reserved_bytes: int | None = Field(
        default=None,
        ge=0,
        description="CUDA: torch.cuda.max_memory_reserved over this step (reset like peak_allocated_bytes; "
        "what the caching allocator held). None on CPU.",
    )
    peak_rss_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Peak resident set size of the rank's process (Linux: VmHWM of /proc/self/status; "
        "elsewhere getrusage ru_maxrss): a running max since the process started, never reset, of the whole "
        "process (interpreter, libraries, buffers, tensors).",
    )


class StepMetrics(Strict):
    """One line of metrics.jsonl: one optimizer step."""

    step: int = Field(ge=1, description="Optimizer step just completed (1-based).")
    loss: float = Field(description="Mean loss over the step's micro-batches (the global batch).")
    step_seconds: float = Field(ge=0, description="Measured wall time of the step.")
    predicted_step_seconds: float | None = Field(default=None, description="Plan's prediction for this layout.")
    samples_per_second: float = Field(ge=0, description="global batch / step_seconds.")
    global_batch: int = Field(gt=0)
    world_size: int = Field(gt=0)
    layout: LayoutLabel = Field(default="", description="Layout label, e.g. 't1p2d1 1f1b b2 m4'.")
    time_unix: float = Field(default=0.0, description="When the step finished (seconds since the epoch).")
    ranks: list[RankTiming] = Field(default_factory=list, description="Per-rank heartbeats.")
    predicted_peak_memory_bytes: list[int] = Field(
        default_factory=list,
        description="Plan's predicted peak memory per pipeline stage (per device) for this layout; "
        "empty in files written before it was recorded.",
    )
    learning_rate: float | None = Field(default=None, description="The learning rate this step trained with.")
    grad_norm: float | None = Field(
        default=None, description="The global gradient norm before clipping (None where the engine computes none)."
    )
    tokens_per_second: float | None = Field(
        default=None, ge=0, description="samples_per_second x the sequence length (transformers)."
    )
    mfu: float | None = Field(
        default=None, ge=0, description="Model FLOPs of the step over the devices' peak in its time (None without a peak)."
    )
    stage_peak_memory_bytes: list[int] = Field(
        default_factory=list,
        description="Per pipeline stage, the highest peak of its ranks in this step (allocated on GPUs, RSS on CPU); "
        "empty on steps without rank detail.",
    )


class RankDetail(Strict):
    """A line of logs/ranks.jsonl: every rank's timings and memory in one step of one layout."""

    step: int = Field(ge=1)
    layout: LayoutLabel = ""
    ranks: list[RankTiming]


class RankFailure(Artifact):
    """logs/failure-rank{R}.json: why rank R stopped with an error, for the launching terminal.

    Written by the worker (atomically) before it exits non-zero; the traceback goes to the rank's
    log, this record holds what a person needs first: where it failed and, when memory ran out,
    what the plan predicted for that stage.
    """

    schema_version: Literal[1] = 1
    rank: int = Field(ge=0)
    stage: int | None = Field(default=None, ge=0, description="Pipeline stage; None if it failed before the engine.")
    step: int | None = Field(default=None, ge=1, description="Optimizer step being trained (1-based), if any.")
    phase: str = Field(default="", description="What ran: 'forward of micro-batch 3', 'optimizer step', 'start-up'.")
    layer_index: int | None = Field(default=None, ge=0, description="Model layer whose forward was running.")
    layer_name: str = Field(default="", description="That layer's name in the model's layer list.")
    stage_layers: tuple[int, int] | None = Field(default=None, description="The stage's half-open layer range.")
    exception: str = Field(description="Exception type, e.g. 'torch.OutOfMemoryError'.")
    message: str = Field(default="", description="The exception's message (truncated).")
    out_of_memory: bool = Field(default=False, description="The device (or the host, on CPU) ran out of memory.")
    device: str = Field(default="cpu", description="'cuda' or 'cpu'.")
    layout: LayoutLabel = Field(default="", description="Layout label, e.g. 't1p2d1 1f1b b2 m4'.")
    micro_batch_size: int | None = Field(default=None, gt=0)
    recompute: bool | None = Field(
        default=None, description="Whether the layout recomputed activations (whole stages, every layer or the attention cores)."
    )
    pipeline_parallel: int | None = Field(default=None, gt=0)
    predicted_peak_memory_bytes: int | None = Field(
        default=None, ge=0, description="The plan's predicted peak memory of the rank's stage (per device)."
    )
    peak_allocated_bytes: int | None = Field(default=None, ge=0, description="CUDA: max allocated in the step.")
    peak_reserved_bytes: int | None = Field(default=None, ge=0, description="CUDA: max reserved in the step.")
    peak_rss_bytes: int | None = Field(default=None, ge=0, description="Peak RSS of the process so far.")
    time_unix: float = Field(default=0.0, description="When the failure was recorded.")


class CheckpointManifest(Artifact):
    """TAG/manifest.json, written LAST: a checkpoint without a verifying manifest does not exist."""

    schema_version: Literal[1] = 1
    tag: str = Field(description="Checkpoint tag (its directory name).")
    step: int = Field(ge=0, description="Optimizer steps completed when it was taken.")
    format: Literal["pipectl-shards", "deepspeed-universal"] = Field(
        default="pipectl-shards",
        description="'pipectl-shards': a safetensors file per rank (runtime/checkpoint/shards.py); 'deepspeed-universal': "
        "written by an earlier pipectl, listed and verified but not loaded.",
    )
    layout: Layout | None = Field(default=None, description="The layout that wrote it (degrees, cut, schedule).")
    data_position: dict[str, int] = Field(
        default_factory=dict, description="Where the data order stands (e.g. samples consumed)."
    )
    files: dict[str, Sha256] = Field(description="sha256 of every file, keyed by path relative to the tag dir.")
    file_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="Size of every file, keyed like `files` (a cheap check: a truncated file shows without "
        "hashing); empty in manifests written before it was recorded.",
    )
    bytes: int = Field(ge=0, description="Total size of the files.")
    time_unix: float = Field(default=0.0)
    save_seconds: float = Field(default=0.0, ge=0, description="From the snapshot to the commit, wall time.")
    stall_seconds: float = Field(
        default=0.0, ge=0, description="How long training paused for it (rank 0: the copy to host memory)."
    )

    @field_validator("tag")
    @classmethod
    def _tag_is_a_folder_name(cls, tag: str) -> str:
        if not tag or tag in (".", "..") or "/" in tag or "\\" in tag:
            raise ValueError(f"tag {tag!r} is not a folder name")
        return tag

    @field_validator("files")
    @classmethod
    def _files_stay_inside(cls, files: dict[str, str]) -> dict[str, str]:
        """Keys are relative paths inside the tag folder: no absolute path, no '..', no backslash."""
        for relative in files:
            path = PurePosixPath(relative)
            if not path.parts or path.is_absolute() or "\\" in relative or ".." in path.parts:
                raise ValueError(f"file {relative!r} is not a relative path inside the checkpoint")
        return files

    @model_validator(mode="after")
    def _sizes_name_listed_files(self) -> "CheckpointManifest":
        for relative, size in self.file_bytes.items():
            if relative not in self.files:
                raise ValueError(f"file_bytes names {relative!r}, which files does not list")
            if size < 0:
                raise ValueError(f"file_bytes of {relative!r} is negative ({size})")
        return self


class CheckpointOutcome(str, Enum):
    COMMITTED = "committed"
    FAILED = "failed"  # a rank could not write its file, or the commit failed: nothing committed
    SKIPPED = "skipped"  # not started: too little free space (training went on)


class CheckpointEvent(Strict):
    """One line of RUN/logs/checkpoints.jsonl (rank 0): what became of each checkpoint."""

    step: int = Field(ge=0)
    outcome: CheckpointOutcome
    message: str = Field(default="", description="Why it failed or was skipped; empty when committed.")
    stall_seconds: float = Field(default=0.0, ge=0, description="Training paused (rank 0).")
    write_seconds: float = Field(default=0.0, ge=0, description="Background write, hash and commit.")
    bytes: int = Field(default=0, ge=0)
    interval_seconds: float | None = Field(
        default=None, description="The wall-time interval chosen after it (--checkpoint-every auto or a time)."
    )
    due_step: int | None = Field(
        default=None, description="The step it was due at, when the write of the one before still ran then."
    )
    time_unix: float = 0.0


class ResumeRecord(Artifact):
    """logs/resume.json: where the ranks of the latest start resumed, for the launching terminal.

    Rank 0 writes it (atomically) once the checkpoint is chosen and loaded, before the first step;
    `launch` and `resize` report from it the step the job really resumed from and every newer
    checkpoint that could not be loaded.
    """

    schema_version: Literal[1] = 1
    step: int = Field(ge=0, description="Optimizer steps the loaded checkpoint holds (0: a fresh start).")
    tag: str | None = Field(default=None, description="The checkpoint loaded; None for a fresh start.")
    skipped: list[str] = Field(
        default_factory=list, description="Newer checkpoints that could not be loaded, each with the file and why."
    )
    time_unix: float = Field(default=0.0, description="When the ranks resumed.")


class RequeueOutcome(str, Enum):
    FINISHED = "finished"  # every step trained, the last one checkpointed
    REQUEUED = "requeued"  # `scontrol requeue`: the job starts again and resumes
    STOPPED = "stopped"  # not requeued: the limit of requeues without progress, or none allowed


class RequeueRecord(Strict):
    """A line of logs/requeues.jsonl: how one start of a Slurm job ended (`launch/requeue.py`)."""

    slurm_job_id: str = Field(default="", description="SLURM_JOB_ID (a requeued job keeps its id).")
    restart_count: int = Field(default=0, ge=0, description="SLURM_RESTART_COUNT: the times Slurm restarted it.")
    time_unix: float
    exit_code: int = Field(description="srun's exit code: the ranks' worst.")
    steps_done: int = Field(ge=0)
    checkpoint_step: int = Field(ge=0, description="The newest verified checkpoint's step (0: none).")
    ended: str = Field(description="How the ranks ended, in words.")
    outcome: RequeueOutcome
    reason: str = Field(default="", description="Why not requeued, when stopped.")


class RankState(str, Enum):
    """Where a rank is in its life, as its heartbeat says."""

    RUNNING = "running"
    FINISHED = "finished"  # trained every step, final checkpoint written, exiting 0
    STOPPED = "stopped"  # stopped early on request (SIGTERM, stop file), checkpoint written, exiting 0
    FAILED = "failed"  # an error ended it (its failure record says which)
    LEFT = "left"  # handed its state to the other ranks in a live resize, exiting 0
    LOST = "lost"  # its replica was lost and the survivors took over without it (written by the agent)


class WriteRefusal(Strict):
    """A line of logs/refused-writes.jsonl: a file the disk refused for a while, and what waited."""

    file: str = Field(description="The file refused, relative to the run: metrics.jsonl.")
    error: str = Field(description="The first refusal's error, e.g. '[Errno 28] No space left on device'.")
    first_unix: float = Field(description="When the first write was refused.")
    written_unix: float = Field(description="When the lines that waited were written.")
    lines: int = Field(ge=1, description="Lines that waited in memory and are written now.")


class RankHeartbeat(Strict):
    """logs/heartbeat-rank{R}.json: rank R is alive and what it is doing.

    A thread of the rank rewrites it every second (`runtime/liveness.py`), whatever the rank's main
    thread does: a rank blocked in a collective still beats, a stopped or frozen process does not.
    `progress_unix` moves only when the rank starts a new step or phase. The last write, when the
    rank ends, gives its final state.
    """

    rank: int = Field(ge=0)
    pid: int = Field(gt=0)
    host: str = ""
    stage: int | None = Field(default=None, ge=0)
    step: int | None = Field(default=None, ge=1, description="The step being trained (1-based), if any.")
    phase: str = Field(default="", description="What the main thread does: 'training', 'writing metrics', ...")
    state: RankState = RankState.RUNNING
    checkpoint_step: int | None = Field(
        default=None, ge=0, description="Finished or stopped: the step of the checkpoint it wrote last."
    )
    stop_reason: str = Field(
        default="", description="Stopped: why (a signal, the stop file, the launching pipectl gone)."
    )
    started_unix: float = Field(description="When the rank started (its job's start, for readers).")
    beat_unix: float = Field(description="When this was written.")
    progress_unix: float = Field(description="When the rank last started a new step or phase.")
