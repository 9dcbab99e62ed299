"""`pipectl launch`: a plan -> a validated DeepSpeed config, a run directory, a real launcher command.

    prepared = prepare_launch(plan, "runs/demo", LaunchOptions(steps=20, checkpoint_every=5))
    exit_code = run_engine(prepared.command, prepared.run_dir)

Everything that can be checked is checked before any process starts: the model builds and has the
plan's layer count, the schedule is runnable in DeepSpeed's engine, the global batch is kept, and
DeepSpeed's own parser accepts the config (`dsconfig`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipectl import __version__
from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import DataSpec, ElasticRange, Engine, JobSpec, Precision
from pipectl.errors import UserInputError
from pipectl.runtime.dsconfig import DEFAULT_LEARNING_RATE, validated_config
from pipectl.launch.engines import LaunchCommand, build_command, run_engine
from pipectl.launch.rundir import is_run_dir, prepare_run_dir, write_run_files
from pipectl.runtime.checkpoint import resume_point
from pipectl.runtime.dsinit import free_port
from pipectl.planfile import plan_profile_path

__all__ = ["LaunchOptions", "PreparedLaunch", "build_job", "prepare_launch", "run_engine"]


@dataclass(frozen=True)
class LaunchOptions:
    """What the user chose besides the plan (CLI flags)."""

    engine: Engine = Engine.LOCAL
    model: str | None = None  # default: the plan's model
    steps: int = 20
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    seed: int = 0
    data: DataSpec = field(default_factory=DataSpec)
    precision: Precision = Precision.FP32
    learning_rate: float = DEFAULT_LEARNING_RATE
    elastic: ElasticRange | None = None
    nodes: int = 1
    hosts: list[str] | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    resume: bool = False
    force: bool = False


@dataclass(frozen=True)
class PreparedLaunch:
    run_dir: Path
    plan: Plan
    job: JobSpec
    ds_config: dict[str, Any]
    command: LaunchCommand


def check_model(plan: Plan, model_reference: str) -> None:
    """The model must build here and be the one the plan was made for: the same layers with the
    same parameters (the cut indexes them, the memory figures count them) and the same shape."""
    from pipectl.models import build_model  # torch: only when launching
    from pipectl.models.base import shape_of

    model = build_model(model_reference)
    built = shape_of(model)
    counts = built.layer_parameter_counts
    expected = plan.model_shape
    hint = "plan from a profile of this model, or pass the matching --model"
    if len(counts) != expected.layers:
        raise UserInputError(
            f"model '{model_reference}' has {len(counts)} layers but the plan cuts {expected.layers}", hint=hint
        )
    for name in ("seq_len", "hidden", "vocab"):
        found, planned = getattr(built, name), getattr(expected, name)
        if found is not None and planned is not None and found != planned:
            raise UserInputError(
                f"model '{model_reference}' has {name.replace('_', ' ')} {found}, the plan was made for {planned}",
                hint=hint,
            )
    for index, (found, planned) in enumerate(zip(counts, expected.layer_parameter_counts)):
        if found != planned:
            raise UserInputError(
                f"model '{model_reference}' layer {index} ({model.layers[index].name}) has {found:,} parameters, "
                f"the plan was made for {planned:,} (model: {built.parameter_count:,} parameters, plan: "
                f"{expected.parameter_count:,})",
                hint=hint,
            )


def build_job(plan: Plan, name: str, options: LaunchOptions) -> JobSpec:
    """job.json for `plan.chosen` under `options`."""
    devices = plan.chosen.devices
    nodes = options.elastic.min_nodes if options.elastic else options.nodes
    if options.hosts:
        nodes = len(options.hosts)
    if devices % nodes:
        raise UserInputError(f"the plan's {devices} ranks cannot be split evenly over {nodes} nodes")
    if options.engine is Engine.LOCAL and nodes != 1:
        raise UserInputError(
            f"the local engine runs on this machine only, not {nodes} nodes", hint="use --engine torchrun"
        )
    if options.data.path is not None and not Path(options.data.path).is_file():
        raise UserInputError(f"data file not found: {options.data.path}")
    if options.checkpoint_every > options.steps:
        raise UserInputError(
            f"--checkpoint-every {options.checkpoint_every} exceeds --steps {options.steps}",
            hint="the run checkpoints at the end anyway; use a smaller K or 0",
        )
    return JobSpec(
        name=name,
        model=options.model or plan.model,
        steps=options.steps,
        checkpoint_every=options.checkpoint_every,
        keep_checkpoints=options.keep_checkpoints,
        seed=options.seed,
        data=options.data,
        engine=options.engine,
        world_size=devices,
        nodes=nodes,
        ranks_per_node=devices // nodes,
        master_addr=options.master_addr,
        master_port=options.master_port or free_port(),
        precision=options.precision,
        elastic=options.elastic,
        pipectl_version=__version__,
    )


def prepare_launch(
    plan: Plan,
    run_dir: str | os.PathLike[str],
    options: LaunchOptions,
    *,
    plan_dir: str | os.PathLike[str] | None = None,
    write: bool = True,
) -> PreparedLaunch:
    """Validate everything, then (unless `write=False`, a dry run) create the run directory.

    `plan_dir` is where plan.json was read from: its profile copy goes into the run directory too,
    so a resize can re-plan from it (default: the run directory, which holds it when resuming).
    """
    path = Path(run_dir).resolve()
    job = build_job(plan, path.name, options)
    check_model(plan, job.model)
    if plan.profile is not None:  # present and unchanged, before anything is written
        plan_profile_path(path if plan_dir is None else plan_dir, plan)
    ds_config = validated_config(
        plan, precision=options.precision, learning_rate=options.learning_rate
    )
    command = build_command(job, path, hosts=options.hosts)
    if options.resume and is_run_dir(path) and resume_point(path)[0] is None:
        raise UserInputError(
            f"cannot resume {path}: it has no checkpoint, so it would start over from step 0",
            hint="start over deliberately with --force",
        )
    if write:
        prepare_run_dir(path, resume=options.resume, force=options.force)
        write_run_files(path, plan=plan, job=job, ds_config=ds_config, command=command, plan_dir=plan_dir)
    return PreparedLaunch(path, plan, job, ds_config, command)
