"""Rich tables for plans (plan.json): the ranked candidates, the morph table, the rejections.

Functions build renderables and return them; the CLI prints them.
"""

from __future__ import annotations

from typing import Sequence

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from pipectl.artifacts.layout import recompute_mark
from pipectl.artifacts.plan import Candidate, Engine, MorphEntry, Plan, ReplicaShare, runtime_runs_zero
from pipectl.artifacts.profile import ModelProfile
from pipectl.plan.flops import Utilisation, plan_layer_flops, utilisation
from pipectl.plan.frameworks import space_of
from pipectl.runtime.checkpoint.schedule import DEVICE_MTBF_HOURS, young_daly_seconds
from pipectl.report.tables import format_bytes
from pipectl.schedule import ScheduleKind, deepspeed_runnable
from pipectl.words import count


STEADY = " (steady)"  # a 2bw row: priced per update in steady state, no flush


def _schedule_label(candidate: Candidate) -> str:
    """e.g. 'interleaved-2'; 'zbv', whose two chunks per rank are the schedule itself."""
    label = candidate.schedule.value
    if candidate.chunks > 1 and candidate.schedule is not ScheduleKind.ZBV:
        label += f"-{candidate.chunks}"
    return label


def _steady(candidate: Candidate) -> str:
    """' (steady)' for PipeDream-2BW, whose step time is its time per update without a flush."""
    return STEADY if candidate.schedule is ScheduleKind.PIPEDREAM_2BW else ""


def _steady_note(candidate: Candidate) -> str | None:
    """The 2BW candidate's note with its steady state beside the flushed step (`plan.evaluate`)."""
    return next((note for note in candidate.notes if note.startswith("2BW steady state")), None)


def _micro_batch_counts(candidate: Candidate) -> str:
    """m, e.g. '4'; uneven replicas the counts they run, most first: '4/3'."""
    if not candidate.replicas:
        return str(candidate.micro_batches)
    return "/".join(map(str, sorted({r.micro_batches for r in candidate.replicas}, reverse=True)))


def _batch_label(candidate: Candidate) -> str:
    """b×m, e.g. '2×4' or, uneven, '2×4/3'; 'mixed' when the replicas' micro-batch sizes differ too."""
    if candidate.replicas and len({r.micro_batch_size for r in candidate.replicas}) > 1:
        return "mixed"
    return f"{candidate.micro_batch_size}×{_micro_batch_counts(candidate)}"


def _replica_runs(replicas: Sequence[ReplicaShare]) -> list[tuple[int, int, ReplicaShare]]:
    """Consecutive replicas with the same share as one (first, last, share): 11 replicas at
    6, 6, 6, 5, ... are two rows."""
    runs: list[tuple[int, int, ReplicaShare]] = []
    for r in replicas:
        if runs and (runs[-1][2].device, runs[-1][2].micro_batch_size, runs[-1][2].micro_batches) == (
            r.device, r.micro_batch_size, r.micro_batches
        ):
            runs[-1] = (runs[-1][0], r.replica, runs[-1][2])
        else:
            runs.append((r.replica, r.replica, r))
    return runs


def _short_percent(fraction: float | None) -> str:
    """'46%', '0.8%' below 1 %, '-' for none."""
    if fraction is None:
        return "-"
    return f"{fraction * 100:.0f}%" if fraction >= 0.01 else f"{fraction * 100:.1g}%"


def format_percent(fraction: float | None) -> str:
    """'45.9 %', two significant digits below 1 % ('0.051 %'), or 'n/a'."""
    if fraction is None:
        return "n/a"
    return f"{fraction * 100:.1f} %" if fraction >= 0.01 else f"{fraction * 100:.2g} %"


def utilisation_line(u: Utilisation) -> str:
    """The chosen candidate's predicted MFU and HFU, the peak they are taken of, and where the
    model FLOPs come from (or why they are n/a)."""
    if not u.available:
        return f"FLOPs: MFU n/a, HFU n/a ({u.detail})"
    per_device = u.peak_flops_per_second / u.devices / 1e12
    return (
        f"FLOPs: MFU {format_percent(u.mfu)}, HFU {format_percent(u.hfu)}{hardware_extras(u)} of "
        f"{u.devices} x {per_device:.3g} TFLOP/s {u.dtype}; model FLOPs from {u.detail}"
    )


