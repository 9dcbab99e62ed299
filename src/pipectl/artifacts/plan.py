"""The plan artifact (plan.json): the request, the chosen configuration, the ranked candidates, the
morph table.

`launch` reads `chosen` and checks the model against `model_shape`; `resize` reads `morph_table`
and re-plans from `request` with the profile `profile` names (`pipectl.planfile` keeps the two
together on disk). Layer ranges are half-open: a stage holding
layers [start, end) owns layer indices start..end-1 of the profile.

A candidate recomputes activations in one of four ways (`Recompute`): not at all, whole stages
(`recompute: true`, R actions in the schedule), layer by layer (`checkpoint_layers: true`, added
later: files without it load as false, their plans unchanged), or only each block's attention core
(`selective_recompute: true`, written only when true); `PlanRequest.recompute` says which the
search may use.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipectl.artifacts.base import MAX_SECONDS, Artifact, Bytes, Sha256, Strict
from pipectl.artifacts.calibration import RunsCalibration
from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.profile import LinksProfile, ModelProfile
from pipectl.schedule.ir import ScheduleKind


# The ZeRO stages pipectl's runtime trains with in any layout: 1, the stage whose optimizer
# partitions its checkpoints hold and re-cut for a resize. DeepSpeed's pipeline engine rejects 2
# and 3; a one-stage plan (p = 1, t = 1) runs ZeRO-2 and ZeRO-3 in DeepSpeed's ordinary engine,
# whose optimizers' partitions `runtime.checkpoint.engine_state` reads and writes in the same checkpoint
# format (`runtime_runs_zero`). A candidate with another stage is planned for comparison only.
RUNTIME_ZERO_STAGES = (1,)
ONE_STAGE_ZERO_STAGES = (1, 2, 3)


def runtime_runs_zero(
    zero_stage: int, pipeline_parallel: int, tensor_parallel: int = 1, *, checkpoint_layers: bool = False
) -> bool:
    """Whether pipectl's runtime trains a layout of this pipeline and tensor degree with this ZeRO
    stage. Not ZeRO-3 with per-layer activation checkpointing: the recomputed forward inside the
    backward finds the layer's weights partitioned (DeepSpeed 0.19.8, measured: "The size of tensor
    a (0) must match the size of tensor b (256)").

    >>> runtime_runs_zero(1, 4), runtime_runs_zero(2, 1), runtime_runs_zero(2, 2), runtime_runs_zero(3, 1)
    (True, True, False, True)
    >>> runtime_runs_zero(3, 2), runtime_runs_zero(3, 1, tensor_parallel=2), runtime_runs_zero(0, 1)
    (False, False, False)
    >>> runtime_runs_zero(3, 1, checkpoint_layers=True), runtime_runs_zero(2, 1, checkpoint_layers=True)
    (False, True)
    """
    if zero_stage == 3 and checkpoint_layers:
        return False
    if pipeline_parallel == 1 and tensor_parallel == 1:
        return zero_stage in ONE_STAGE_ZERO_STAGES
    return zero_stage in RUNTIME_ZERO_STAGES


# 2**31 samples per step: beyond any published run (GPT-3 trained with 3.2 M tokens, about 1,600
# samples, per step) and small enough that the micro-batches of a step stay countable.
MAX_GLOBAL_BATCH = 2**31


class Engine(str, Enum):
    """What runs a plan's pipeline.

    deepspeed: DeepSpeed's pipeline engine, what `pipectl launch` starts (one contiguous stage per
    rank, one backward per micro-batch, ZeRO-1). torch: PyTorch's pipelining runtime
    (`pipectl.runtime.engines.torch_pipeline`): GPipe, 1F1B, interleaved (v > 1) and zb-h1, without
    recomputation, tensor or data parallelism, fp32 on CPU ranks; `pipectl launch` runs it in the
    worker (`runtime.engines.build.build_torch_engine`) with DeepSpeed's checkpoints, data and metrics. any
    (a request only): choose whatever is best, runnable or not.
    """

    DEEPSPEED = "deepspeed"
    TORCH = "torch"
    ANY = "any"


class Framework(str, Enum):
    """Another training framework a plan is made for (`plan --emit`, `pipectl export-plan`): the
    search keeps to the layouts it can express (`pipectl.plan.frameworks`), and the chosen layout
    is written as its arguments or config (`pipectl.emit`)."""

    MEGATRON = "megatron"
    TORCHTITAN = "torchtitan"
    DEEPSPEED = "deepspeed"


class Objective(str, Enum):
    TIME = "time"
    COST = "cost"
    COST_DEADLINE = "cost-deadline"


class Recompute(IntEnum):
    """How a layout recomputes activations (the planner's granularity; an int so that False and True
    read as NONE and STAGE, the two values of the older `recompute: bool`).

    - NONE: every in-flight micro-batch keeps its stage's saved activations.
    - STAGE: every stage but the last keeps only its input per in-flight micro-batch, and the
      schedule re-runs the stage's forward (an R action) before its backward (Varuna always).
    - LAYER: per-layer activation checkpointing (Megatron-LM's "full" recompute): every stage,
      the last and a one-stage plan included, keeps each of its layers' input per in-flight
      micro-batch, and each layer's forward runs again inside the backward, just before that
      layer's backward; the schedule has no R actions.
    - SELECTIVE: selective recomputation (Korthikanti et al. 2022, §5): every layer keeps its saved
      activations except its attention core's (QK^T scores, softmax, softmax dropout, attention
      over V), which runs forward again inside the block's backward; the schedule has no R actions.
      The values are stored in files and caches: a new granularity takes a new number.
    """

    NONE = 0
    STAGE = 1
    LAYER = 2
    SELECTIVE = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class RecomputeChoice(str, Enum):
    """`plan --recompute`: which recomputation the search may use; memory and time decide between
    them. `never`: none; `stage`: none or whole stages (what `allow_recompute` meant before
    per-layer checkpointing existed); `layer`: none or per-layer checkpointing; `selective`: none
    or the attention core only; `always`: some recomputation on every candidate (stage, layer or
    selective, never none); `auto`: all four."""

    NEVER = "never"
    STAGE = "stage"
    LAYER = "layer"
    SELECTIVE = "selective"
    ALWAYS = "always"
    AUTO = "auto"


def recompute_granularities(choice: "RecomputeChoice") -> tuple[Recompute, ...]:
    """The granularities a search tries for a `RecomputeChoice`.

    >>> [r.label for r in recompute_granularities(RecomputeChoice.AUTO)]
    ['none', 'stage', 'layer', 'selective']
    >>> [r.label for r in recompute_granularities(RecomputeChoice.LAYER)]
    ['none', 'layer']
    >>> [r.label for r in recompute_granularities(RecomputeChoice.ALWAYS)]
    ['stage', 'layer', 'selective']
    """
    return {
        RecomputeChoice.NEVER: (Recompute.NONE,),
        RecomputeChoice.STAGE: (Recompute.NONE, Recompute.STAGE),
        RecomputeChoice.LAYER: (Recompute.NONE, Recompute.LAYER),
        RecomputeChoice.SELECTIVE: (Recompute.NONE, Recompute.SELECTIVE),
        RecomputeChoice.ALWAYS: (Recompute.STAGE, Recompute.LAYER, Recompute.SELECTIVE),
        RecomputeChoice.AUTO: (Recompute.NONE, Recompute.STAGE, Recompute.LAYER, Recompute.SELECTIVE),
    }[choice]


class PlanRequest(Strict):
    """What the user asks of the planner (the job part of the three inputs)."""

    global_batch: int = Field(le=MAX_GLOBAL_BATCH, description="B: samples per optimizer step; never changed by the planner.")
    objective: Objective = Objective.TIME
    schedules: list[ScheduleKind] | None = Field(
        default=None,
        description="Schedules to consider; default 1f1b, gpipe, interleaved, varuna. 2bw only if listed: priced per "
        "update in steady state (no flush, m >= p - 1), another optimizer, chosen only with for_deepspeed off.",
    )
    chunks: list[int] = Field(default_factory=lambda: [2, 4], max_length=64, description="v values tried for interleaved.")
    max_tensor_parallel: int | None = Field(default=None, gt=0, description="Upper bound on t.")
    tensor_parallel: int | None = Field(default=None, gt=0, description="Pinned t.")
    pipeline_parallel: int | None = Field(default=None, gt=0, description="Pinned p.")
    data_parallel: int | None = Field(default=None, gt=0, description="Pinned d.")
    micro_batch_size: int | None = Field(default=None, gt=0, description="Pinned b.")
    schedule: ScheduleKind | None = Field(default=None, description="Pinned schedule.")
    devices: int | None = Field(default=None, gt=0, description="Devices to plan for (default: the whole cluster).")
    deadline_hours: float | None = Field(default=None, gt=0, description="cost-deadline: hours available.")
    samples: int | None = Field(default=None, gt=0, description="cost-deadline: samples to train on.")
    tokens: int | None = Field(default=None, gt=0, description="cost-deadline: tokens to train on (samples = tokens / seq_len).")
    allow_recompute: bool = Field(
        default=True, description="Older files' switch: false is recompute 'never' (`plan --no-recompute`)."
    )
    recompute: RecomputeChoice = Field(
        default=RecomputeChoice.AUTO,
        description="Recomputation the search may use: never, stage (none or whole-stage recompute, R actions "
        "on every stage but the last), layer (none or per-layer activation checkpointing, every stage, p = 1 too), "
        "selective (none or the attention core only, Korthikanti et al. 2022 §5), always (stage, layer or "
        "selective: never none), auto (all four; the default).",
    )
    uneven_replicas: bool = Field(
        default=True,
        description="Let replicas take ceil or floor of B / (d x b) micro-batches when d does not divide B / b "
        "(VirtualFlow); off: only d x b dividing B.",
    )
    zero_stages: list[int] = Field(
        default_factory=lambda: [1],
        description="ZeRO stages to try (0 to 3; 2 and 3 at p = 1 only: DeepSpeed's pipeline engine refuses them). "
        "The planner chooses ZeRO-1, which pipectl's runtime trains with in any layout (its checkpoints hold and "
        "re-cut ZeRO-1's optimizer partitions); 0, 2 and 3 are planned for comparison (chosen only with "
        "for_deepspeed off).",
    )
    memory_headroom: float = Field(
        default=0.05, ge=0, lt=1,
        description="Fraction of each device's memory the plan keeps free, on top of the memory model's own terms.",
    )
    include_all: bool = Field(default=False, description="Simulate and keep every feasible candidate.")
    for_deepspeed: bool = Field(
        default=True,
        description="Choose only schedules DeepSpeed's engine can run (engine deepspeed); off for engine torch "
        "or any. Plans written before `engine` existed record only this.",
    )
    engine: Engine = Field(
        default=Engine.DEEPSPEED,
        description="What will run the plan: deepspeed (pipectl launch), torch (PyTorch's pipelining runtime: "
        "1f1b, gpipe, interleaved, zb-h1; no recompute, t = 1, d = 1), or any (choose the best, runnable or not). "
        "torch adds zb-h1 to the default schedules (any prices it when listed).",
    )
    framework: Framework | None = Field(
        default=None,
        # Left out of the file when unset: plans made for pipectl's own runtimes read and write as before.
        exclude_if=lambda framework: framework is None,
        description="Another framework the plan is for (plan --emit): megatron, torchtitan or deepspeed (a "
        "PipelineModule script of one's own). The search keeps to the layouts it can express; engine any.",
    )
    top: int = Field(default=10, gt=0, description="Candidates kept in the ranking (without include_all).")
    morph: bool = Field(default=True, description="Compute the morph table.")
    morph_counts: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=list, max_length=4096,
        description="Device counts the morph table covers besides every count up to one node and whole nodes beyond.",
    )
    morph_every_count: bool = Field(default=False, description="The morph table covers every device count.")
    workers: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        exclude=True,
        description="Processes the enumeration may use (default: $PIPECTL_PLAN_WORKERS, else the cores "
        "available). Not recorded in plan.json: the plan is the same for any number.",
    )


    @model_validator(mode="after")
    def _recompute_consistent(self) -> "PlanRequest":
        if not self.allow_recompute and self.recompute not in (RecomputeChoice.AUTO, RecomputeChoice.NEVER):
            raise ValueError(f"allow_recompute is false but recompute is {self.recompute.value!r}")
        if self.framework is not None and self.engine is not Engine.ANY:
            # The framework runs the plan, not pipectl's runtimes: what they can run does not bind.
            raise ValueError(f"framework {self.framework.value} plans with engine any, not {self.engine.value}")
        return self

    @property
    def recompute_granularities(self) -> tuple[Recompute, ...]:
        """What the search tries (`recompute_granularities`; `allow_recompute: false` is never)."""
        return recompute_granularities(self.recompute if self.allow_recompute else RecomputeChoice.NEVER)

    @property
    def target_engine(self) -> Engine:
        """The engine the plan is for (`model_copy(update={"for_deepspeed": False})` skips the
        validator that keeps the two fields together: off means any engine, as it always did)."""
        if self.engine is Engine.DEEPSPEED and not self.for_deepspeed:
            return Engine.ANY
        return self.engine

    @model_validator(mode="before")
    @classmethod
    def _engine_and_for_deepspeed_agree(cls, data):
        """`for_deepspeed` came first: off without an engine means any engine (an old plan, or
        --any-engine); an engine other than deepspeed turns it off; the two never disagree."""
        if not isinstance(data, dict):
            return data
        engine, for_deepspeed = data.get("engine"), data.get("for_deepspeed")
        if engine is None:
            if for_deepspeed is False:
                return {**data, "engine": Engine.ANY}
            return data
        try:
            engine = Engine(engine)
        except ValueError:
            return data  # the field's own validation names the value
        if for_deepspeed is None:
            return {**data, "for_deepspeed": engine is Engine.DEEPSPEED}
        if for_deepspeed != (engine is Engine.DEEPSPEED):
            raise ValueError(
                f"engine {engine.value} with for_deepspeed {for_deepspeed}: for_deepspeed is true exactly for "
                "engine deepspeed"
            )
        return data

    @field_validator("chunks")
    @classmethod
    def _chunks_positive(cls, chunks: list[int]) -> list[int]:
        if any(v < 1 for v in chunks):
            raise ValueError(f"chunks (interleaved v) must be at least 1, got {chunks}")
        return chunks

    @field_validator("zero_stages")
    @classmethod
    def _known_zero_stages(cls, stages: list[int]) -> list[int]:
        if not stages or any(not 0 <= stage <= 3 for stage in stages):
            raise ValueError("ZeRO stages are 0, 1, 2 and 3")
        return stages


def balanced_shares(global_batch: int, data_parallel: int, micro_batch_size: int) -> list[int]:
    """Micro-batches per replica when the B / b micro-batches of a step are dealt out as evenly as
    they go: the first (B / b mod d) replicas take one more than the others.

        >>> balanced_shares(16, 3, 1), balanced_shares(8192, 6, 2), balanced_shares(8, 2, 2)
        ([6, 5, 5], [683, 683, 683, 683, 682, 682], [2, 2])
    """
    micro_batches, rest = divmod(global_batch, micro_batch_size)
    if rest or not 1 <= data_parallel <= micro_batches:
        raise ValueError(
            f"B={global_batch} does not split into micro-batches of {micro_batch_size} for each of {data_parallel} replicas"
        )
    each, more = divmod(micro_batches, data_parallel)
    return [each + 1] * more + [each] * (data_parallel - more)


class ReplicaShare(Strict):
    """Uneven plans: how much of the global batch one data-parallel replica processes."""

    replica: int = Field(ge=0, description="Data-parallel replica index.")
    device: str = Field(description="Device kind of the replica's devices.")
    micro_batch_size: int = Field(gt=0)
    micro_batches: int = Field(gt=0)
    samples: int = Field(gt=0, description="Samples per step: micro_batch_size * micro_batches.")
    gradient_weight: float = Field(gt=0, description="samples / global batch: weight of its mean gradient.")


def replica_shares(global_batch: int, data_parallel: int, micro_batch_size: int, device: str) -> list[ReplicaShare] | None:
    """The replicas of a candidate on one device kind: None when d x b divides B (each runs
    B / (d x b) micro-batches), else `balanced_shares` with each replica's weight samples / B."""
    shares = balanced_shares(global_batch, data_parallel, micro_batch_size)
    if len(set(shares)) == 1:
        return None
    b = micro_batch_size
    # Built unchecked: every figure is derived here from the arguments (a file's shares are
    # checked when it is read). A large job has hundreds of replicas per candidate.
    return [
        ReplicaShare.model_construct(replica=r, device=device, micro_batch_size=b, micro_batches=m, samples=b * m,
                                     gradient_weight=b * m / global_batch)
        for r, m in enumerate(shares)
    ]


