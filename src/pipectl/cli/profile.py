"""`pipectl profile`: measure or derive a model profile, calibrate links, show either.

    pipectl profile gpt-tiny -o profile.json                        # measure on this CPU
    pipectl profile gpt3-175b --device cuda -o p.json               # one block of each kind on one GPU
    pipectl profile gpt3-175b --derive --device a100-80gb -o p.json # derive from shape + datasheet
    pipectl profile gpt-small --device cuda --tensor-parallel 1,2,4,8  # + one rank's block shard per t
    pipectl profile examples.custom_model:build                     # a user factory
    pipectl profile links -o links.json --ranks 2                   # calibrate p2p and all-reduce
    pipectl profile show profile.json                               # Rich table (or --json)

`model` is the default sub-command: `pipectl profile MODEL` is `pipectl profile model MODEL`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipectl.artifacts.model import ModelFamily
from pipectl.artifacts.profile import LinksProfile, ModelProfile
from pipectl.catalog import get_device, load_catalog
from pipectl.cluster import usable_cores
from pipectl.cli.context import (
    JsonFlag, console, err_console, into_folder, output_file, print_json, refuse_overwriting,
)
from pipectl.cli.groups import DefaultCommandGroup
from pipectl.errors import UserInputError
from pipectl.io import load_model, parse_model, read_mapping, write_json_atomic, sha256_file
from pipectl.paths import FACTORY_FORM, HF_PREFIX, is_factory_reference, stored_reference
from pipectl.profile.derive import DEFAULT_SHARD_DEGREES, derive_profile, without_attention_core
from pipectl.profile.links import CalibrationRequest, calibrate_links
from pipectl.report.tables import links_view, profile_view
from pipectl.words import count

app = typer.Typer(
    cls=DefaultCommandGroup,
    no_args_is_help=True,
    help="Measure or derive a model profile, calibrate links, show a profile.\n\n"
    "pipectl profile MODEL -o profile.json [OPTIONS] runs the sub-command model (its options: pipectl profile "
    "model -h).",
)

_MEASURE_DEVICES = ("cpu", "cuda")


def parse_tensor_parallel(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]; any entry that is not a positive integer is named in the error."""
    degrees = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry.isdigit() or int(entry) <= 0:
            raise UserInputError(
                f"tensor-parallel degree '{entry}' in '{text}' is not a positive integer",
                hint="give a comma-separated list such as 1,2,4,8",
            )
        degrees.append(int(entry))
    return sorted(set(degrees))