def hardware_extras(u: Utilisation) -> str:
    """What HFU counts beyond MFU, e.g. ' (+ recompute, + layers whole on 2 tensor ranks)'; '' if nothing."""
    extras = []
    if u.recomputed_flops_per_step > 0:
        extras.append("+ recompute")
    if u.replicated_flops_per_step > 0:
        extras.append(f"+ layers whole on {u.tensor_parallel} tensor ranks")
    return f" ({', '.join(extras)})" if extras else ""


def _recompute_words(c: Candidate) -> str:
    """' recompute', ' checkpoint-layers', ' selective-recompute' or '' for the chosen plan's line."""
    if c.selective_recompute:
        return " selective-recompute"
    return " recompute" if c.recompute else " checkpoint-layers" if c.checkpoint_layers else ""


def format_step(seconds: float) -> str:
    """4 significant digits, in ms below one second: 0.01234 -> '12.34 ms', 12.3456 -> '12.35 s'."""
    return f"{seconds * 1e3:.4g} ms" if seconds < 1 else f"{seconds:.4g} s"


def candidates_table(
    candidates: Sequence[Candidate],
    *,
    chosen: Candidate | None = None,
    title: str = "",
    mfu: Sequence[float | None] = (),
    mark_unrunnable: bool = True,
) -> Group:
    """One row per candidate: degrees, b, m, schedule (+R: recompute whole stages, +ckpt: checkpoint
    every layer, +sel: recompute attention cores; * where DeepSpeed's engine cannot run it, unless
    `mark_unrunnable` is off: a plan for another framework), ZeRO, predicted figures, cost.

    `mfu`: each candidate's predicted model FLOPs utilisation (`plan.flops`), in order. Columns that
    say nothing for these candidates (ZeRO when all share one stage, TFLOP/s without FLOP counts, MFU
    without model FLOPs or a peak, cost without prices) are left out so the table stays narrow.
    """
    utilisations = dict(zip(map(id, candidates), mfu))
    # At d = 1 ZeRO shards nothing, so only replicated candidates tell ZeRO stages apart.
    zero_stages = {c.zero_stage for c in candidates if c.data_parallel > 1} or {c.zero_stage for c in candidates}
    columns: list[tuple[str, str, object]] = [
        ("t·p·d", "left", lambda c: f"{c.tensor_parallel}·{c.pipeline_parallel}·{c.data_parallel}"),
        ("b×m", "left", _batch_label),
        ("schedule", "left", lambda c: _schedule_label(c) + recompute_mark(c)
         + ("" if c.deepspeed_runnable or not mark_unrunnable else "*") + _steady(c)),
    ]
    if mark_unrunnable and any(c.engine is not None and c.engine is not Engine.DEEPSPEED for c in candidates):
        # a plan not for DeepSpeed (--engine torch or any): what would run each, '–' for neither
        columns.append(("engine", "left", lambda c: c.engine.value if c.engine is not None else "–"))
    if len(zero_stages) > 1:
        columns.append(("Z", "right", lambda c: str(c.zero_stage)))
    columns += [
        ("step", "right", lambda c: format_step(c.predicted_step_seconds)),
        ("samp/s", "right", lambda c: f"{c.samples_per_second:,.0f}"),
    ]
    if any(c.tflops_per_device > 0 for c in candidates):
        columns.append(("TFLOP/s", "right", lambda c: f"{c.tflops_per_device:.3g}"))
    if any(value is not None for value in utilisations.values()):
        columns.append(("MFU", "right", lambda c: _short_percent(utilisations.get(id(c)))))
    columns += [
        ("mem/dev", "right", lambda c: format_bytes(max(c.peak_memory_bytes))),
        ("bubble", "right", lambda c: f"{c.bubble_fraction * 100:.0f}%"),
        ("comm", "right", lambda c: f"{c.communication_fraction * 100:.0f}%"),
    ]
    if any(c.cost_per_million_samples > 0 for c in candidates):
        columns.append(("$/1M", "right", lambda c: f"{c.cost_per_million_samples:,.2f}"))
    caption = ("interleaved-v: v chunks per device; +R: recomputes whole stages; +ckpt: checkpoints every layer; "
               "+sel: recomputes attention cores")
    if len(zero_stages) > 1:
        caption += "; Z: ZeRO stage"
    if len(zero_stages) == 1:
        caption += f"; all ZeRO-{zero_stages.pop()}"
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_edge=False)
    for header, justify, _ in columns:
        table.add_column(header, justify=justify, no_wrap=True)
    for c in candidates:
        style = "bold green" if chosen is not None and c == chosen else None
        table.add_row(*(render(c) for _, _, render in columns), style=style)
    # The title and the legend as lines of their own: a table's title and caption wrap at its width.
    return Group(*([Text(title, style="bold")] if title else []), table, Text(caption, style="dim"))