class Candidate(Strict):
    """One fully specified configuration and its predicted cost."""

    devices: int = Field(gt=0, description="Devices used: t * p * d (may be fewer than available).")
    device: str = Field(description="Device kind (catalog name); 'mixed' for heterogeneous plans.")
    tensor_parallel: int = Field(gt=0)
    pipeline_parallel: int = Field(gt=0)
    data_parallel: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0, description="b: samples per micro-batch.")
    micro_batches: int = Field(
        gt=0, description="m: micro-batches per pipeline per step = B / (d * b); with uneven replicas the most any runs."
    )
    chunks: int = Field(default=1, gt=0, description="v: model chunks per device (interleaved).")
    schedule: ScheduleKind
    recompute: bool = Field(description="Whole-stage recomputation: R actions before the backwards of every stage but the last.")
    checkpoint_layers: bool = Field(
        default=False,
        description="Per-layer activation checkpointing: every stage keeps its layers' inputs and recomputes each "
        "layer's forward inside its backward (no R actions). Absent in older files: false. Never with recompute.",
    )
    selective_recompute: bool = Field(
        default=False,
        # Left out of the file when false: a plan without it reads and writes as before.
        exclude_if=lambda selective: not selective,
        description="Selective recomputation: every block keeps its saved activations but its attention core's "
        "(scores, softmax, dropout, attention over V), which runs forward again inside the block's backward (no "
        "R actions). Absent: false. Never with recompute or checkpoint_layers.",
    )
    zero_stage: int = Field(ge=0, le=3)
    stage_layers: list[tuple[int, int]] = Field(
        description="Half-open layer index range [start, end) of every (virtual) stage, in order."
    )
    predicted_step_seconds: float = Field(gt=0, le=MAX_SECONDS)
    samples_per_second: float = Field(gt=0)
    tflops_per_device: float = Field(ge=0)
    peak_memory_bytes: list[Bytes] = Field(description="Predicted peak memory per stage (per device).")
    bubble_fraction: float = Field(ge=0, le=1)
    communication_fraction: float = Field(ge=0, le=1)
    cost_per_million_samples: float = Field(ge=0, description="USD per 1 M samples at the cluster's prices.")
    replicas: list[ReplicaShare] | None = Field(
        default=None,
        description="Uneven batch split over replicas, one entry per replica in order (None: every replica b x m).",
    )
    deepspeed_runnable: bool = Field(
        default=True, description="Whether DeepSpeed's pipeline engine can execute this schedule."
    )
    engine: Engine | None = Field(
        default=None,
        description="What would run this candidate under the plan's request: deepspeed or torch; none when "
        "neither runs it (planned for comparison). Plans written before this field: deepspeed when "
        "deepspeed_runnable.",
    )
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _engine_of_an_older_plan(cls, data):
        if isinstance(data, dict) and "engine" not in data:
            return {**data, "engine": Engine.DEEPSPEED if data.get("deepspeed_runnable", True) else None}
        return data

    @field_validator("engine")
    @classmethod
    def _an_engine_not_a_choice(cls, engine: Engine | None) -> Engine | None:
        if engine is Engine.ANY:
            raise ValueError("a candidate's engine is deepspeed, torch or none; 'any' is for requests")
        return engine

    @property
    def global_batch(self) -> int:
        if self.replicas:
            return sum(r.samples for r in self.replicas)
        return self.data_parallel * self.micro_batch_size * self.micro_batches

    @property
    def replica_kinds(self) -> tuple[str, ...]:
        """The device kind of each data-parallel replica, in replica order."""
        shares = sorted(self.replicas or (), key=lambda r: r.replica)
        return tuple(r.device for r in shares) or (self.device,) * self.data_parallel

    @property
    def recompute_granularity(self) -> Recompute:
        if self.checkpoint_layers:
            return Recompute.LAYER
        if self.selective_recompute:
            return Recompute.SELECTIVE
        return Recompute.STAGE if self.recompute else Recompute.NONE

    @model_validator(mode="after")
    def _consistent(self) -> "Candidate":
        if self.recompute and self.checkpoint_layers:
            raise ValueError("recompute (whole stages) and checkpoint_layers (per layer) exclude each other")
        if self.selective_recompute and (self.recompute or self.checkpoint_layers):
            raise ValueError("selective_recompute (the attention core) excludes recompute and checkpoint_layers")
        if self.devices != self.tensor_parallel * self.pipeline_parallel * self.data_parallel:
            raise ValueError(
                f"devices {self.devices} != tensor {self.tensor_parallel} x pipeline "
                f"{self.pipeline_parallel} x data {self.data_parallel}"
            )
        expected = self.pipeline_parallel * self.chunks
        if len(self.stage_layers) != expected:
            raise ValueError(f"stage_layers has {len(self.stage_layers)} ranges, expected p*v = {expected}")
        if self.stage_layers[0][0] != 0 or any(start >= end for start, end in self.stage_layers):
            raise ValueError(f"stage_layers must start at layer 0 and hold at least one layer each, got {self.stage_layers}")
        for (_, end), (start, _) in zip(self.stage_layers, self.stage_layers[1:]):
            if end != start:
                raise ValueError(f"stage_layers must be contiguous, got {self.stage_layers}")
        if self.replicas is not None:
            if [r.replica for r in self.replicas] != list(range(self.data_parallel)):
                raise ValueError(f"replicas must list replicas 0..{self.data_parallel - 1} in order")
            if self.micro_batches != max(r.micro_batches for r in self.replicas):
                raise ValueError(f"micro_batches {self.micro_batches} must be the most any replica runs")
            bad = next((r for r in self.replicas if r.samples != r.micro_batch_size * r.micro_batches), None)
            if bad is not None:
                raise ValueError(f"replica {bad.replica}: samples {bad.samples} != {bad.micro_batch_size} x {bad.micro_batches}")
        return self