def parse_micro_batch_sizes(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]; any entry that is not a positive integer is named in the error."""
    sizes = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry.isdigit() or int(entry) <= 0:
            raise UserInputError(
                f"micro-batch size '{entry}' in '{text}' is not a positive integer",
                hint="give a comma-separated list such as 1,2,4,8",
            )
        sizes.append(int(entry))
    return sorted(set(sizes))


_SIZE_RE = re.compile(r"^(\d+)\s*(b|k|kib|kb|m|mib|mb)?$", re.IGNORECASE)
_SIZE_UNITS = {None: 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1024, "m": 1024**2, "mib": 1024**2, "mb": 1024**2}


def parse_message_sizes(text: str) -> list[int]:
    """'1KiB,64KiB,1MiB' (or plain bytes, or 4k, 16m) -> sizes in bytes, ascending."""
    sizes = []
    for entry in text.split(","):
        match = _SIZE_RE.match(entry.strip())
        if not match or int(match.group(1)) <= 0:
            raise UserInputError(
                f"message size '{entry.strip()}' in '{text}' is not a positive size",
                hint="e.g. 1KiB,64KiB,1MiB or plain byte counts",
            )
        unit = match.group(2).lower() if match.group(2) else None
        sizes.append(int(match.group(1)) * _SIZE_UNITS[unit])
    if len(set(sizes)) < 2:  # a latency and a bandwidth are fitted to them: one size tells them apart from nothing
        raise UserInputError(f"--message-sizes '{text}' names one size; the fit of latency and bandwidth needs 2 or more",
                             hint="e.g. 1KiB,64KiB,1MiB")
    return sorted(set(sizes))


ModelArgument = Annotated[
    str,
    typer.Argument(
        help="A shipped model name (gpt-tiny), a model YAML path, a factory 'package.module:function' or a Hugging Face "
        "directory hf:PATH.",
        show_default=False,
    ),
]


@app.command("model")
def model_command(
    model: ModelArgument,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write profile.json.", callback=output_file,
                                                  parser=into_folder("profile.json"))] = Path(
        "profile.json"
    ),
    micro_batch_sizes: Annotated[
        str,
        typer.Option(
            "--micro-batch-sizes", "-b",
            help="Comma-separated micro-batch sizes (in any order; each measured once, smallest first).",
        ),
    ] = "1,2,4,8",
    device: Annotated[
        Optional[str],
        typer.Option(
            "--device",
            help="Measure on cpu (the default) or cuda; with --derive, the catalog device kind it models (e.g. "
            "a100-80gb, or cpu for this machine's cores).",
        ),
    ] = None,
    derive: Annotated[
        bool, typer.Option("--derive", help="Derive the profile from the model's shape and a device datasheet.")
    ] = False,
    device_kind: Annotated[
        Optional[str],
        typer.Option(
            "--device-kind",
            help="Catalog name of the device: what --derive models, or what a measured profile is recorded as (a "
            "device of the kind it is measured on).",
        ),
    ] = None,
    dtype: Annotated[
        Optional[str],
        typer.Option("--dtype", help="float32, bfloat16 or float16 (default: float32 measured; derived: bfloat16, float16 on devices without it)."),
    ] = None,
    attention: Annotated[
        Optional[str],
        typer.Option(
            "--attention",
            help="With --derive: the attention the blocks run, flash (fused, default) or unfused (s x s scores kept).",
        ),
    ] = None,
    calibration: Annotated[
        Optional[Path],
        typer.Option(
            "--calibration",
            help="With --derive: a calibration of the device (pipectl calibrate MEASURED.csv) whose GEMM efficiency "
            "and wave quantization, memory bandwidth and kernel overhead replace the catalog's.",
        ),
    ] = None,
    warmup: Annotated[int, typer.Option(help="Discarded runs per layer and size.")] = 2,
    repeats: Annotated[int, typer.Option(help="Timed runs per layer and size (the median is kept).")] = 5,
    threads: Annotated[
        int, typer.Option(help="CPU threads while measuring (1 = one pipeline rank with OMP_NUM_THREADS=1).")
    ] = 1,
    memory_budget_gib: Annotated[
        Optional[float],
        typer.Option(
            "--memory-budget-gib",
            help="CPU only: stop at the first size whose estimated memory exceeds this "
            "(default: the catalog's per-rank memory of the device kind).",
        ),
    ] = None,
    links: Annotated[
        Optional[Path], typer.Option("--links", help="A links.json (pipectl profile links) to embed.")
    ] = None,
    once: Annotated[
        Optional[bool],
        typer.Option(
            "--once/--every-layer",
            help="Measure one instance of each distinct layer and reuse its costs for the identical ones "
            "(builds only those; needed for shape-only models), or measure every layer "
            "(default: --once on cuda, --every-layer on cpu).",
            show_default=False,
        ),
    ] = None,
    tensor_parallel: Annotated[
        Optional[str],
        typer.Option(
            "--tensor-parallel",
            help="Tensor-parallel degrees whose one-rank block shards to profile too, e.g. 1,2,4,8 (measured: "
            "each shard timed on this device without its all-reduces; each t must divide the heads). "
            "Default: none measured (t = 1 only); 2,4,8,16 derived (those dividing the heads).",
            show_default=False,
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Profile MODEL layer by layer (measured here, or derived with --derive) and write profile.json."""
    refuse_overwriting(output, {"model config": model, "--links file": links, "--calibration file": calibration},
                       writes="ModelProfile")
    sizes = parse_micro_batch_sizes(micro_batch_sizes)
    degrees = parse_tensor_parallel(tensor_parallel) if tensor_parallel is not None else None
    links_profile = _load_links(links) if links is not None else None
    if attention is not None and not derive:
        raise UserInputError(
            f"--attention {attention} applies to --derive only", hint="a measured profile runs the model's own attention"
        )
    if calibration is not None and not derive:
        raise UserInputError(
            "--calibration applies to --derive only", hint="a measured profile is measured on the device itself"
        )
    if derive and device is None and device_kind is None:
        raise UserInputError(
            "--derive models a catalog device: name it with --device",
            hint=f"e.g. pipectl profile {model} --derive --device a100-80gb (cpu: this machine's cores)",
        )
    if derive and device_kind is not None and device not in (None, device_kind):
        raise UserInputError(
            f"--device {device} and --device-kind {device_kind} name two devices to derive for",
            hint=f"give one of them: pipectl profile {model} --derive --device {device_kind} (or {device})",
        )
    if derive:
        profile = _derive(model, device_kind or device, sizes, dtype, attention or "flash", degrees, calibration)
    else:
        profile = _measure(model, device or "cpu", device_kind, sizes, dtype or "float32", warmup, repeats, threads,
                           memory_budget_gib, once, degrees or [])
    # The reference resolved once, now (a YAML path or a Hugging Face directory made absolute), so
    # that launch, its ranks and a resize build the same model from wherever they run.
    profile = profile.model_copy(update={"model_reference": stored_reference(model)})
    if links_profile is not None:
        profile = profile.model_copy(update={"links": links_profile})
    write_json_atomic(output, profile)
    if as_json:
        print_json(profile)
    else:
        console.print(profile_view(profile, every_layer=once is False))  # --every-layer: shown so too
    err_console.print(f"wrote {output}", highlight=False, markup=False)