def morph_table_view(plan: Plan, *, every: int | None = None) -> Table:
    """The morph table, compressed to the rows where the best configuration changes."""
    table = Table(title="morph table (fastest plan per device count; rows where it changes)",
                  box=box.SIMPLE_HEAD, title_justify="left", show_edge=False)
    for header in ("devices", "uses", "t·p·d", "b×m", "schedule", "step", "note"):
        table.add_column(header, no_wrap=header != "note")
    previous = None
    for entry in plan.morph_table:
        c = entry.candidate
        if c is None:
            continue
        signature = (c.devices, c.tensor_parallel, c.pipeline_parallel, c.data_parallel, c.micro_batch_size,
                     c.schedule, c.chunks)
        if signature == previous and (every is None or entry.devices % every):
            continue
        previous = signature
        table.add_row(
            str(entry.devices), str(c.devices), f"{c.tensor_parallel}·{c.pipeline_parallel}·{c.data_parallel}",
            _batch_label(c), _schedule_label(c) + _steady(c),
            format_step(c.predicted_step_seconds), entry.note,
        )
    return table


def morph_ranges(plan: Plan) -> list[tuple[int, int, int, MorphEntry]]:
    """The morph table in device-count ranges that double ([1, 1], [2, 3], [4, 7], ...): per range
    its first and last count, how many counts the table has there, and its fastest entry."""
    buckets: dict[int, list[MorphEntry]] = {}
    for entry in plan.morph_table:
        if entry.candidate is not None:
            buckets.setdefault(entry.devices.bit_length(), []).append(entry)
    ranges = []
    for _, entries in sorted(buckets.items()):
        fastest = min(entries, key=lambda e: e.candidate.predicted_step_seconds)
        ranges.append((entries[0].devices, entries[-1].devices, len(entries), fastest))
    return ranges


def morph_summary_view(plan: Plan) -> Group:
    """The morph table in a few rows: per range of device counts, the fastest plan in it."""
    counted = sum(1 for e in plan.morph_table if e.candidate is not None)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for header in ("devices", "counts", "fastest at", "t·p·d", "b×m", "schedule", "step"):
        table.add_column(header, no_wrap=True, justify="right" if header in ("counts", "fastest at", "step") else "left")
    for first, last, number, entry in morph_ranges(plan):
        c = entry.candidate
        table.add_row(
            str(first) if first == last else f"{first}–{last}", str(number),
            str(entry.devices) + (f" (uses {c.devices})" if c.devices != entry.devices else ""),  # none fits all
            f"{c.tensor_parallel}·{c.pipeline_parallel}·{c.data_parallel}", _batch_label(c),
            _schedule_label(c) + _steady(c), format_step(c.predicted_step_seconds),
        )
    title = f"morph table: {count(counted, 'device count')} planned; the fastest in each range (all: --morph-table)"
    return Group(Text(title, style="bold"), table)


def rejections_view(plan: Plan) -> Text:
    if not plan.infeasible:
        return Text("")
    parts = "; ".join(f"{reason}: {number:,}" for reason, number in plan.infeasible.items())
    return Text(f"layouts rejected, by reason: {parts}", style="dim")


CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weights and two Adam moments (runtime/checkpoint/shards.py)


