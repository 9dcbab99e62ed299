"""Rich renderables for runs: the status summary, predicted vs measured memory, checkpoints, morph
history, stragglers, a resize decision, and the text that reports a failed rank. Functions here
build renderables (or text) and return them; the CLI prints them.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from shlex import quote
from typing import Sequence

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.morph import MorphRecord, MorphTrigger
from pipectl.artifacts.run import RankFailure, RequeueOutcome
from pipectl.rundir.analysis import RunReport, RunUtilisation
from pipectl.rundir.status import RunStatus
from pipectl.runtime.checkpoint.schedule import AUTO_MIN_INTERVAL_SECONDS, DEVICE_MTBF_HOURS
from pipectl.report.phase_table import phase_table
from pipectl.report.plan_table import format_percent, hardware_extras
from pipectl.report.tables import format_bytes
from pipectl.resize.restart import ResizeDecision
from pipectl.rundir.stragglers import StragglerReport
from pipectl.rundir.metrics import RSS_NOTE, MemorySummary
from pipectl.words import count


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f} %"


def _duration(seconds: float) -> str:
    """'0.15 s', '45 s', '12.5 min', '3.2 h'."""
    if seconds < 10:
        return f"{seconds:.3g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def checkpoint_interval_text(status: RunStatus) -> str:
    """How often the run checkpoints, as job.json says, with the automatic interval it chose."""
    job = status.job
    parts = []
    if job.checkpoint_every:
        parts.append(f"every {count(job.checkpoint_every, 'step')}")
    if job.checkpoint_every_seconds:
        parts.append(f"every {_duration(job.checkpoint_every_seconds)}")
    if job.checkpoint_auto:
        chosen = next((e for e in reversed(status.checkpoint_events) if e.interval_seconds), None)
        hours = job.mtbf_hours
        mtbf = (f"{hours:,.0f} h" if hours >= 10 else f"{hours:.2g} h") if hours else \
            f"{DEVICE_MTBF_HOURS:,.0f} device-hours / {job.world_size}"
        floor = ""  # Young/Daly's figure below the floor: the floor is what runs
        if chosen and chosen.interval_seconds <= AUTO_MIN_INTERVAL_SECONDS:
            floor = f" (at least {_duration(AUTO_MIN_INTERVAL_SECONDS)} apart)"
        parts.append(
            f"auto (Young/Daly, MTBF {mtbf}): every {_duration(chosen.interval_seconds)}{floor} after a "
            f"{chosen.stall_seconds:.2f} s stall" if chosen else f"auto (Young/Daly, MTBF {mtbf}): not measured yet"
        )
    return ", ".join(parts + ["at the end"]) if parts else "only at the end and on a stop"


def requeue_text(status: RunStatus) -> Text:
    """How the Slurm job's starts ended (`launch/requeue.py`): 'requeued 2 times (last: stopped
    after step 40 ...)', or why it stopped requeueing."""
    last, times = status.requeues[-1], count(status.requeue_count, "time")
    if last.outcome is RequeueOutcome.REQUEUED:
        return Text(f"requeued {times}: the last start {last.ended}; it resumes from checkpoint step {last.checkpoint_step}")
    if last.outcome is RequeueOutcome.FINISHED:
        return Text(f"finished after being requeued {times}" if status.requeue_count else "finished")
    if not status.requeue_count:
        return Text(f"not requeued: {last.reason}", style="yellow")
    if last.reason.startswith("requeued "):  # the reason counts the requeues itself
        return Text(f"not requeued again: {last.reason}", style="yellow")
    return Text(f"requeued {times}, then not again: {last.reason}", style="yellow")