def _derivable_config(model: str):
    """The shape a derived profile is made from: a built-in name or YAML, or an hf: directory."""
    if model.startswith(HF_PREFIX):
        from pipectl.models.hf import model_config  # transformers reads the config

        return model_config(model)
    if ":" in model and not Path(model).exists() and not model.endswith((".yaml", ".yml")):
        if not is_factory_reference(model):
            raise UserInputError(f"model reference '{model}' is not 'package.module:function'", hint=FACTORY_FORM)
        raise UserInputError(
            f"cannot derive a profile for the factory '{model}': derived profiles need a model config",
            hint="derive a built-in gpt, bert or mlp config or an hf:PATH model, or measure the factory's model: "
            f"pipectl profile {model}",
        )
    from pipectl.models.registry import load_model_config  # torch: only when deriving

    return load_model_config(model)


def _derive(model: str, kind: str, sizes: list[int], dtype: str | None, attention: str, degrees: list[int] | None,
            calibration_file: Path | None = None):  # fmt: skip
    if kind == "cuda" or kind.startswith("cuda:"):
        raise UserInputError(
            f"--derive needs a catalog device kind, got '{kind}'",
            hint="e.g. pipectl profile gpt3-175b --derive --device a100-80gb",
        )
    device = get_device(kind)
    note = None
    if calibration_file is not None:
        from pipectl.measured.runs import load_calibration

        calibration = load_calibration(calibration_file)
        if calibration.device != device.name:
            raise UserInputError(
                f"{calibration_file} calibrates {calibration.device}, not {device.name}",
                hint=f"derive for --device {calibration.device}, or calibrate with runs on {device.name}",
            )
        if not device.has_compute_model():  # the figures would replace nothing the derivation reads
            raise UserInputError(f"{calibration_file} calibrates {device.name}, which has no kernel-model figures in "
                                 "the catalog: nothing of it would apply")  # fmt: skip
        device = calibration.terms.device_spec(device)
        note = calibration.device_note(calibration_file)
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise UserInputError(f"unknown dtype '{dtype}'", hint="choose one of: float32, bfloat16, float16")
    config = _derivable_config(model)
    if degrees is not None and any(t > 1 for t in degrees):
        if config.family not in (ModelFamily.GPT, ModelFamily.BERT):
            raise UserInputError(f"model '{model}' has no transformer blocks to split over tensor-parallel ranks")
        bad = [t for t in degrees if config.heads % t or (config.kv_heads or config.heads) % t]
        if bad:
            raise UserInputError(
                f"tensor-parallel degree {bad[0]} does not divide the {config.heads} attention heads of '{model}'"
            )
    profile = derive_profile(config, device, sizes, dtype, attention,
                             tensor_parallel=DEFAULT_SHARD_DEGREES if degrees is None else degrees)  # fmt: skip
    if note is not None:
        profile = profile.model_copy(update={"notes": [*profile.notes, note], "calibration_sha256": sha256_file(calibration_file)})
    if model.startswith(HF_PREFIX):
        # Its blocks are Hugging Face's, which the runtime cannot recompute selectively.
        profile = without_attention_core(profile)
    return profile