def checkpoint_line(plan: Plan) -> str | None:
    """What a checkpoint of the chosen layout writes per rank, and how often `--checkpoint-every
    auto` would take one for a 1 s pause on this many devices (Young/Daly; the run measures its
    own pause and `status` shows the interval it chose). None without per-layer parameter counts."""
    c = plan.chosen
    counts = plan.model_shape.layer_parameter_counts
    if not counts or not c.stage_layers:
        return None
    # A stage's layer counts include a tied copy (the head's embedding) that one stage holds once.
    largest = min(max(sum(counts[start:end]) for start, end in c.stage_layers), plan.model_shape.parameter_count)
    per_rank = CHECKPOINT_BYTES_PER_PARAMETER * largest / (c.tensor_parallel * c.data_parallel)
    total = CHECKPOINT_BYTES_PER_PARAMETER * plan.model_shape.parameter_count
    mtbf_hours = DEVICE_MTBF_HOURS / c.devices
    interval = young_daly_seconds(1.0, mtbf_hours * 3600.0)
    replicated = " (more where layers are whole on every tensor rank)" if c.tensor_parallel > 1 else ""
    return (
        f"checkpoint: about {format_bytes(per_rank)} per rank{replicated}, {format_bytes(total)} in all, every rank writing its "
        f"own in the background; --checkpoint-every auto at a 1 s pause and {mtbf_hours:,.0f} h between "
        f"failures of {count(c.devices, 'device')}: every {interval / 60:,.0f} min"
    )


def plan_utilisations(plan: Plan, profile: ModelProfile | None, candidates: Sequence[Candidate]) -> list[Utilisation]:
    """Predicted MFU/HFU of each candidate, in the profile's precision (`plan.flops`)."""
    flops = plan_layer_flops(plan, profile)
    dtype = profile.dtype if profile is not None else "float32"
    return [utilisation(c, flops, dtype, global_batch=plan.global_batch) for c in candidates]


def _two_bw_legend(rows: Sequence[Candidate], chosen: Candidate) -> Text | None:
    """What a '2bw (steady)' row's figures are, with the first such alternative's steady state beside
    its flushed step; None without a 2bw row."""
    two_bw = [cand for cand in rows if _steady(cand)]
    if not two_bw:
        return None
    first = two_bw[0]
    line = (
        "2bw (steady): PipeDream-2BW's time per update in steady state, no flush between updates "
        "(1-stale weights: another optimizer than 1f1b's; pipectl launch refuses it)"
    )
    note = _steady_note(first)
    if first != chosen and note:
        line += (f"; {first.tensor_parallel}·{first.pipeline_parallel}·{first.data_parallel} "
                 f"{_batch_label(first)}: {note}")
    return Text(line, style="dim")


def _zero_legend(flagged: Sequence[Candidate]) -> Text | None:
    """The ZeRO stages among `flagged` that pipectl's runtime does not train with, and which it does;
    None when it trains with all of them."""
    stages = sorted({
        cand.zero_stage for cand in flagged
        if not runtime_runs_zero(cand.zero_stage, cand.pipeline_parallel, cand.tensor_parallel,
                                 checkpoint_layers=cand.checkpoint_layers)
    })
    if not stages:
        return None
    return Text(
        f"* {', '.join(f'ZeRO-{z}' for z in stages)}: pipectl's runtime trains with ZeRO-1, and ZeRO-2 and "
        f"ZeRO-3 with one stage and no tensor split, ZeRO-3 without per-layer checkpointing (plan and simulate only)"
        f"{'; ZeRO-2 and ZeRO-3 are planned at p = 1 only' if stages[-1] >= 2 else ''}", style="dim",
    )


def _replicas_table(replicas: Sequence[ReplicaShare]) -> Table:
    """An uneven split's share of the batch per replica (runs of equal shares as one row)."""
    table = Table(title="batch split over replicas", box=box.SIMPLE_HEAD, title_justify="left")
    for header in ("replica", "device", "b", "m", "samples", "gradient weight"):
        table.add_column(header)
    for first, last, r in _replica_runs(replicas):
        table.add_row(str(first) if first == last else f"{first}-{last}", r.device, str(r.micro_batch_size),
                      str(r.micro_batches), str(r.samples), f"{r.gradient_weight:.4g}")
    return table


