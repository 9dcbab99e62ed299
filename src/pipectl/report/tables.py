"""Rich tables for profiles (profile.json) and link calibrations (links.json).

Functions here build renderables and return them; the CLI prints them. Nothing here measures.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from pipectl.artifacts.profile import LayerProfile, LinksProfile, ModelProfile, ProfileSource, RuntimeCosts
from pipectl.words import count


def format_bytes(count: float) -> str:
    """Binary units, 3 significant digits: 1536 -> '1.5 KiB', 0 -> '0 B'.

        >>> format_bytes(0), format_bytes(1536), format_bytes(1034240), format_bytes(3 * 1024**3)
        ('0 B', '1.5 KiB', '1010 KiB', '3 GiB')
    """
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value = float(count)
    unit = units[0]
    for unit in units:
        if abs(value) < 1024 or unit == units[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 1000 else f"{value:.3g} {unit}"


def format_count(count: float) -> str:
    """Parameters and similar counts: 318464 -> '318.5 k', 175e9 -> '175.0 G'.

        >>> format_count(999), format_count(318464), format_count(175e9)
        ('999', '318.5 k', '175.0 G')
    """
    for threshold, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= threshold:
            return f"{count / threshold:.1f} {suffix}"
    return f"{int(count)}"


def format_seconds_ms(seconds: float) -> str:
    """Milliseconds, 3 decimals below 1 ms, 3-4 significant digits above.

        >>> format_seconds_ms(0.0000251), format_seconds_ms(0.0031), format_seconds_ms(0.01234), format_seconds_ms(1.5)
        ('0.025', '3.10', '12.3', '1500')
    """
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def profile_summary(profile: ModelProfile) -> Text:
    """One header line: model, source, device, dtype, parameters, sizes, and what did not fit."""
    parts = [
        f"[bold]{profile.model}[/]",
        # derived: from the model's shape and the device's datasheet, nothing measured
        f"{profile.source.value} {'for' if profile.source is ProfileSource.DERIVED else 'on'} {profile.device}",
        profile.dtype,
        f"{format_count(profile.parameter_count)} parameters",
        count(len(profile.layers), "layer"),
        "b " + ", ".join(str(b) for b in profile.micro_batch_sizes),
    ]
    if profile.not_fitting_micro_batch_size is not None:
        parts.append(f"[yellow]b={profile.not_fitting_micro_batch_size} does not fit[/]")
    return Text.from_markup(" · ".join(parts))


def identical_runs(profile: ModelProfile) -> list[list[LayerProfile]]:
    """The profile's layers in runs of consecutive identical ones (same kind, parameters, costs and
    shards: GPT-3's 96 blocks are one run), each other layer a run of its own."""
    runs: list[list[LayerProfile]] = []
    for layer in profile.layers:
        if runs and _same_figures(runs[-1][0], layer):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def _same_figures(a: LayerProfile, b: LayerProfile) -> bool:
    ignored = {"index", "name", "costs_from"}
    return a.model_dump(exclude=ignored) == b.model_dump(exclude=ignored)


def _run_name(run: Sequence[LayerProfile]) -> str:
    """'embed'; 'block.0–95 ×96' for a run of identical layers."""
    if len(run) == 1:
        return run[0].name
    first, last = run[0].name, run[-1].name
    stem, dot, _ = first.rpartition(".")
    last_index = last.rpartition(".")[2] if dot and last.startswith(stem + ".") else last
    return f"{first}–{last_index} ×{len(run)}"