class MorphEntry(Strict):
    """The best plan at one device count; `candidate` is None when nothing fits there."""

    devices: int = Field(gt=0, description="Devices available.")
    candidate: Candidate | None = None
    note: str = Field(default="", description="Why nothing fits, or why fewer devices are used.")


class ModelShape(Strict):
    """What the plan's cut and memory figures assume about the model: launch refuses another."""

    parameter_count: int = Field(ge=0, description="Parameters of the model, each shared group counted once.")
    layer_parameter_counts: list[Annotated[int, Field(ge=0)]] = Field(
        min_length=1,
        description="Parameters of every cuttable layer, in order (a tied layer counts its copy)."
    )
    seq_len: int | None = Field(default=None, gt=0, description="Sequence length (transformers).")
    hidden: int | None = Field(default=None, gt=0, description="Hidden size (transformers).")
    vocab: int | None = Field(default=None, gt=0, description="Vocabulary size (transformers).")

    @classmethod
    def of_profile(cls, profile: ModelProfile) -> "ModelShape":
        return cls(
            parameter_count=profile.parameter_count,
            layer_parameter_counts=[layer.parameter_count for layer in profile.layers],
            seq_len=profile.seq_len,
            hidden=profile.hidden,
            vocab=profile.vocab,
        )

    @property
    def layers(self) -> int:
        return len(self.layer_parameter_counts)