def _measure(
    model: str,
    device: str,
    device_kind: str | None,
    sizes: list[int],
    dtype_text: str,
    warmup: int,
    repeats: int,
    threads: int,
    memory_budget_gib: float | None,
    once: bool | None,
    degrees: list[int],
):
    # torch: only when measuring, so the CLI starts without it
    from pipectl.models import build_model
    from pipectl.models.layer_facts import check_tensor_parallel
    from pipectl.profile.measure import parse_dtype, profile_model, resolve_device, with_runtime_costs

    catalog = load_catalog()
    if device in catalog and catalog[device].accelerator != "cpu":
        # A catalog GPU is a datasheet here, not a device to time on: its profile is derived.
        raise UserInputError(
            f"--device {device} is a catalog device, not one on this host to measure on",
            hint=f"derive its profile from the model's shape: pipectl profile {model} --derive --device {device}",
        )
    torch_device = resolve_device(device)  # before building: a bad device fails fast
    recorded = catalog.get(device_kind) if device_kind is not None else None
    if recorded is not None and recorded.accelerator != torch_device.type:
        # Times measured here would be planned with as that device's: an A100 priced at a CPU's speed.
        raise UserInputError(
            f"--device-kind {device_kind} is a {recorded.accelerator} device, and this profile is measured on "
            f"{torch_device.type}",
            hint=f"measure on the device itself (--device cuda on its host), or derive its profile: pipectl profile "
            f"{model} --derive --device {device_kind}",
        )
    dtype = parse_dtype(dtype_text)
    if threads < 1:
        raise UserInputError(f"--threads must be at least 1, got {threads}")
    if memory_budget_gib is not None and memory_budget_gib <= 0:
        raise UserInputError(f"--memory-budget-gib must be positive, got {memory_budget_gib}")
    kind = device_kind or ("cpu" if torch_device.type == "cpu" else "cuda")
    if device_kind is not None or torch_device.type == "cpu":
        budget_bytes = _memory_budget_bytes(kind, memory_budget_gib, required=device_kind is not None)
    else:
        budget_bytes = None
    layers = build_model(model, allow_shape_only=True)  # a shape-only model: one layer at a time (--once)
    shard_degrees = check_tensor_parallel(layers, degrees)  # before measuring: a bad t fails fast
    shard_cells = len(shard_degrees) * sum(layer.kind == "transformer_block" for layer in layers.layers)

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,  # piped or logged: no bar, and no blank line where it was
    ) as bar:
        task = bar.add_task(f"[bold]profiling[/] {layers.name}", total=(len(layers) + shard_cells) * len(sizes))

        def on_progress(update) -> None:
            bar.update(
                task,
                completed=update.done,
                total=update.total,
                description=f"[bold]profiling[/] {layers.name}: {update.layer} at b={update.micro_batch_size}",
            )

        measured = profile_model(
            layers,
            sizes,
            device=device,
            warmup=warmup,
            repeats=repeats,
            dtype=dtype,
            progress=on_progress,
            memory_budget_bytes=budget_bytes,
            cpu_threads=threads,
            device_name=kind,
            once=once,
            tensor_parallel=shard_degrees,
            runtime=False,
        )
        # The engine calibration takes seconds (about 15 on a CPU) with the layer bar full: say so.
        where = "this host" if torch_device.type == "cpu" else str(torch_device)
        calibrating = f"calibrating the training engine on {where}…"
        bar.update(task, description=f"[bold]profiled[/] {layers.name}'s layers")
        bar.add_task(calibrating, total=None)
        if not err_console.is_terminal:  # no live bar: a line, so a log shows where the time went
            err_console.print(calibrating, highlight=False)
        return with_runtime_costs(measured, layers, torch_device, dtype, seed=0)


def _memory_budget_bytes(kind: str, memory_budget_gib: float | None, *, required: bool) -> int | None:
    """The CPU memory budget: the option, else the catalog's per-rank memory for `kind`."""
    if memory_budget_gib is not None:
        return int(memory_budget_gib * 1024**3)
    if required:
        return get_device(kind).memory_bytes
    spec = load_catalog().get(kind)
    return spec.memory_bytes if spec is not None else None


# Beyond this many ranks a core, a CPU link calibration times the scheduler, not the links.
LINK_RANKS_PER_CORE = 4


