"""`PlanOptions`: everything `pipectl plan` takes, declared once (`pipectl.config`).

Each field is one flag and one config-file key: `plan --config job.toml` reads [model] profile,
[cluster] name and devices, [training] global_batch and the [plan] section, the same file
`launch --config` reads its own sections from. The values stay as typed (`--tokens 300B`,
`--schedules 1f1b,gpipe`); the command parses them into the planner's `PlanRequest`, whose own
checks name the flag of a value it refuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator

from pipectl.artifacts.base import Strict
from pipectl.artifacts.plan import Engine, Framework, Objective, Plan
from pipectl.config import Layered, Opt, given
from pipectl.errors import UserInputError
from pipectl.schedule import ScheduleKind

SCHEDULE_NAMES = ", ".join(kind.value for kind in ScheduleKind)


class PlanOptions(Strict, Layered):
    """`pipectl plan`'s flags, or its config file's values (`Strict`: `global_batch = true` in a file
    is refused, not read as 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Flags of one invocation: what to show and how, never read from a file.
    include_all: Annotated[bool, Opt(None, flag="--all")] = Field(
        default=False, description="Simulate and keep every feasible candidate, and list those no engine runs apart."
    )
    full_morph: Annotated[bool, Opt(None, flag="--morph-table")] = Field(
        default=False, description="Print the whole morph table (default: the fastest plan per range of device counts)."
    )
    top: Annotated[int, Opt(None)] = Field(default=10, ge=0, description="Candidates to show.")
    workers: Annotated[int | None, Opt(None)] = Field(
        default=None,
        description="Processes for the search (default: $PIPECTL_PLAN_WORKERS, else the cores available); the plan is "
        "the same for any number.",
    )

    profile: Annotated[list[str], Opt("model", cli=list[Path], path=True)] = Field(
        min_length=1,
        description="profile.json from `pipectl profile`. Repeat it with one profile per device kind of a "
        "heterogeneous cluster (measured or --derive'd on each): each kind is priced with its own; the first serves "
        "a kind without one, scaled by peak FLOP/s.",
    )
    cluster: Annotated[str, Opt("cluster", key="name", path=True)] = Field(
        description="A shipped cluster name (local, a100-8x8) or a YAML path."
    )
    calibration: Annotated[str | None, Opt("cluster", path=True)] = Field(
        default=None,
        description="A calibration of the cluster's GPUs (pipectl calibrate MEASURED.csv): its links for the "
        "node types of its device; a profile derived for that device must be derived with it (profile --derive "
        "--calibration).",
    )
    devices: Annotated[int | None, Opt("cluster")] = Field(
        default=None, gt=0, le=2**31, description="Plan for G devices (default: the whole cluster; a local cluster: its default)."
    )
    global_batch: Annotated[int, Opt("training")] = Field(
        gt=0, le=2**31, description="B: samples per optimizer step (never changed)."
    )

    objective: Annotated[Objective, Opt("plan")] = Field(default=Objective.TIME, description="time, cost or cost-deadline.")
    deadline_hours: Annotated[float | None, Opt("plan")] = Field(default=None, gt=0, description="cost-deadline: hours available.")
    samples: Annotated[str | None, Opt("plan")] = Field(
        default=None, description="cost-deadline: samples to train on (e.g. 150M)."
    )
    tokens: Annotated[str | None, Opt("plan")] = Field(
        default=None, description="cost-deadline: tokens to train on (e.g. 300B, 3e11; K, M, B, T decimal)."
    )
    schedules: Annotated[str | None, Opt("plan")] = Field(
        default=None,
        description=f"Comma list of {SCHEDULE_NAMES} (default: 1f1b, gpipe, interleaved, varuna; engine torch adds "
        "zb-h1 and zbv; 2bw only when listed).",
    )
    max_tensor_parallel: Annotated[int | None, Opt("plan")] = Field(default=None, gt=0, le=2**31, description="Largest t to try.")
    pipeline_parallel: Annotated[int | None, Opt("plan")] = Field(default=None, gt=0, le=2**31, description="Pin p.")
    tensor_parallel: Annotated[int | None, Opt("plan")] = Field(default=None, gt=0, le=2**31, description="Pin t.")
    data_parallel: Annotated[int | None, Opt("plan")] = Field(default=None, gt=0, le=2**31, description="Pin d.")
    micro_batch_size: Annotated[int | None, Opt("plan")] = Field(default=None, gt=0, le=2**31, description="Pin b.")
    schedule: Annotated[str | None, Opt("plan")] = Field(default=None, description="Pin the schedule.")
    recompute: Annotated[str | None, Opt("plan")] = Field(
        default=None,
        description="Recomputation the search may use: never; stage (none or re-run a stage's forward before its "
        "backward, every stage but the last); layer (none or per-layer activation checkpointing, every stage, p = 1 "
        "too); selective (none or recompute only each block's attention core: scores, softmax, attention over V); "
        "always (stage, layer or selective, never none); auto (all four, the default: memory and time decide).",
    )
    even_replicas: Annotated[bool, Opt("plan")] = Field(
        default=False,
        description="Only d x b dividing B. Default: when d does not divide B / b, replicas run the ceiling or floor "
        "of B / (d x b) micro-batches, gradients weighted by samples, so every device count has a plan.",
    )
    zero_stages: Annotated[str, Opt("plan")] = Field(
        default="1",
        description="ZeRO stages to try (0,1,2,3). Default 1: pipectl trains with ZeRO-1, the stage whose optimizer "
        "partitions its checkpoints hold and re-cut for resize; 2 and 3 at p = 1 only (DeepSpeed's pipeline engine "
        "refuses them; its ordinary engine trains them without a tensor split); ZeRO-0, and 2 and 3 with a tensor "
        "split, are planner-only (marked *, chosen only with --any-engine).",
    )
    memory_headroom: Annotated[float, Opt("plan")] = Field(
        default=0.05,
        ge=0.0,
        le=0.9,
        description="Fraction of each device's memory to keep free beyond what the memory model predicts (0.05: 5 %).",
    )
    engine: Annotated[Engine | None, Opt("plan")] = Field(
        default=None,
        description="What will run the plan: deepspeed (default; pipectl launch), torch (PyTorch's pipelining runtime: "
        "1f1b, gpipe, interleaved, zb-h1 and zbv without recompute, t = 1, d = 1, fp32; pipectl launch runs it too, "
        "same checkpoints, data and metrics), or any (choose the best, runnable or not). torch also searches zb-h1 and "
        "zbv (any: when listed in --schedules).",
    )
    emit: Annotated[Framework | None, Opt("plan")] = Field(
        default=None,
        description="Plan for another framework and write its settings beside plan.json (-o DIR: into DIR): megatron "
        "(megatron-args.sh), torchtitan (torchtitan.toml) or deepspeed (ds_config.json, ds_pipeline.py). The search "
        "keeps to the layouts that framework can run.",
    )
    emit_devices: Annotated[str | None, Opt("plan")] = Field(
        default=None,
        description="With --emit: also write the morph table's layouts for these device counts (12,64-66), each "
        "into devices-N/.",
    )
    morph: Annotated[bool, Opt("plan")] = Field(default=True, description="Compute the morph table (--no-morph: skip it).")
    morph_counts: Annotated[str | None, Opt("plan")] = Field(
        default=None,
        description="Device counts the morph table covers besides every count up to one node and whole nodes beyond: "
        "a comma list of counts and ranges (12,100-120), or all for every count (resize re-plans for a count the "
        "table lacks).",
    )

    @field_validator("profile", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        """A config file may name one profile as a string; flags give a list."""
        return [value] if isinstance(value, (str, Path)) else [str(v) for v in value] if isinstance(value, (list, tuple)) else value

    @field_validator("schedules", "zero_stages", "morph_counts", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        """A config file's list (`zero_stages = [1, 2]`) is the flag's comma list."""
        if isinstance(value, (list, tuple)):
            return ",".join(str(v) for v in value)
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("samples", "tokens", mode="before")
    @classmethod
    def _amount_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def plan_sections(plan: Plan, plan_dir: Path) -> dict[str, dict[str, Any]]:
    """The config-file keys with which `pipectl plan` searches again what made `plan` (read from
    `plan_dir`): its profiles (the copies plan.json keeps beside itself), cluster, global batch and
    search options, as plan.json recorded them, paths absolute. `launch --print-config` writes
    them beside the launch's own, so that one file re-plans and launches the job."""
    request = plan.request
    profiles = [
        str((plan_dir / ref.file).resolve()) if (plan_dir / ref.file).is_file() else ref.source
        for ref in (plan.profile, *plan.kind_profiles) if ref is not None
    ]
    profiles = [path for path in profiles if path]
    framework = request.framework
    search = {
        "objective": request.objective.value,
        "deadline_hours": request.deadline_hours,
        "samples": None if request.samples is None else str(request.samples),
        "tokens": None if request.tokens is None else str(request.tokens),
        "schedules": ",".join(kind.value for kind in request.schedules) if request.schedules else None,
        "max_tensor_parallel": request.max_tensor_parallel,
        "tensor_parallel": request.tensor_parallel,
        "pipeline_parallel": request.pipeline_parallel,
        "data_parallel": request.data_parallel,
        "micro_batch_size": request.micro_batch_size,
        "schedule": request.schedule.value if request.schedule else None,
        "recompute": request.recompute.value if request.allow_recompute else "never",
        "even_replicas": not request.uneven_replicas,
        "zero_stages": ",".join(str(zero) for zero in request.zero_stages),
        "memory_headroom": request.memory_headroom,
        # A framework's plan is for no engine of pipectl's (`plan.frameworks.framework_request`).
        "engine": None if framework is not None else request.engine.value,
        "emit": None if framework is None else framework.value,
        "morph": request.morph,
        "morph_counts": "all" if request.morph_every_count else ",".join(map(str, request.morph_counts)) or None,
    }
    sections = {
        "model": {"profile": profiles[0] if len(profiles) == 1 else profiles or None},
        "cluster": {"name": plan.cluster_file or plan.cluster, "calibration": plan.calibration_file, "devices": request.devices},
        "training": {"global_batch": request.global_batch},
        "plan": search,
    }
    return {name: {key: value for key, value in keys.items() if value is not None} for name, keys in sections.items()}


def check_together(options: PlanOptions) -> None:
    """A value another one makes meaningless is refused, not ignored (it would be believed to
    count): the amount to train on twice, the cost-deadline objective's figures under another
    objective, the whole morph table of a plan that computes none."""
    if options.samples is not None and options.tokens is not None:
        raise UserInputError(
            f"{given(options, 'samples')} and {given(options, 'tokens')} both say how much to train on: give one"
        )
    if options.objective is not Objective.COST_DEADLINE:
        for name in ("deadline_hours", "samples", "tokens"):
            if getattr(options, name) is not None:
                raise UserInputError(
                    f"{given(options, name)} is for the cost-deadline objective, but the objective is "
                    f"{options.objective.value}",
                    hint="add --objective cost-deadline, or leave it out",
                )
    if options.full_morph and not options.morph:
        raise UserInputError(f"{given(options, 'full_morph')} prints the morph table, which {given(options, 'morph')} skips")