def profile_table(
    profile: ModelProfile, micro_batch_sizes: Sequence[int] | None = None, *, every_layer: bool = False
) -> Table:
    """Per layer and per micro-batch size: forward/backward ms, output and saved bytes; then totals.

    Identical consecutive layers are one row group named with their count (`identical_runs`),
    unless `every_layer`. The totals row per size sums times and saved bytes over all layers (a
    one-stage pipeline), and counts shared parameters once. Tensor-parallel shards are in
    `shard_table`.
    """
    sizes = list(micro_batch_sizes) if micro_batch_sizes else list(profile.micro_batch_sizes)
    table = Table(
        header_style="bold", box=box.SIMPLE_HEAD, show_edge=False,  # the summary line above names it
        caption=(
            "* tied: shares parameters with the other layers of its group, counted once"
            if any(layer.shared_group for layer in profile.layers)
            else None
        ),
        caption_justify="left",
    )
    # The figures never wrap; in a narrow terminal a run's name does ("block.0–95" over "×96").
    table.add_column("layer", overflow="fold")
    table.add_column("params", justify="right", no_wrap=True)
    for heading in ("b", "fwd ms", "bwd ms", "output", "saved", "peak mem"):
        table.add_column(heading, justify="right", no_wrap=True)
    runs = [[layer] for layer in profile.layers] if every_layer else identical_runs(profile)
    for run in runs:
        layer = run[0]
        params = format_bytes(layer.parameter_bytes)
        if layer.shared_group:
            params = f"*{params}"
        costs = [c for c in layer.costs if c.micro_batch_size in sizes]
        for position, cost in enumerate(costs):
            table.add_row(
                _run_name(run) if position == 0 else "",
                params if position == 0 else "",
                str(cost.micro_batch_size),
                format_seconds_ms(cost.forward_seconds),
                format_seconds_ms(cost.backward_seconds),
                format_bytes(cost.output_activation_bytes),
                format_bytes(cost.saved_activation_bytes),
                format_bytes(cost.peak_memory_bytes),
                end_section=len(costs) > 1 and position == len(costs) - 1,
            )
    unique_parameter_bytes = _unique_parameter_bytes(profile)
    for position, size in enumerate(s for s in sizes if s in profile.micro_batch_sizes):
        costs = [layer.cost(size) for layer in profile.layers]
        table.add_row(
            "[bold]total[/]" if position == 0 else "",
            format_bytes(unique_parameter_bytes) if position == 0 else "",
            str(size),
            format_seconds_ms(sum(c.forward_seconds for c in costs)),
            format_seconds_ms(sum(c.backward_seconds for c in costs)),
            "",
            format_bytes(sum(c.saved_activation_bytes for c in costs)),
            "",
            style="bold",
        )
    return table


def shard_tables(profile: ModelProfile, micro_batch_sizes: Sequence[int] | None = None) -> list[Table]:
    """Per distinct layer that splits over tensor ranks: one rank's shard per degree t (t = 1: the
    whole layer) as columns, forward / backward ms per micro-batch size as rows, the shard's
    parameters in the header."""
    sizes = list(micro_batch_sizes) if micro_batch_sizes else list(profile.micro_batch_sizes)
    tables = []
    for run in identical_runs(profile):
        layer = run[0]
        if not layer.shards:
            continue
        table = Table(
            title=f"{_run_name(run)}: one tensor rank's shard, forward / backward ms", title_justify="left",
            header_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
        )  # fmt: skip
        table.add_column("b", justify="right", no_wrap=True)
        shards = [(1, layer.parameter_bytes, layer.costs)] + [
            (shard.tensor_parallel, shard.parameter_bytes, shard.costs) for shard in layer.shards
        ]
        for t, held, _ in shards:
            table.add_column(f"t={t} {format_bytes(held)}", justify="right", no_wrap=True)  # as narrow as its cells
        for size in sizes:
            cells = []
            for _, _, costs in shards:
                cost = next((c for c in costs if c.micro_batch_size == size), None)
                cells.append("-" if cost is None else
                             f"{format_seconds_ms(cost.forward_seconds)} / {format_seconds_ms(cost.backward_seconds)}")  # fmt: skip
            table.add_row(str(size), *cells)
        tables.append(table)
    return tables


def _unique_parameter_bytes(profile: ModelProfile) -> int:
    """Parameter bytes of the model with each shared group counted once."""
    seen: set[str] = set()
    total = 0
    for layer in profile.layers:
        total += layer.parameter_bytes
        if layer.shared_group:
            if layer.shared_group in seen and layer.parameter_count:
                total -= layer.parameter_bytes * layer.shared_parameter_count // layer.parameter_count
            seen.add(layer.shared_group)
    return total