def _run_state(status: RunStatus) -> str:
    """Where the run stands, for the progress row: finished, trained (and whether it can resume),
    stopped, starting, in progress or interrupted (`RunStatus.state`'s words)."""
    if status.finished:
        return "finished"
    if status.trained and not status.checkpoints:
        return "trained, but no checkpoint was written: nothing to resume from; launch again with --force"
    if status.trained:
        return "trained, but no checkpoint holds the last step: resume to write it"
    if status.stopped is not None:
        step, why = status.stopped
        if why.startswith("SIG"):  # what the ranks were sent: pipectl passes a Ctrl-C or a stop on as SIGTERM
            why = f"a stop request ({why} to the ranks)"
        return f"stopped at step {step}, checkpoint written" + (f": {why}" if why else "")
    if not status.metrics:
        if status.steps_done and not status.active:
            return "stopped; metrics.jsonl holds no step (deleted?): the count is the last checkpoint's"
        if status.ranks_beating:
            return "starting: the ranks are up, the first step is not done yet"
        if status.launching:
            return "starting: the launch is preparing the ranks"
        if not status.ever_started:
            return "not started"
    if status.active:
        return "in progress"
    # Ended without stopping at a checkpoint (killed, failed): it resumes from its newest one.
    return f"interrupted: no rank is running; the newest checkpoint is step {status.checkpointed_step}" if (
        status.checkpointed_step) else "interrupted: no rank is running, and no checkpoint to resume from"


def _checkpoints_table(status: RunStatus) -> Table:
    """Each checkpoint of the run: its tag, step, whether it verifies (else its problems) and size."""
    table = Table(box=box.SIMPLE_HEAD, title="checkpoints", title_justify="left")
    for column in ("tag", "step", "state", "size"):
        table.add_column(column, max_width=SUMMARY_VALUE_WIDTH if column == "state" else None)
    for ckpt in status.checkpoints:
        folder = status.path / "checkpoints" / ckpt.tag
        problems = [within_checkpoint(problem, folder) for problem in ckpt.problems]
        state = Text("ok", style="green") if ckpt.verified else Text("; ".join(problems), style="red")
        table.add_row(ckpt.tag, str(ckpt.step if ckpt.step is not None else "?"), state, format_bytes(ckpt.bytes))
    return table


def within_checkpoint(problem: str, folder: str | os.PathLike[str]) -> str:
    """A checkpoint's problem as its row shows it: the row names the checkpoint, so its folder's
    path goes, before a file inside it and before what is said of the folder itself.

        >>> within_checkpoint("/my runs/r/checkpoints/step8: a resume passed it over: checkpoint step 8 could not "
        ...                   "be loaded (/my runs/r/checkpoints/step8/rank-0.safetensors: sha256 mismatch)",
        ...                   "/my runs/r/checkpoints/step8")
        'a resume passed it over: checkpoint step 8 could not be loaded (rank-0.safetensors: sha256 mismatch)'
    """
    for named in dict.fromkeys((str(folder), str(Path(folder).resolve()))):  # as read here, and as a rank wrote it
        problem = problem.replace(f"{named}/", "").removeprefix(f"{named}: ")
    return problem


# The value column of a run's summary and of a resize's decision: long values (a layout history,
# a checkpoint's figures, a note) wrap within it, so the table fits 100 columns at any width,
# piped output included, beside the longest name ("checkpoint interval").
SUMMARY_VALUE_WIDTH = 72


