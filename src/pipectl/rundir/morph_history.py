"""The morph history of a run (RUN/morphs.jsonl): append, read back, and fill in downtimes.

A resize appends its record before the new layout has trained a step; the downtime is known only
once metrics.jsonl shows the first step completed after the relaunch. `read_history` fills it in
from the metrics whenever it can, so `pipectl status` shows it even if the resizing process is
gone; `update_downtimes` also writes it back.

    >>> import tempfile
    >>> from pipectl.artifacts.morph import MorphRecord
    >>> from pipectl.artifacts.run import StepMetrics
    >>> record = MorphRecord(requested_unix=100.0, requested_devices=1, from_devices=2,
    ...     from_layout="t1p2d1 1f1b b2 m4", to_devices=1, to_layout="t1p1d1 1f1b b2 m4",
    ...     global_batch=8, resume_step=10, target_steps=20, stopped_running_job=True,
    ...     relaunched_unix=103.0, plan_source="morph-table")
    >>> step = StepMetrics(step=11, loss=4.5, step_seconds=0.1, samples_per_second=80.0,
    ...     global_batch=8, world_size=1, layout="t1p1d1 1f1b b2 m4", time_unix=109.5)
    >>> with_downtime(record, [step]).downtime_seconds
    9.5
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from pydantic import ValidationError

from pipectl.artifacts.morph import MORPHS_FILE, MorphRecord, MorphTrigger
from pipectl.artifacts.run import StepMetrics
from pipectl.io import validation_message, write_text_atomic
from pipectl.rundir.metrics import newest_step, read_metrics

log = logging.getLogger(__name__)


def history_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / MORPHS_FILE


def append_record(run_dir: str | os.PathLike[str], record: MorphRecord) -> Path:
    """Append one record to RUN/morphs.jsonl (flushed and fsync'ed: a crash keeps it)."""
    path = history_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(record.model_dump_json() + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return path


def write_history(run_dir: str | os.PathLike[str], records: Sequence[MorphRecord]) -> Path:
    """Replace RUN/morphs.jsonl atomically (write a sibling, fsync, rename)."""
    return write_text_atomic(history_path(run_dir), "".join(record.model_dump_json() + "\n" for record in records))


def read_records(run_dir: str | os.PathLike[str]) -> list[MorphRecord]:
    """The records as written, oldest first; a torn or invalid line is skipped with a warning."""
    path = history_path(run_dir)
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(MorphRecord.model_validate(json.loads(line)))
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
            log.warning("%s line %d skipped: %s", path, number, exc)
        except ValidationError as exc:
            log.warning("%s line %d skipped: %s", path, number, validation_message(exc))
    return records


def first_step_after(metrics: Sequence[StepMetrics], since_unix: float, resume_step: int) -> StepMetrics | None:
    """The first step completed after `since_unix` beyond `resume_step`: the new layout's first step.

    Matching on time (not on the layout label) also works when a resize keeps the same layout.
    """
    later = [m for m in metrics if m.step > resume_step and m.time_unix >= since_unix]
    return min(later, key=lambda m: m.time_unix) if later else None


def with_downtime(record: MorphRecord, metrics: Sequence[StepMetrics]) -> MorphRecord:
    """`record` with first_step_unix and downtime_seconds filled from `metrics`, when they show it."""
    if record.downtime_seconds is not None or record.relaunched_unix is None or record.failed_exit_code is not None:
        return record  # known already, never relaunched, or failed (a later step is another move's)
    first = first_step_after(metrics, record.relaunched_unix, record.resume_step)
    if first is None:
        return record
    return record.model_copy(
        update={
            "first_step_unix": first.time_unix,
            "downtime_seconds": max(0.0, first.time_unix - record.requested_unix),
        }
    )


def read_history(run_dir: str | os.PathLike[str], *, metrics: list[StepMetrics] | None = None) -> list[MorphRecord]:
    """Every morph of the run, oldest first, downtimes filled from metrics.jsonl where known
    (`metrics`: the run's, when the caller has read them already)."""
    records = read_records(run_dir)
    if not records or all(r.downtime_seconds is not None for r in records):
        return records
    if metrics is None:
        metrics = read_metrics(run_dir)
    return [with_downtime(r, metrics) for r in records]


def update_downtimes(run_dir: str | os.PathLike[str]) -> list[MorphRecord]:
    """Fill in known downtimes and write them back (only if something changed)."""
    stored = read_records(run_dir)
    filled = read_history(run_dir)
    if filled != stored:
        write_history(run_dir, filled)
    return filled


def record_layout_change(
    run_dir: str | os.PathLike[str],
    *,
    to_layout: str,
    to_devices: int,
    global_batch: int,
    resume_step: int,
    target_steps: int,
    now_unix: float | None = None,
    launched_unix: float | None = None,
) -> MorphRecord | None:
    """For rank 0 of a (re)started job, after loading its checkpoint: record a morph no resize did.

    When the last step in metrics.jsonl ran on another layout and no resize already recorded this
    relaunch, either the elastic engine re-formed the group within this launch (the old layout's
    last step came after `launched_unix`, when this start's launcher started: a node left or
    joined), and the downtime runs from the last step completed on the old layout to the first on
    the new one (failure detection, re-rendezvous, restart, checkpoint load); or a person launched
    the run again with `--resume` and a plan of another layout (its last step came before this
    launch), which is recorded as that, timed from this start (the time between the two launches
    was nobody's downtime). Without `launched_unix`: elastic. Returns the record, or None.
    """
    metrics = read_metrics(run_dir, as_resumed=False)  # this start's resume record is written: the old steps count
    last = newest_step(metrics)
    if last is None:
        return None
    if last.layout == to_layout:
        return None
    records = read_records(run_dir)
    if records and records[-1].to_layout == to_layout and (records[-1].relaunched_unix or 0) >= last.time_unix:
        return None  # `pipectl resize` relaunched it and recorded it already
    now = time.time() if now_unix is None else now_unix
    if launched_unix is not None and last.time_unix < launched_unix:
        again = f"; steps after {resume_step} are trained again" if resume_step < last.step else ""
        trigger, requested, source = MorphTrigger.RESUME, now, "chosen"
        note = f"launched again with --resume and a plan of another layout: {last.world_size} -> {to_devices} ranks{again}"
    else:
        trigger, requested, source = MorphTrigger.ELASTIC, last.time_unix, "morph-table"
        note = (f"elastic restart: {last.world_size} -> {to_devices} ranks; downtime counted from the last step on "
                f"the old layout (step {last.step}); steps after {resume_step} are trained again")
    record = MorphRecord(
        trigger=trigger, requested_unix=requested, requested_devices=to_devices, from_devices=last.world_size,
        from_layout=last.layout, to_devices=to_devices, to_layout=to_layout, global_batch=global_batch,
        resume_step=resume_step, target_steps=target_steps, stopped_running_job=False, relaunched_unix=now,
        plan_source=source, notes=[note],
    )  # fmt: skip
    append_record(run_dir, record)
    return record