class ProfileRef(Strict):
    """The profile a plan was made from: a copy named by its content, next to plan.json."""

    file: str = Field(description="File name of the copy in plan.json's folder, profile-<sha256[:12]>.json.")
    sha256: Sha256 = Field(description="sha256 of the copy's bytes; checked on load.")
    source: str = Field(default="", description="Where the profile was read from when planning (for people).")


class Plan(Artifact):
    """plan.json: what was asked (`request`), of which model (`model_shape`, `profile`), and the answer."""

    schema_version: Literal[2] = 2
    model: str = Field(description="Model name from the profile.")
    model_reference: str | None = Field(
        default=None,
        description="The model as given when profiling (a shipped name, a YAML path, 'package.module:factory'); "
        "what `launch` builds by default.",
    )
    model_shape: ModelShape
    profile: ProfileRef | None = Field(
        default=None, description="The profile's copy next to plan.json; None for a plan never written to disk."
    )
    kind_profiles: list[ProfileRef] = Field(
        default_factory=list,
        description="Profiles of the cluster's other device kinds (`plan --profile` repeated), copies next to "
        "plan.json like `profile`; a re-plan prices each kind with its own.",
    )
    cluster: str = Field(description="Cluster name.")
    cluster_file: str | None = Field(
        default=None,
        description="The cluster YAML's absolute path when `plan --cluster` named a file (not a shipped name): "
        "what `launch`, `resize` and `simulate` read the cluster from, from any directory.",
    )
    cluster_copy: ClusterSpec | None = Field(
        default=None,
        exclude_if=lambda spec: spec is None,
        description="The cluster file as the plan read it: what the plan is re-priced and launched on when "
        "`cluster_file` is no longer there (moved, or a plan copied to another machine).",
    )
    links_copies: dict[str, LinksProfile] = Field(
        default_factory=dict,
        exclude_if=lambda copies: not copies,
        description="The links files the cluster file names, by absolute path, as the plan read them: what "
        "prices the plan where one of them is no longer there (moved, or the plan copied to another machine).",
    )
    calibration_file: str | None = Field(
        default=None,
        exclude_if=lambda path: path is None,  # a plan without one reads and writes as before
        description="The calibration's absolute path when `plan --calibration` named one: its links priced "
        "the plan, and every re-pricing (simulate, status, resize) applies them too.",
    )
    calibration_copy: RunsCalibration | None = Field(
        default=None,
        exclude_if=lambda calibration: calibration is None,
        description="The calibration as the plan read it, applied when `calibration_file` is no longer there.",
    )
    request: PlanRequest = Field(description="The whole request; every re-plan (resize, elastic) starts from it.")
    chosen: Candidate
    candidates: list[Candidate] = Field(default_factory=list, description="Ranked feasible candidates.")
    infeasible: dict[str, int] = Field(
        default_factory=dict, description="Reasons candidates were rejected, with counts."
    )
    morph_table: list[MorphEntry] = Field(default_factory=list, description="Best plan per device count.")
    notes: list[str] = Field(default_factory=list)

    @property
    def global_batch(self) -> int:
        """B: samples per optimizer step, fixed by the user."""
        return self.request.global_batch

    @property
    def objective(self) -> Objective:
        return self.request.objective

    @property
    def layers(self) -> int:
        """Layers in the profile (cuttable units)."""
        return self.model_shape.layers

    @model_validator(mode="after")
    def _candidates_fit_the_plan(self) -> "Plan":
        """Every candidate cuts the model's layers and keeps the global batch."""
        for cand in [self.chosen, *self.candidates, *(e.candidate for e in self.morph_table if e.candidate)]:
            if cand.stage_layers[-1][1] != self.layers:
                raise ValueError(
                    f"a candidate cuts {cand.stage_layers[-1][1]} layers, the model has {self.layers}"
                )
        for cand in [self.chosen, *self.candidates, *(e.candidate for e in self.morph_table if e.candidate)]:
            if cand.global_batch != self.global_batch:
                raise ValueError(
                    f"candidate with d={cand.data_parallel} b={cand.micro_batch_size} "
                    f"m={cand.micro_batches} covers {cand.global_batch} samples, not the global batch "
                    f"{self.global_batch}"
                )
        return self

    def for_devices(self, devices: int) -> MorphEntry | None:
        return next((e for e in self.morph_table if e.devices == devices), None)