def status_table(report: RunReport, *, brief: bool = False) -> Group:
    """Rich renderables: a summary table, then (unless `brief`, what launch and resize print when
    the job ends) memory, where the step goes, checkpoints, morph history and stragglers."""
    status = report.status
    summary = Table(box=box.SIMPLE, show_header=False, title=f"run {status.path.name}", title_justify="left")
    summary.add_column(style="bold")
    summary.add_column(max_width=SUMMARY_VALUE_WIDTH)
    state = _run_state(status)
    summary.add_row("model", status.job.model)
    if status.requeues:
        summary.add_row("slurm", requeue_text(status))
    summary.add_row("engine", f"{status.job.engine.value}, {count(status.job.world_size, 'rank')}")
    summary.add_row("progress", f"{status.steps_done} / {count(status.job.steps, 'step')} ({state})")
    if report.failures:  # what ended an interrupted run, as launch said it (the records are in logs/)
        summary.add_row("failure", Text(failure_report(report.failures)[0].splitlines()[0], style="red"))
    if status.metrics:
        first, last = status.metrics[0], status.metrics[-1]
        summary.add_row("loss", f"{first.loss:.4f} (step {first.step}) -> {last.loss:.4f} (step {last.step})")
        summary.add_row("throughput", f"{last.samples_per_second:.1f} samples/s (last step)")
    if status.layouts:
        summary.add_row("layout" if len(status.layouts) == 1 else "layouts", " -> ".join(status.layouts))
    summary.add_row("checkpoint interval", checkpoint_interval_text(status))
    last = status.last_committed
    if last is not None:
        summary.add_row(
            "last checkpoint",
            f"step {last.step}: training paused {last.stall_seconds:.2f} s, written in the background in "
            f"{last.write_seconds:.2f} s ({format_bytes(last.bytes)})"
            + (f"; due at step {last.due_step}, deferred while the one before was written" if last.due_step else "")
            # Committed then, since damaged or removed: the checkpoints table below says how.
            + ("" if any(c.verified and c.step == last.step for c in status.checkpoints) else "; it no longer verifies"),
        )
    if status.checkpoint_problem:
        summary.add_row("checkpoint problem", Text(status.checkpoint_problem, style="yellow"))
    prediction = status.prediction
    if prediction is not None:
        summary.add_row(
            "step time",
            f"measured {prediction.median_measured_seconds * 1e3:.1f} ms, "
            f"predicted {prediction.median_predicted_seconds * 1e3:.1f} ms (medians over {count(prediction.steps, 'step')}"
            + (f" of {status.layouts[-1]})" if len(status.layouts) > 1 else ")"),
        )
        summary.add_row(
            "prediction error",
            f"median {_percent(prediction.median_abs_error)}, max {_percent(prediction.max_abs_error)}",
        )
        if report.host_note is not None:
            summary.add_row("host", Text(report.host_note, style="yellow"))
    for name, row in utilisation_rows(report.utilisation, unlogged=bool(status.steps_done) and not status.metrics):
        summary.add_row(name, row)
    parts: list = [summary]
    if brief:
        parts.append(Text(f"more (memory, where the step goes, checkpoints, stragglers): pipectl status {quote(str(status.path))}",
                          style="dim"))  # fmt: skip
        return Group(*parts)
    if report.memory is not None:
        parts.append(memory_table(report.memory))
    if status.metrics:
        comparison, reason = report.phases, report.phases_unavailable
        parts.append(phase_table(comparison) if comparison is not None else Text(reason or "", style="dim"))
    if status.checkpoints:
        parts.append(_checkpoints_table(status))
    if status.staging:
        parts.append(Text(
            f"{count(len(status.staging), 'staging folder')} in {status.staging[0].parent}: a save in progress, or "
            f"left by one that failed (removed at the next save): " + ", ".join(p.name for p in status.staging),
            style="yellow",
        ))  # fmt: skip
    if report.morphs:
        parts.append(morph_history_table(report.morphs))
    if report.stragglers is not None and report.stragglers.scores:
        parts.append(straggler_table(report.stragglers))
    return Group(*_spaced(parts))


def _spaced(parts: list) -> list:
    """A blank line after each part that ends in text (a note, a table's caption), before the
    next part's title; a table without a caption ends in one already."""
    spaced = []
    for part in parts:
        spaced.append(part)
        if isinstance(part, Text) or (isinstance(part, Table) and part.caption):
            spaced.append(Text(""))
    return spaced