def plan_view(
    plan: Plan,
    *,
    top: int = 10,
    show_morph: bool = True,
    profile: ModelProfile | None = None,
    every_candidate: bool = False,
    full_morph: bool = False,
) -> Group:
    """Everything `pipectl plan` prints: the chosen plan first (with its predicted MFU and HFU when
    `profile`, the plan's own, gives the precision), then at most `top` alternatives that can run;
    the candidates no engine runs are counted in a line, or, with `every_candidate`, listed apart
    (at most `top`); notes; the morph table in ranges, or whole with `full_morph`."""
    c = plan.chosen
    framework = plan.request.framework  # plan --emit: every candidate is one that framework runs
    runnable = [cand for cand in plan.candidates if (framework or cand.engine is not None) and cand != c]
    others = [cand for cand in plan.candidates if not framework and cand.engine is None and cand != c]
    runs = f"{space_of(framework).title} can run" if framework else "can run"
    # The top, and the best ZeRO-2/3 candidates the planner keeps after it (`--zero-stages 1,2,3`):
    # their rows say what those stages would give even where they are not among the fastest.
    shown = [c, *runnable[:top], *[cand for cand in runnable[top:] if cand.zero_stage >= 2]]
    apart = others[:top] if every_candidate else []
    utilisations = plan_utilisations(plan, profile, [c, *shown, *apart]) if profile is not None else []
    headline = Text.assemble(
        ("chosen: ", "bold"),
        f"t={c.tensor_parallel} p={c.pipeline_parallel} d={c.data_parallel} b={c.micro_batch_size} "
        f"m={_micro_batch_counts(c)} {_schedule_label(c)}{_steady(c)}{_recompute_words(c)} "
        f"zero={c.zero_stage} on {c.devices} x {c.device}: {format_step(c.predicted_step_seconds)} "
        f"{'per update (steady state, no flush)' if _steady(c) else 'per step'} "
        f"of {count(plan.global_batch, 'sample')}",
    )
    parts: list = [headline]
    if utilisations:
        parts.append(Text(utilisation_line(utilisations[0])))
    mfus = [u.mfu for u in utilisations[1:]]
    parts.append(candidates_table(
        shown, chosen=c, mfu=mfus[: len(shown)], mark_unrunnable=framework is None,
        title=f"the chosen plan and {count(len(shown) - 1, 'alternative')} that {runs} ({plan.model} on "
              f"{plan.cluster}, global batch {plan.global_batch}, objective {plan.objective.value})",
    ))  # fmt: skip
    if apart:
        parts.append(candidates_table(
            apart, mfu=mfus[len(shown):],
            title="planned for comparison only: no engine pipectl launches runs these",
        ))  # fmt: skip
    elif others:
        faster = sum(1 for cand in others if cand.predicted_step_seconds < c.predicted_step_seconds)
        parts.append(Text(
            f"{count(len(others), 'other candidate')} ({faster} faster) no engine pipectl launches can run: "
            "left out (--all lists them)", style="dim",
        ))
    flagged = [cand for cand in [*shown, *apart] if not cand.deepspeed_runnable and not framework]
    if any(not deepspeed_runnable(cand.schedule, cand.chunks) for cand in flagged):
        torch_runs = any(cand.engine is Engine.TORCH for cand in flagged)
        parts.append(Text(
            "* DeepSpeed's pipeline engine cannot run this schedule ("
            + ("engine torch: PyTorch's pipelining runtime, which pipectl launch runs; '–': plan and simulate only)"
               if torch_runs else "plan and simulate only)"),
            style="dim",
        ))
    for legend in (_two_bw_legend([*shown, *apart], c), _zero_legend(flagged)):
        if legend is not None:
            parts.append(legend)
    for note in [*plan.notes, *c.notes]:
        parts.append(Text(f"note: {note}", style="yellow"))
    if c.replicas and len({(r.device, r.micro_batch_size) for r in c.replicas}) > 1:
        # Replicas of one kind and b differ only in m, which the uneven-replicas note says in a line.
        parts.append(_replicas_table(c.replicas))
    checkpoint = None if framework else checkpoint_line(plan)  # pipectl's own checkpoints
    if checkpoint is not None:
        parts.append(Text(checkpoint, style="dim"))
    parts.append(rejections_view(plan))
    if show_morph and plan.morph_table:
        parts.append(morph_table_view(plan) if full_morph else morph_summary_view(plan))
    return Group(*parts)