def _most_link_ranks(device: str) -> int:
    """The most ranks `profile links` starts on this machine: a few a core, or one a GPU."""
    if device == "cpu":
        return max(2, LINK_RANKS_PER_CORE * usable_cores())
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _load_links(path: Path):
    return load_model(LinksProfile, path)


@app.command("links")
def links_command(
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write links.json.", callback=output_file,
                                                  parser=into_folder("links.json"))] = Path("links.json"),
    ranks: Annotated[int, typer.Option("--ranks", help="Processes to start; all-reduce rings of 2..ranks.")] = 2,
    message_sizes: Annotated[
        str, typer.Option("--message-sizes", help="Comma-separated sizes (1KiB, 64KiB, 16MiB or bytes).")
    ] = "1KiB,4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB",
    device: Annotated[str, typer.Option("--device", help="cpu (gloo) or cuda (nccl, one GPU per rank).")] = "cpu",
    device_kind: Annotated[
        Optional[str], typer.Option("--device-kind", help="Catalog name recorded in links.json (default: cpu/cuda).")
    ] = None,
    warmup: Annotated[int, typer.Option(help="Discarded operations per size.")] = 3,
    repeats: Annotated[int, typer.Option(help="Timed operations per size (the median is kept).")] = 10,
    timeout: Annotated[float, typer.Option(help="Seconds before the calibration is abandoned.")] = 120.0,
    as_json: JsonFlag = False,
) -> None:
    """Calibrate point-to-point and all-reduce costs between real processes and write links.json."""
    refuse_overwriting(output, {}, writes="LinksProfile")
    if device not in _MEASURE_DEVICES:
        raise UserInputError(f"unknown device '{device}' for link calibration", hint="use cpu or cuda")
    if ranks < 2:
        raise UserInputError(f"--ranks must be at least 2, got {ranks}")
    most = _most_link_ranks(device)
    if ranks > most:
        where = (f"{most} on its {count(usable_cores(), 'usable core')}, {LINK_RANKS_PER_CORE} a core" if device == "cpu"
                 else f"one per GPU, {most} here")
        raise UserInputError(f"--ranks {ranks} is more processes than this machine can calibrate links with ({where})")
    if timeout <= 0:
        raise UserInputError(f"--timeout must be positive, got {timeout}")
    request = CalibrationRequest(
        ranks=ranks,
        message_sizes=tuple(parse_message_sizes(message_sizes)),
        warmup=warmup,
        repeats=repeats,
        backend="gloo" if device == "cpu" else "nccl",
        timeout_seconds=timeout,
    )
    with err_console.status(f"calibrating links between {ranks} {device} processes ({request.backend})"):
        links = calibrate_links(request, device_name=device_kind or device)
    write_json_atomic(output, links)
    if as_json:
        print_json(links)
    else:
        console.print(links_view(links))
        console.print("[dim]note: all ranks ran on this machine, so these are intra_node figures[/]")
    err_console.print(f"wrote {output}", highlight=False, markup=False)


@app.command("show")
def show_command(
    path: Annotated[Path, typer.Argument(help="A profile.json or links.json.", show_default=False)],
    micro_batch_sizes: Annotated[
        Optional[str], typer.Option("--micro-batch-sizes", "-b", help="Only these sizes (comma-separated).")
    ] = None,
    every_layer: Annotated[
        bool, typer.Option("--every-layer", help="A row group per layer (default: identical layers as one, with their count).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Print a profile.json or links.json as a table (or as JSON)."""
    data = read_mapping(path)
    artifact_type = LinksProfile if "fits" in data and "layers" not in data else ModelProfile
    artifact = parse_model(artifact_type, data, source=str(path))
    if as_json:
        print_json(artifact)
        return
    if isinstance(artifact, LinksProfile):
        console.print(links_view(artifact))
        return
    sizes = parse_micro_batch_sizes(micro_batch_sizes) if micro_batch_sizes else None
    if sizes:
        missing = [b for b in sizes if b not in artifact.micro_batch_sizes]
        if missing:
            raise UserInputError(
                f"{path} has no costs for micro-batch size {missing[0]}",
                hint=f"profiled sizes: {', '.join(map(str, artifact.micro_batch_sizes))}",
            )
    console.print(profile_view(artifact, sizes, every_layer=every_layer))