def utilisation_rows(flops: RunUtilisation, *, unlogged: bool = False) -> list[tuple[str, str]]:
    """The status summary's rows: MFU and HFU, measured beside predicted, and what they are of
    (`unlogged`: steps trained, but metrics.jsonl holds none to measure from)."""
    predicted, measured = flops.predicted, flops.measured
    if not predicted.available:
        return [("MFU, HFU", f"n/a: {predicted.detail}")]

    def pair(name: str) -> str:
        if measured is None:
            shown = "n/a (metrics.jsonl holds no step)" if unlogged else f"n/a (after two steps of {flops.layout})"
        else:
            shown = format_percent(getattr(measured, name))
        return f"measured {shown}, predicted {format_percent(getattr(predicted, name))}"

    per_device = predicted.peak_flops_per_second / predicted.devices / 1e12
    return [
        ("MFU", pair("mfu")),
        ("HFU", pair("hfu") + hardware_extras(predicted)),
        ("utilisation of", f"{predicted.devices} x {per_device:.3g} TFLOP/s {predicted.dtype} peak; "
                           f"model FLOPs from {predicted.detail}"),
    ]  # fmt: skip


def memory_table(summary: MemorySummary) -> Table:
    """One row per pipeline stage: the plan's peak, the measured peak, and how far apart they are.

    On CUDA the measured figure is torch's max_memory_allocated (tensors, what the plan counts) and
    the error is (predicted - measured) / measured. On CPU it is the process's peak RSS, which
    counts far more than the plan does: the column shows the ratio, labelled as such, not an error.
    """
    cuda = summary.comparable
    steps = f"{summary.steps} step" + ("" if summary.steps == 1 else "s")
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"peak memory per stage ({summary.layout or 'this layout'}, {steps})",
        title_justify="left",
        caption=None if cuda else RSS_NOTE,
        caption_justify="left",
    )
    columns = ("stage", "ranks", "predicted", "measured allocated", "reserved", "error") if cuda else (
        "stage", "ranks", "predicted (device)", "measured RSS (process)", "RSS / predicted"
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("stage", "ranks") else "right")
    for stage in summary.stages:
        predicted = "-" if stage.predicted_bytes is None else format_bytes(stage.predicted_bytes)
        ranks = ",".join(str(r) for r in stage.ranks)
        if cuda:
            error = stage.error
            shown = "-" if error is None else f"{100 * error:+.1f} %"
            if error is not None and error < 0:
                shown = f"[red]{shown}[/]"  # the plan under-predicted: a tighter device would run out
            reserved = "-" if stage.reserved_bytes is None else format_bytes(stage.reserved_bytes)
            table.add_row(str(stage.stage), ranks, predicted, format_bytes(stage.measured_bytes), reserved, shown)
        else:
            ratio = "-" if stage.ratio is None else f"{stage.ratio:.1f}x"
            table.add_row(str(stage.stage), ranks, predicted, format_bytes(stage.measured_bytes), ratio)
    return table


def _where(failure: RankFailure) -> str:
    """'rank 1 (stage 1, layers 4-8)' (inclusive layer numbers, as people count)."""
    parts = []
    if failure.stage is not None:
        parts.append(f"stage {failure.stage}")
    if failure.stage_layers is not None:
        start, end = failure.stage_layers
        parts.append(f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}")
    return f"rank {failure.rank}" + (f" ({', '.join(parts)})" if parts else "")


def _during(failure: RankFailure) -> str:
    """'in step 2, layer 5 'block.4' (forward of micro-batch 1)'."""
    parts = []
    if failure.step is not None:
        parts.append(f"step {failure.step}")
    if failure.layer_index is not None:
        name = f" '{failure.layer_name}'" if failure.layer_name else ""
        parts.append(f"layer {failure.layer_index}{name}")
    text = "in " + ", ".join(parts) if parts else ""
    if failure.phase:
        doing = failure.phase.split()[0].rstrip(":").endswith("ing")  # 'while copying ...', 'during live resize: ...'
        text = f"{text} ({failure.phase})" if text else f"{'while' if doing else 'during'} {failure.phase}"
    return text


