"""`pipectl plan`: the best configuration for these devices, and for every other count.

    pipectl plan --profile profile.json --cluster local --devices 2 --global-batch 16 -o plan.json
    pipectl plan --profile gpt1t.json --cluster a100-384x8 --global-batch 3072 --schedules 1f1b,gpipe
    pipectl plan ... --objective cost-deadline --deadline-hours 24 --tokens 300B
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipectl.artifacts.base import INT64_MAX
from pipectl.artifacts.plan import Engine, Objective, PlanRequest, RecomputeChoice
from pipectl.artifacts.profile import ModelProfile
from pipectl.cli.context import JsonFlag, OutputPath, console, from_options, print_json, refuse_overwriting
from pipectl.cluster import load_cluster, local_cluster
from pipectl.errors import UserInputError
from pipectl.io import load_model
from pipectl.paths import given_file
from pipectl.plan.search import plan
from pipectl.planfile import check_kind_profiles, write_plan
from pipectl.report.plan_table import plan_utilisations, plan_view
from pipectl.schedule import ScheduleKind


def parse_schedules(text: str | None) -> list[ScheduleKind] | None:
    """'1f1b,gpipe' -> [ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE]; unknown names are named."""
    if text is None:
        return None
    kinds = []
    for entry in text.split(","):
        kinds.append(parse_schedule(entry.strip()))
    return kinds


def parse_schedule(text: str) -> ScheduleKind:
    try:
        return ScheduleKind(text)
    except ValueError:
        known = ", ".join(k.value for k in ScheduleKind)
        raise UserInputError(f"unknown schedule '{text}'", hint=f"known schedules: {known}") from None


def parse_recompute(text: str | None, no_recompute: bool) -> RecomputeChoice:
    """`--recompute` (never, stage, layer, selective, always, auto; default auto); `--no-recompute`
    is `never`. A bad value, or `--no-recompute` beside another value, is named.

    >>> parse_recompute("layer", False).value, parse_recompute(None, True).value, parse_recompute(None, False).value
    ('layer', 'never', 'auto')
    >>> parse_recompute("Selective", False).value, parse_recompute("always", False).value
    ('selective', 'always')
    """
    known = ", ".join(choice.value for choice in RecomputeChoice)
    if text is None:
        return RecomputeChoice.NEVER if no_recompute else RecomputeChoice.AUTO
    try:
        choice = RecomputeChoice(text.strip().lower())
    except ValueError:
        raise UserInputError(f"unknown --recompute '{text}'", hint=f"known values: {known}") from None
    if no_recompute and choice is not RecomputeChoice.NEVER:
        raise UserInputError(f"--no-recompute contradicts --recompute {choice.value}", hint="give one of them")
    return choice


AMOUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}  # decimal: 300B tokens is 3e11


def parse_amount(text: str | None, name: str) -> int | None:
    """'300B', '1.5T', '3e11' or '300000000000' -> 300000000000 (K, M, B, T: thousand, million,
    billion, trillion, in either case); a bad number is named.

    >>> parse_amount("300B", "--tokens"), parse_amount("0.3b", "--tokens"), parse_amount("2e6", "--samples")
    (300000000000, 300000000, 2000000)
    """
    if text is None:
        return None
    number = text.strip().replace("_", "")
    scale = AMOUNT_SUFFIXES.get(number[-1:].lower(), 1)
    if scale != 1:
        number = number[:-1].rstrip()
    try:
        value = Decimal(number)
    except InvalidOperation:
        raise UserInputError(
            f"{name} '{text}' is not a number", hint=f"e.g. {name} 300B, {name} 3e11 (K, M, B, T: 10^3 .. 10^12)"
        ) from None
    if value.is_finite() and value.adjusted() > 30:  # 1e999999999: no scaling, no billion-digit int()
        raise UserInputError(f"{name} {text} does not fit a 64-bit integer")
    value *= scale
    if not value.is_finite() or value <= 0 or value != value.to_integral_value():
        raise UserInputError(f"{name} must be a positive whole number, got {text}")
    if value > INT64_MAX:
        raise UserInputError(f"{name} {text} does not fit a 64-bit integer")
    return int(value)


def plan_command(
    profile: Annotated[
        list[Path],
        typer.Option(
            "--profile",
            help="profile.json from `pipectl profile`. Repeat it with one profile per device kind of a "
            "heterogeneous cluster (measured or --derive'd on each): each kind is priced with its own; the first "
            "serves a kind without one, scaled by peak FLOP/s.",
        ),
    ],
    cluster: Annotated[str, typer.Option("--cluster", help="A shipped cluster name (local, a100-8x8) or a YAML path.")],
    global_batch: Annotated[int, typer.Option("--global-batch", help="B: samples per optimizer step (never changed).")],
    output: OutputPath = Path("plan.json"),
    objective: Annotated[Objective, typer.Option("--objective", help="time, cost or cost-deadline.")] = Objective.TIME,
    deadline_hours: Annotated[Optional[float], typer.Option("--deadline-hours", help="cost-deadline: hours available.")] = None,
    samples: Annotated[Optional[str], typer.Option("--samples", help="cost-deadline: samples to train on (e.g. 150M).")] = None,
    tokens: Annotated[Optional[str], typer.Option("--tokens", help="cost-deadline: tokens to train on (e.g. 300B, 3e11; K, M, B, T decimal).")] = None,
    schedules: Annotated[Optional[str], typer.Option("--schedules", help=f"Comma list of {', '.join(k.value for k in ScheduleKind)} (default: 1f1b, gpipe, interleaved, varuna; engine torch adds zb-h1; 2bw and zbv only when listed).")] = None,
    max_tensor_parallel: Annotated[Optional[int], typer.Option("--max-tensor-parallel", help="Largest t to try.")] = None,
    pipeline_parallel: Annotated[Optional[int], typer.Option("--pipeline-parallel", help="Pin p.")] = None,
    tensor_parallel: Annotated[Optional[int], typer.Option("--tensor-parallel", help="Pin t.")] = None,
    data_parallel: Annotated[Optional[int], typer.Option("--data-parallel", help="Pin d.")] = None,
    micro_batch_size: Annotated[Optional[int], typer.Option("--micro-batch-size", help="Pin b.")] = None,
    schedule: Annotated[Optional[str], typer.Option("--schedule", help="Pin the schedule.")] = None,
    devices: Annotated[Optional[int], typer.Option("--devices", help="Plan for G devices (default: the whole cluster; a local cluster: its default).")] = None,
    recompute: Annotated[
        Optional[str],
        typer.Option(
            "--recompute",
            help="Recomputation the search may use: never; stage (none or re-run a stage's forward before its "
            "backward, every stage but the last); layer (none or per-layer activation checkpointing, every stage, "
            "p = 1 too); selective (none or recompute only each block's attention core: scores, softmax, attention "
            "over V); always (stage, layer or selective, never none); auto (all four, the default: memory and "
            "time decide).",
        ),
    ] = None,
    no_recompute: Annotated[bool, typer.Option("--no-recompute", help="Never recompute activations (--recompute never).")] = False,
    even_replicas: Annotated[
        bool,
        typer.Option(
            "--even-replicas",
            help="Only d x b dividing B. Default: when d does not divide B / b, replicas run the ceiling or "
            "floor of B / (d x b) micro-batches, gradients weighted by samples, so every device count has a plan.",
        ),
    ] = False,
    zero_stages: Annotated[
        str,
        typer.Option(
            "--zero-stages",
            help="ZeRO stages to try (0,1,2,3). Default 1: pipectl trains with ZeRO-1, the stage whose "
            "optimizer partitions its checkpoints hold and re-cut for resize; 2 and 3 at p = 1 only (DeepSpeed's "
            "pipeline engine refuses them; its ordinary engine trains them without a tensor split); ZeRO-0, "
            "and 2 and 3 with a tensor split, are planner-only (marked *, chosen only with --any-engine).",
        ),
    ] = "1",
    memory_headroom: Annotated[
        float,
        typer.Option(
            "--memory-headroom", min=0.0, max=0.9,
            help="Fraction of each device's memory to keep free beyond what the memory model predicts (0.05: 5 %).",
        ),
    ] = 0.05,
    include_all: Annotated[bool, typer.Option("--all", help="Simulate and keep every feasible candidate, and list those no engine runs apart.")] = False,
    engine: Annotated[
        Optional[Engine],
        typer.Option(
            "--engine",
            help="What will run the plan: deepspeed (default; pipectl launch), torch (PyTorch's pipelining runtime: "
            "1f1b, gpipe, interleaved, zb-h1 without recompute, t = 1, d = 1, fp32; pipectl launch runs it too, "
            "same checkpoints, data and metrics), or any (choose the best, runnable or not). "
            "torch also searches zb-h1 (any: when listed in --schedules).",
        ),
    ] = None,
    any_engine: Annotated[bool, typer.Option("--any-engine", help="Same as --engine any: also choose schedules DeepSpeed cannot run and ZeRO stages pipectl's runtime does not train with.")] = False,
    no_morph: Annotated[bool, typer.Option("--no-morph", help="Skip the morph table.")] = False,
    full_morph: Annotated[bool, typer.Option("--morph-table", help="Print the whole morph table (default: the fastest plan per range of device counts).")] = False,
    top: Annotated[int, typer.Option("--top", help="Candidates to show.")] = 10,
    workers: Annotated[
        Optional[int],
        typer.Option("--workers", help="Processes for the search (default: $PIPECTL_PLAN_WORKERS, else the cores available); the plan is the same for any number."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Search t, p, d, b, v, schedule, recomputation and ZeRO stage; write plan.json."""
    refuse_overwriting(output, {**{f"--profile {path}": path for path in profile}, "--cluster file": cluster})
    profiles = [load_model(ModelProfile, path) for path in profile]
    check_kind_profiles([(str(path), p) for path, p in zip(profile, profiles)])
    cluster_spec = load_cluster(cluster)
    if cluster_spec.local and devices is not None:
        cluster_spec = local_cluster(devices, cluster_spec)
    try:
        zeros = [int(z) for z in zero_stages.split(",")]
    except ValueError:
        raise UserInputError(f"--zero-stages '{zero_stages}' is not a comma list of numbers") from None
    if any_engine and engine not in (None, Engine.ANY):
        raise UserInputError(f"--any-engine and --engine {engine.value} disagree", hint="give one of them")
    engine = Engine.ANY if any_engine else (engine or Engine.DEEPSPEED)
    request = from_options(
        PlanRequest,
        global_batch=global_batch,
        objective=objective,
        schedules=parse_schedules(schedules),
        max_tensor_parallel=max_tensor_parallel,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        data_parallel=data_parallel,
        micro_batch_size=micro_batch_size,
        schedule=parse_schedule(schedule) if schedule else None,
        devices=devices,
        deadline_hours=deadline_hours,
        samples=parse_amount(samples, "--samples"),
        tokens=parse_amount(tokens, "--tokens"),
        recompute=parse_recompute(recompute, no_recompute),
        uneven_replicas=not even_replicas,
        zero_stages=zeros,
        memory_headroom=memory_headroom,
        include_all=include_all,
        for_deepspeed=engine is Engine.DEEPSPEED,
        engine=engine,
        top=max(top, 1),
        morph=not no_morph,
        workers=workers,
    )
    made = plan(profiles[0], cluster_spec, request, kind_profiles=profiles[1:])
    cluster_path = given_file(cluster)  # a YAML by path: recorded absolute (`Plan.cluster_file`)
    result = write_plan(
        output,
        made.model_copy(update={"cluster_file": None if cluster_path is None else str(cluster_path)}),
        profile_file=profile[0],
        kind_profile_files=profile[1:],
    )
    if as_json:
        # The artifact, plus what plan.json does not keep: the chosen candidate's predicted MFU/HFU.
        payload = result.model_dump(mode="json")
        payload["flops"] = plan_utilisations(result, profiles[0], [result.chosen])[0].to_dict()
        print_json(payload)
        return
    console.print(plan_view(result, top=top, profile=profiles[0], every_candidate=include_all, full_morph=full_morph))
    console.print(f"wrote {output}", style="dim")


def register(app: typer.Typer) -> None:
    """Add `pipectl plan` to the root app."""
    app.command("plan")(plan_command)