def links_fit_table(links: LinksProfile) -> Table:
    """The fitted model per link class."""
    table = Table(
        title=f"links ({links.backend}, {links.device})", title_justify="left", header_style="bold",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("link class")
    table.add_column("p2p latency µs", justify="right")
    table.add_column("p2p bandwidth GB/s", justify="right")
    table.add_column("p2p jitter µs", justify="right")
    table.add_column("all-reduce α µs", justify="right")
    table.add_column("all-reduce bandwidth GB/s", justify="right")
    for fit in links.fits:
        table.add_row(
            fit.link_class.value,
            f"{fit.p2p_latency_seconds * 1e6:.1f}",
            f"{fit.p2p_bandwidth_bytes_per_second / 1e9:.3g}",
            f"{fit.p2p_jitter_seconds * 1e6:.1f}",
            f"{fit.allreduce_latency_seconds * 1e6:.1f}",
            f"{fit.allreduce_bandwidth_bytes_per_second / 1e9:.3g}",
        )
    return table


def links_samples_table(links: LinksProfile) -> Table:
    """The raw measurements: median time and effective rate per operation, ring size and message size."""
    table = Table(title="measurements", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    table.add_column("op")
    table.add_column("ranks", justify="right")
    table.add_column("message", justify="right")
    table.add_column("median µs", justify="right")
    table.add_column("GB/s", justify="right")
    for sample in links.samples:
        rate = sample.message_bytes / sample.seconds / 1e9 if sample.seconds > 0 else float("inf")
        table.add_row(
            sample.op,
            str(sample.ring_size),
            format_bytes(sample.message_bytes),
            f"{sample.seconds * 1e6:.1f}",
            f"{rate:.3g}",
        )
    return table


def links_view(links: LinksProfile) -> Group:
    """Fit table, then the raw samples."""
    return Group(links_fit_table(links), links_samples_table(links))


def runtime_table(runtime: RuntimeCosts) -> Table:
    """The training engine's own measured costs (profile.runtime), one term per row."""
    table = Table(
        title=f"engine costs on this host ({runtime.engine})", title_justify="left",
        box=box.SIMPLE_HEAD, show_header=False,
    )  # fmt: skip
    table.add_column("term", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_row("forward overhead per micro-batch and stage", format_seconds_ms(runtime.forward_overhead_seconds) + " ms")
    table.add_row("backward overhead per micro-batch and stage", format_seconds_ms(runtime.backward_overhead_seconds) + " ms")
    table.add_row("end of step, fixed", format_seconds_ms(runtime.step_fixed_seconds) + " ms")
    table.add_row("end of step, per parameter", f"{runtime.step_seconds_per_parameter * 1e9:.3g} ns")
    for ratio in runtime.compute_ratios:
        table.add_row(
            f"engine / profiled compute at b={ratio.micro_batch_size}",
            f"{ratio.forward_ratio:.2f} fwd, {ratio.backward_ratio:.2f} bwd",
        )
    if runtime.busy_handoff_seconds:
        table.add_row("blocking hand-off between busy ranks", format_seconds_ms(runtime.busy_handoff_seconds) + " ms")
    if runtime.busy_allreduce_latency_seconds:
        table.add_row("all-reduce after compute, per ring hop", format_seconds_ms(runtime.busy_allreduce_latency_seconds) + " ms")
    if runtime.busy_allreduce_bandwidth_bytes_per_second:
        table.add_row("all-reduce after compute, bus bandwidth",
                      f"{runtime.busy_allreduce_bandwidth_bytes_per_second / 1e9:.3g} GB/s")  # fmt: skip
    table.add_row("wall / CPU time, one rank alone", f"{runtime.alone_compute_slowdown:.2f}")
    table.add_row(f"compute slowdown, {count(runtime.concurrent_ranks, 'rank')} at once", f"{runtime.concurrent_compute_slowdown:.2f}")
    return table


def profile_view(
    profile: ModelProfile, micro_batch_sizes: Sequence[int] | None = None, *, every_layer: bool = False
) -> Group:
    """Header line, per-layer table (identical layers collapsed unless `every_layer`), the
    tensor-parallel shards, notes, engine costs and link calibration when present."""
    parts: list = [
        profile_summary(profile),
        profile_table(profile, micro_batch_sizes, every_layer=every_layer),
        *shard_tables(profile, micro_batch_sizes),
    ]
    parts += _notes(profile.notes)
    if profile.host is not None:
        host = profile.host
        spread = "" if host.timing_spread is None else (
            f"; timings spread {host.timing_spread * 100:.0f} % (max - min over median)")
        parts += _notes([f"host: load {host.load_average:g} on {count(host.cores, 'core')} when measured{spread}"])
    if profile.runtime is not None:
        parts.append(runtime_table(profile.runtime))
    if profile.links is not None:
        parts.append(links_fit_table(profile.links))
    return Group(*parts)


def _notes(notes: Iterable[str]) -> list[Text]:
    return [Text(f"note: {note}", style="dim") for note in notes]