def _first_line(text: str, limit: int = 300) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def out_of_memory_advice(failure: RankFailure) -> str:
    """What to change so the stage fits, from the layout that ran out.

    >>> record = RankFailure(rank=1, stage=1, exception="MemoryError", out_of_memory=True,
    ...                      micro_batch_size=4, recompute=False, pipeline_parallel=2)
    >>> print(out_of_memory_advice(record))
    re-plan so that stage 1 fits: keep part of each device free with `pipectl plan --memory-headroom 0.1`, pin a smaller micro-batch (--micro-batch-size 2), allow recomputation (plan --recompute auto, the default: whole stages, every layer or the attention cores), or pin more pipeline stages (--pipeline-parallel 4)
    """
    where = f"stage {failure.stage}" if failure.stage is not None else "every stage"
    options = ["keep part of each device free with `pipectl plan --memory-headroom 0.1`"]
    if failure.micro_batch_size is None or failure.micro_batch_size > 1:
        smaller = f" (--micro-batch-size {failure.micro_batch_size // 2})" if failure.micro_batch_size else ""
        options.append(f"pin a smaller micro-batch{smaller}")
    if not failure.recompute:
        options.append("allow recomputation (plan --recompute auto, the default: whole stages, every layer or the attention cores)")
    more = f" (--pipeline-parallel {2 * failure.pipeline_parallel})" if failure.pipeline_parallel else ""
    options.append(f"pin more pipeline stages{more}")
    return f"re-plan so that {where} fits: " + ", ".join(options[:-1]) + ", or " + options[-1]


def failure_report(failures: Sequence[RankFailure]) -> tuple[str, str | None]:
    """(message, hint) for a job whose ranks failed: the first failure (an out-of-memory one if
    any), its exception's first line, the plan's memory figure when memory ran out, and one line
    per other failed rank. Empty message when there is no record."""
    if not failures:
        return "", None
    first, others = failures[0], failures[1:]
    during = _during(first)
    what = "ran out of memory" if first.out_of_memory else "failed"
    lines = [f"{_where(first)} {what}" + (f" {during}" if during else "")]
    lines.append(f"  {first.exception.rsplit('.', 1)[-1]}: {_first_line(first.message)}")
    hint = None
    if first.out_of_memory:
        if first.predicted_peak_memory_bytes is not None:
            measured = ""
            if first.peak_allocated_bytes is not None:
                measured = f"; {format_bytes(first.peak_allocated_bytes)} allocated at the peak of this step"
            elif first.peak_rss_bytes is not None:
                measured = f"; the process's peak RSS was {format_bytes(first.peak_rss_bytes)}"
            lines.append(
                f"  the plan predicted {format_bytes(first.predicted_peak_memory_bytes)} peak for "
                f"stage {first.stage} (per device{', layout ' + first.layout if first.layout else ''}){measured}"
            )
        hint = out_of_memory_advice(first)
    # Ranks that failed with the first one's error (every rank stopping for one checkpoint) are
    # named on its line, not given the same message again.
    alike = [o for o in others if (o.exception, o.message) == (first.exception, first.message)]
    if alike:
        lines[0] += ", as did " + ", ".join(_where(other) for other in alike)
    for other in others:
        if other not in alike:
            lines.append(
                f"  {_where(other)} also failed: {other.exception.rsplit('.', 1)[-1]}: {_first_line(other.message, 160)}"
            )
    return "\n".join(lines), hint


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _morph_path(record: MorphRecord) -> str:
    """restart or live (a resize), elastic (a restart the launcher made: its note says so, from
    `rundir.morph_history.record_layout_change`), resume (a launch --resume with another plan), or
    live (failure)."""
    if record.trigger is MorphTrigger.RESIZE:
        return record.path
    if record.trigger in (MorphTrigger.ELASTIC, MorphTrigger.RESUME):
        return record.trigger.value
    return f"{record.path} ({record.trigger.value})"


