"""Rich renderables for runs: the status summary, checkpoints, morph history, stragglers and a
resize decision. Functions here build renderables and return them; the CLI prints them.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Sequence

from rich import box
from rich.console import Group
from rich.table import Table

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.morph import MorphRecord
from pipectl.launch.rundir import RunStatus
from pipectl.resize.morph import ResizeDecision
from pipectl.resize.stragglers import StragglerReport, find_stragglers
from pipectl.runtime.history import read_history
from pipectl.runtime.metrics import read_metrics


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f} %"


def status_table(status: RunStatus) -> Group:
    """Rich renderables: a summary table and a checkpoint table."""
    summary = Table(box=box.SIMPLE, show_header=False, title=f"run {status.path.name}", title_justify="left")
    summary.add_column(style="bold")
    summary.add_column()
    state = "finished" if status.finished else ("not started" if not status.metrics else "in progress / stopped")
    summary.add_row("model", status.job.model)
    summary.add_row("engine", f"{status.job.engine.value}, {status.job.world_size} ranks")
    summary.add_row("progress", f"{status.steps_done} / {status.job.steps} steps ({state})")
    if status.metrics:
        first, last = status.metrics[0], status.metrics[-1]
        summary.add_row("loss", f"{first.loss:.4f} (step {first.step}) -> {last.loss:.4f} (step {last.step})")
        summary.add_row("throughput", f"{last.samples_per_second:.1f} samples/s (last step)")
    if status.layouts:
        summary.add_row("layout" if len(status.layouts) == 1 else "layouts", " -> ".join(status.layouts))
    prediction = status.prediction
    if prediction is not None:
        summary.add_row(
            "step time",
            f"measured {prediction.median_measured_seconds * 1e3:.1f} ms, "
            f"predicted {prediction.median_predicted_seconds * 1e3:.1f} ms (medians over {prediction.steps} steps)",
        )
        summary.add_row(
            "prediction error",
            f"median {_percent(prediction.median_abs_error)}, max {_percent(prediction.max_abs_error)}",
        )
    parts: list = [summary]
    if status.checkpoints:
        table = Table(box=box.SIMPLE_HEAD, title="checkpoints", title_justify="left")
        for column in ("tag", "step", "state", "size"):
            table.add_column(column)
        for ckpt in status.checkpoints:
            state = "[green]ok[/]" if ckpt.verified else "[red]" + "; ".join(ckpt.problems) + "[/]"
            table.add_row(ckpt.tag, str(ckpt.step if ckpt.step is not None else "?"), state, f"{ckpt.bytes / 1024:.0f} KiB")
        parts.append(table)
    parts.append(status_renderables(status.path))
    return Group(*parts)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def morph_history_table(records: Sequence[MorphRecord]) -> Table:
    """One row per morph: when, from which layout to which, at which step, downtime."""
    table = Table(box=box.SIMPLE_HEAD, title="morph history", title_justify="left")
    for column in ("when", "from", "to", "at step", "stop", "downtime", "notes"):
        table.add_column(column)
    for record in records:
        when = datetime.datetime.fromtimestamp(record.requested_unix).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            when,
            f"{record.from_devices}: {record.from_layout}",
            f"{record.to_devices}: {record.to_layout}",
            str(record.resume_step),
            _seconds(record.stop_seconds),
            _seconds(record.downtime_seconds) if record.relaunched_unix else "not relaunched",
            "; ".join(record.notes),
        )
    return table


def straggler_table(report: StragglerReport) -> Table:
    """Every rank's median slowdown against its data-parallel peers; stragglers in red."""
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"stragglers (steps {report.steps[0]}-{report.steps[-1]}, {report.layout})" if report.steps else "stragglers",
        title_justify="left",
        caption=report.reason or None,
    )
    for column in ("rank", "stage", "peers", "compute", "slowdown", "z", "verdict"):
        table.add_column(column)
    for score in report.scores.values():
        verdict = "[red]straggler[/]" if score.straggler else "ok"
        table.add_row(
            str(score.rank),
            str(score.stage),
            str(score.peers),
            f"{score.median_compute_seconds * 1e3:.1f} ms",
            f"{score.median_slowdown:.2f}x" if score.peers else "-",
            "-" if score.median_z is None else f"{score.median_z:.1f}",
            verdict,
        )
    return table


def status_renderables(run_dir: Path) -> Group:
    """What `pipectl status` adds for resizes: the morph history and the straggler verdict."""
    parts = []
    records = read_history(run_dir)
    if records:
        parts.append(morph_history_table(records))
    report = find_stragglers(read_metrics(run_dir))
    if report.scores:
        parts.append(straggler_table(report))
    return Group(*parts)


def _devices(count: int) -> str:
    return f"{count} device" + ("" if count == 1 else "s")


def decision_table(decision: ResizeDecision) -> Table:
    """What a resize will do: from which layout to which, the batch kept, the notes."""
    table = Table(box=box.SIMPLE, show_header=False, title=f"resize {decision.run_dir.name}", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("from", f"{_devices(decision.previous.devices)}: {layout_label(decision.previous)}")
    table.add_row("to", f"{_devices(decision.candidate.devices)}: {layout_label(decision.candidate)}")
    table.add_row("requested", f"{_devices(decision.requested_devices)} ({decision.choice.source})")
    table.add_row("global batch", f"{decision.candidate.global_batch} (unchanged)")
    table.add_row("train up to", f"{decision.target_steps} steps")
    for note in decision.notes:
        table.add_row("[yellow]note[/]", note)
    return table
