"""`pipectl plan`: the best configuration for these devices, and for every other count.

    pipectl plan --profile profile.json --cluster local --devices 2 --global-batch 16 -o plan.json
    pipectl plan --profile gpt1t.json --cluster a100-384x8 --global-batch 3072 --schedules 1f1b,gpipe
    pipectl plan ... --objective cost-deadline --deadline-hours 24 --tokens 300B
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any

import typer

from pipectl.artifacts.base import INT64_MAX
from pipectl.artifacts.calibration import RunsCalibration
from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.plan import Engine, Plan, PlanRequest, RecomputeChoice
from pipectl.artifacts.profile import ModelProfile
from pipectl.cli.context import (
    JsonFlag, console, err_console, from_options, into_folder, print_json, refuse_overwriting, refuse_overwriting_model,
)
from pipectl.cli.options import ConfigOption, file_layers, passed_flags, with_options
from pipectl.cluster import (
    calibrated_cluster, check_profiles_calibrated_alike, links_read, load_calibration_for, load_cluster, local_cluster,
)
from pipectl.config import Layer, given, layered, stored_layer
from pipectl.emit import emitted_files, emitted_layouts, fewer_devices_notes, write_files
from pipectl.errors import UserInputError
from pipectl.io import check_output_file, load_model
from pipectl.paths import given_file
from pipectl.plan.frameworks import framework_request
from pipectl.plan.options import PlanOptions, check_together, plan_sections
from pipectl.plan.search import plan
from pipectl.planfile import check_kind_profiles, check_plan_output, write_plan
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


# A range of counts wider than this is a typo, not a table (every count: --morph-counts all).
MAX_MORPH_RANGE = 1 << 20


def parse_morph_counts(text: str | None, flag: str = "--morph-counts", *, allow_all: bool = True) -> tuple[list[int], bool]:
    """`--morph-counts` (or another `flag` naming device counts): (the counts named, whether every
    count is); a bad entry is named, and `all` where `allow_all` is off.

    >>> parse_morph_counts("12, 100-102"), parse_morph_counts("all"), parse_morph_counts(None)
    (([12, 100, 101, 102], False), ([], True), ([], False))
    """
    if text is None:
        return [], False
    if text.strip().lower() == "all":
        if not allow_all:
            raise UserInputError(f"{flag} all: name the device counts", hint=f"e.g. {flag} 64,128")
        return [], True
    counts: set[int] = set()
    for entry in text.split(","):
        first, dash, last = entry.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise UserInputError(
                f"{flag} '{text}': '{entry.strip()}' is not a device count or a range",
                hint=f"e.g. {flag} 12,100-120" + (", or all" if allow_all else ""),
            ) from None
        if low < 1 or high < low or high - low > MAX_MORPH_RANGE:
            raise UserInputError(f"{flag} '{text}': '{entry.strip()}' is not a range of positive counts")
        counts.update(range(low, high + 1))
    return sorted(counts), False


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


def _parse_zero_stages(text: str) -> list[int]:
    """`--zero-stages`: '0,1' -> [0, 1]; anything else is named."""
    try:
        return [int(z) for z in text.split(",")]
    except ValueError:
        raise UserInputError(f"--zero-stages '{text}' is not a comma list of numbers") from None


# Not compared with the plan's: the profile and calibration (the plan keeps copies of the files it
# read, beside itself) and the cluster, which a launch reads itself (`LaunchOptions.cluster`).
NOT_COMPARED = ("profile", "calibration", "cluster")


def planned_otherwise(plan: Plan, plan_dir: Path, layer: Layer) -> list[tuple[str, str, Any, Any]]:
    """The keys of a config file (its `PlanOptions` layer) that `pipectl plan` would read otherwise
    than `plan` was made: (the option, where the file sets it, the file's value, the plan's), in the
    options' order. A launch runs the plan it is given and reads no planning key itself, so a file that asks
    for another pipeline depth, device count or schedule than its plan's would be silently ignored.
    Compared as the search reads them (`_as_searched`: "1f1b,gpipe" and ["1f1b", "gpipe"] are one
    list, 150M is 150000000). A plan whose own keys no longer validate (a profile gone, say) is
    compared by global batch only."""
    try:
        own = stored_layer(PlanOptions, plan_sections(plan, plan_dir), plan_dir / "plan.json")
        planned = layered(PlanOptions, [own])
    except UserInputError:
        batch = layer.values.get("global_batch")
        if batch is None or batch == plan.request.global_batch:
            return []
        return [("global_batch", layer.name("global_batch", None), batch, plan.request.global_batch)]
    asked = layered(PlanOptions, [own, layer])
    return [
        (name, layer.name(name, None), value, getattr(planned, name))
        for name, value in layer.values.items()
        if name not in NOT_COMPARED
        and _as_searched(name, getattr(asked, name)) != _as_searched(name, getattr(planned, name))
    ]


def _as_searched(name: str, value: Any) -> Any:
    """An option's value as the search reads it (`plan_command`'s parsing)."""
    if value is None:
        return None
    parse = {
        "schedules": parse_schedules,
        "zero_stages": _parse_zero_stages,
        "morph_counts": parse_morph_counts,
        "emit_devices": lambda text: parse_morph_counts(text, allow_all=False),
        "samples": lambda text: parse_amount(text, "--samples"),
        "tokens": lambda text: parse_amount(text, "--tokens"),
    }.get(name)
    return parse(value) if parse is not None else value


def _engine_and_emit_counts(options: PlanOptions, any_engine: bool) -> tuple[Engine, list[int]]:
    """The engine to plan for and the device counts `--emit-devices` names; `--emit` (a framework's
    own plan) beside an engine, or flags that contradict each other, are named."""
    engine = options.engine
    if options.emit is not None and (any_engine or engine not in (None, Engine.ANY)):
        raise UserInputError(
            f"{given(options, 'emit')} plans for that framework, not for an engine of pipectl's "
            f"({'--any-engine' if any_engine else given(options, 'engine')})",
            hint="give one of them",
        )
    if options.emit_devices is not None and options.emit is None:
        raise UserInputError("--emit-devices names layouts to write for --emit, which is not given")
    emit_counts, _ = parse_morph_counts(options.emit_devices, "--emit-devices", allow_all=False)
    if any_engine and engine not in (None, Engine.ANY):
        raise UserInputError(f"--any-engine and --engine {engine.value} disagree", hint="give one of them")
    return Engine.ANY if any_engine else (engine or Engine.DEEPSPEED), emit_counts


def _read_profiles(profile: list[Path], output: Path, options: PlanOptions, config: Path | None) -> list[ModelProfile]:
    """The profiles, read and checked together, once `output` is known to replace nothing a plan or
    this command needs: an input (the config file too), a run's file, the plan's profile copy, the
    model config."""
    check_output_file(output)
    refuse_overwriting(output, {**{f"--profile {path}": path for path in profile}, "--cluster file": options.cluster,
                                "--calibration file": options.calibration, "--config file": config}, writes="Plan")
    profiles = [load_model(ModelProfile, path) for path in profile]
    check_kind_profiles([(str(path), p) for path, p in zip(profile, profiles)])
    check_plan_output(output, profile)
    for path, read in zip(profile, profiles):  # not read here, but launch builds the model from it
        refuse_overwriting_model(output, read.model_reference, f"{path} was profiled from")
    return profiles


def _write_plan_files(
    output: Path, made: Plan, options: PlanOptions, profile: list[Path], model: ModelProfile, emit_counts: list[int],
    read: tuple[ClusterSpec, RunsCalibration | None],
) -> tuple[Plan, list[Path]]:
    """Write plan.json, and with `--emit` the framework's files beside it: the plan as written, and
    those files. `read`: the cluster file and the calibration as the plan read them, which it keeps."""
    cluster_path = given_file(options.cluster)  # a YAML by path: recorded absolute (`Plan.cluster_file`)
    calibration = None if options.calibration is None else str(Path(options.calibration).resolve())
    if options.emit is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
    result = write_plan(
        output,
        made.model_copy(update={"cluster_file": None if cluster_path is None else str(cluster_path),
                                "cluster_copy": None if cluster_path is None else read[0],
                                "links_copies": {} if cluster_path is None else links_read(read[0]),
                                "calibration_file": calibration, "calibration_copy": read[1]}),
        profile_file=profile[0],
        kind_profile_files=profile[1:],
    )
    written: list[Path] = []
    if options.emit is not None:
        files = emitted_files(result, output, options.emit, devices=emit_counts, profile=model)
        written = write_files(output.parent, files)
    return result, written


def _print_plan_json(result: Plan, model: ModelProfile, written: list[Path]) -> None:
    # The artifact, plus what plan.json does not keep: the chosen candidate's predicted MFU/HFU.
    payload = result.model_dump(mode="json")
    payload["flops"] = plan_utilisations(result, model, [result.chosen])[0].to_dict()
    if written:
        payload["emitted"] = [str(path) for path in written]
    print_json(payload)


@with_options(PlanOptions, after="config")
def plan_command(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Where to write plan.json; with --emit a folder for it and the framework's files.",
        parser=into_folder("plan.json"),
    )] = Path("plan.json"),
    config: ConfigOption = None,
    no_recompute: Annotated[bool, typer.Option("--no-recompute", help="Never recompute activations (--recompute never).")] = False,
    any_engine: Annotated[bool, typer.Option("--any-engine", help="Same as --engine any: also choose schedules DeepSpeed cannot run and ZeRO stages pipectl's runtime does not train with.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Search t, p, d, b, v, schedule, recomputation and ZeRO stage; write plan.json."""
    options = layered(PlanOptions, [*file_layers(PlanOptions, config), passed_flags(ctx, PlanOptions)])
    check_together(options)
    if options.emit is not None and output.suffix != ".json":
        output = output / "plan.json"  # -o DIR: plan.json and the framework's files in it
    profile = [Path(path) for path in options.profile]
    profiles = _read_profiles(profile, output, options, config)
    cluster_spec = read_cluster = load_cluster(options.cluster)
    calibration = None
    if cluster_spec.local and options.devices is not None:
        cluster_spec = local_cluster(options.devices, cluster_spec)
    named = [(str(path), p) for path, p in zip(profile, profiles)]
    if options.calibration is not None:
        calibration = load_calibration_for(options.calibration, named, cluster_spec, said=given(options, "calibration"))
        cluster_spec = calibrated_cluster(cluster_spec, calibration)
    else:
        check_profiles_calibrated_alike(named)
    zeros = _parse_zero_stages(options.zero_stages)
    engine, emit_counts = _engine_and_emit_counts(options, any_engine)
    morph_counts, morph_every_count = parse_morph_counts(options.morph_counts)
    for name, counts in (("morph_counts", morph_counts), ("emit_devices", emit_counts)):
        beyond = [n for n in counts if n > cluster_spec.total_devices]
        if beyond and cluster_spec.local:  # this machine: as many ranks as --devices asks
            raise UserInputError(
                f"{given(options, name)}: the plan is for {cluster_spec.total_devices} devices of this machine, not "
                f"{beyond[0]}", hint=f"plan for at least {max(beyond)}: --devices {max(beyond)}")  # fmt: skip
        if beyond:
            raise UserInputError(f"{given(options, name)}: cluster '{cluster_spec.name}' has "
                                 f"{cluster_spec.total_devices} devices, not {beyond[0]}")
    morph_counts = sorted(set(morph_counts) | set(emit_counts))  # the table covers every count to emit
    request = from_options(
        PlanRequest,
        global_batch=options.global_batch,
        objective=options.objective,
        schedules=parse_schedules(options.schedules),
        max_tensor_parallel=options.max_tensor_parallel,
        tensor_parallel=options.tensor_parallel,
        pipeline_parallel=options.pipeline_parallel,
        data_parallel=options.data_parallel,
        micro_batch_size=options.micro_batch_size,
        schedule=parse_schedule(options.schedule) if options.schedule else None,
        devices=options.devices,
        deadline_hours=options.deadline_hours,
        samples=parse_amount(options.samples, "--samples"),
        tokens=parse_amount(options.tokens, "--tokens"),
        recompute=parse_recompute(options.recompute, no_recompute),
        uneven_replicas=not options.even_replicas,
        zero_stages=zeros,
        memory_headroom=options.memory_headroom,
        include_all=options.include_all,
        for_deepspeed=engine is Engine.DEEPSPEED,
        engine=engine,
        top=max(options.top, 1),
        morph=options.morph,
        morph_counts=morph_counts,
        morph_every_count=morph_every_count,
        workers=options.workers,
    )
    if options.emit is not None:
        request = framework_request(request, options.emit, zero_stages_given="zero_stages" in options.model_fields_set)
        if not request.morph and emit_counts:
            raise UserInputError("--emit-devices writes rows of the morph table, which --no-morph skips")
    # A large search (thousands of GPUs, or a large batch on CPU ranks, whose blocking sends are
    # simulated action by action) takes seconds to minutes: say what runs, on a terminal only.
    with err_console.status(f"planning {profiles[0].model} on {cluster_spec.name}, global batch {options.global_batch:,}"):
        made = plan(profiles[0], cluster_spec, request, kind_profiles=profiles[1:])
    layouts = []
    if options.emit is not None:  # every layout to write is one the framework runs, before anything is written
        layouts = emitted_layouts(made, options.emit, profiles[0], emit_counts)
    result, written = _write_plan_files(output, made, options, profile, profiles[0], emit_counts, (read_cluster, calibration))
    if as_json:
        _print_plan_json(result, profiles[0], written)
        return
    console.print(
        plan_view(result, top=options.top, profile=profiles[0], every_candidate=options.include_all, full_morph=options.full_morph)
    )
    console.print(f"wrote {', '.join(map(str, [output, *written]))}", style="dim", markup=False)
    if calibration is not None:  # the figures are a cluster's fit, not the catalog's: say whose
        console.print(f"priced with the {calibration.device} links of {options.calibration} (fitted to "
                      f"{calibration.rows} {calibration.framework} runs)", style="dim", markup=False, highlight=False,
                      soft_wrap=True)
    for note in fewer_devices_notes(result, layouts):
        console.print(note, highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add `pipectl plan` to the root app."""
    app.command("plan")(plan_command)