def morph_history_table(records: Sequence[MorphRecord]) -> Table:
    """One row per morph: when, from which layout to which, how (restart, live, or an elastic
    restart the launcher made), at which step, the stop, the downtime (request -> first step after;
    "failed" for a relaunch that ended before it), a live resize's pause (last step before
    -> first step after) and the state it moved; each morph's notes under the table, numbered, so
    that the rows stay one line each. The stop, pause and moved columns only when some morph has
    them: a history of restarts fits 100 columns."""
    table = Table(box=box.SIMPLE_HEAD, title="morph history", title_justify="left", show_edge=False)
    optional = {
        "stop": [_seconds(record.stop_seconds) for record in records],
        "pause": [_seconds(record.pause_seconds) for record in records],
        "moved": ["-" if r.bytes_moved is None else f"{r.bytes_moved / 2**20:.1f} MiB" for r in records],
    }
    shown = [name for name, cells in optional.items() if any(cell != "-" for cell in cells)]
    columns = [column for column in ("#", "when", "from", "to", "path", "at step", "stop", "downtime", "pause", "moved")
               if column not in optional or column in shown]  # fmt: skip
    for column in columns:
        table.add_column(column, no_wrap=True)
    notes = []
    for number, record in enumerate(records, start=1):
        when = datetime.datetime.fromtimestamp(record.requested_unix).strftime("%m-%d %H:%M:%S")
        live = record.path == "live"
        if record.failed_exit_code is not None:
            downtime = "failed"  # the exit code in its note
        elif record.relaunched_unix or live:
            downtime = _seconds(record.downtime_seconds)
        else:
            downtime = "not relaunched"
        cells = {
            "#": str(number),
            "when": when,
            "from": record.from_layout,
            "to": record.to_layout,
            "path": _morph_path(record),
            "at step": str(record.resume_step),
            "downtime": downtime,
            **{name: optional[name][number - 1] for name in shown},
        }
        table.add_row(*(cells[column] for column in columns))
        if record.failed_exit_code is not None:
            notes.append(f"{number}: the relaunched job exited with code {record.failed_exit_code} before its first "
                         f"step: the run last trained on {record.from_layout}")
        if record.trigger is MorphTrigger.FAILURE:  # the two clocks start apart; a reader sees pause > downtime
            notes.append(f"{number}: the downtime counts from when the lost replica was noticed, the pause from the last "
                         "step before; the survivors hold the state, so little or nothing moves")  # fmt: skip
        notes += [f"{number}: {note}" for note in record.notes]
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def straggler_table(report: StragglerReport) -> Table:
    """Every rank's median slowdown against its data-parallel peers; stragglers in red."""
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"stragglers (steps {report.steps[0]}-{report.steps[-1]}, {report.layout})" if report.steps else "stragglers",
        title_justify="left",
        caption=report.reason or None,
        caption_justify="left",
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


def _devices(number: int) -> str:
    return count(number, "device")


def decision_table(decision: ResizeDecision) -> Table:
    """What a resize will do: from which layout to which, the batch kept, the notes."""
    table = Table(box=box.SIMPLE, show_header=False, title=f"resize {decision.run_dir.name}", title_justify="left")
    table.add_column(style="bold")
    table.add_column(max_width=SUMMARY_VALUE_WIDTH)
    table.add_row("from", f"{_devices(decision.from_devices)}: {decision.from_layout}")
    table.add_row("to", f"{_devices(decision.candidate.devices)}: {layout_label(decision.candidate)}")
    table.add_row("requested", f"{_devices(decision.requested_devices)} ({decision.choice.source})")
    table.add_row("global batch", f"{decision.candidate.global_batch} (unchanged)")
    table.add_row("train up to", count(decision.target_steps, "step"))
    for note in decision.notes:
        table.add_row("[yellow]note[/]", note)
    return table
