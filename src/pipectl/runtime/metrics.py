"""metrics.jsonl: one `StepMetrics` line per optimizer step, appended by rank 0.

The worker gathers each rank's forward/backward seconds (its heartbeat) and rank 0 writes the line:

    >>> import tempfile
    >>> from pipectl.artifacts.run import StepMetrics
    >>> run = tempfile.mkdtemp()
    >>> writer = MetricsWriter(run, rank=0)
    >>> writer.write(StepMetrics(step=1, loss=5.5, step_seconds=0.2, samples_per_second=40.0,
    ...                          global_batch=8, world_size=2))
    >>> [m.step for m in read_metrics(run)]
    [1]

A step that is trained again after a restart (steps after the last checkpoint are recomputed)
appends a new line; `read_metrics` keeps the last line of each step, so readers see one trajectory.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from pipectl.artifacts.run import METRICS_FILE, StepMetrics

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends StepMetrics lines to RUN/metrics.jsonl. Ranks other than 0 write nothing.

    Each line is flushed and fsync'ed: `pipectl launch`/`status` tail the file while the job runs,
    and a killed job keeps every completed step.
    """

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.rank = rank

    def write(self, metrics: StepMetrics) -> None:
        if self.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(metrics.model_dump_json() + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def parse_metrics_lines(lines: list[str]) -> list[StepMetrics]:
    """Parse JSONL lines, skipping a torn last line (the job may be writing it) and bad lines.

    The last occurrence of a step wins; the result is sorted by step.
    """
    by_step: dict[int, StepMetrics] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            metrics = StepMetrics.model_validate(json.loads(line))
        except (json.JSONDecodeError, ValidationError) as exc:
            if number != len(lines):
                log.warning("metrics line %d skipped: %s", number, exc)
            continue
        by_step[metrics.step] = metrics
    return [by_step[s] for s in sorted(by_step)]


def read_metrics(run_dir: str | os.PathLike[str]) -> list[StepMetrics]:
    """All steps recorded so far (empty if the job has not finished a step)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return parse_metrics_lines(path.read_text().splitlines())


class MetricsTail:
    r"""Follows a run's metrics.jsonl, parsing only what was appended since the last call.

    The launch's progress bar polls twice a second while the ranks train; re-reading the whole
    file each time would cost more the longer the run, on the cores the ranks compute on.

        >>> import tempfile
        >>> run_dir = tempfile.mkdtemp()
        >>> tail = MetricsTail(run_dir)
        >>> tail.latest() is None
        True
        >>> line = StepMetrics(step=1, loss=2.0, step_seconds=0.5, samples_per_second=8.0, global_batch=4,
        ...                    world_size=1).model_dump_json()
        >>> _ = (Path(run_dir) / METRICS_FILE).write_text(line + "\n" + line[:10])
        >>> tail.latest().step
        1
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.offset = 0
        self.last: StepMetrics | None = None

    def latest(self) -> StepMetrics | None:
        """The newest complete step line so far (a torn last line waits for its newline)."""
        if not self.path.is_file():
            return self.last
        with self.path.open("rb") as handle:
            if os.fstat(handle.fileno()).st_size < self.offset:
                # Rewritten (a resumed run trims steps past its checkpoint): read it again.
                self.offset, self.last = 0, None
            handle.seek(self.offset)
            appended = handle.read()
        complete = appended[: appended.rfind(b"\n") + 1]
        self.offset += len(complete)
        parsed = parse_metrics_lines(complete.decode(errors="replace").splitlines())
        if parsed and (self.last is None or parsed[-1].step >= self.last.step):
            self.last = parsed[-1]
        return self.last


@dataclass(frozen=True)
class PredictionSummary:
    """How well the plan predicted the measured step time."""

    steps: int  # steps compared (the first, warm-up steps excluded)
    median_measured_seconds: float
    median_predicted_seconds: float
    median_abs_error: float  # |measured - predicted| / measured, median over steps
    max_abs_error: float


def prediction_summary(metrics: list[StepMetrics], warmup_steps: int = 1) -> PredictionSummary | None:
    """Median and max relative error of predicted vs measured step time.

    The first `warmup_steps` steps are excluded (allocator warm-up, lazy initialisation), as the
    profiler discards warm-up runs too.

    >>> from pipectl.artifacts.run import StepMetrics
    >>> rows = [StepMetrics(step=s, loss=1.0, step_seconds=t, predicted_step_seconds=1.0,
    ...                     samples_per_second=1.0, global_batch=1, world_size=1)
    ...         for s, t in [(1, 9.0), (2, 1.25), (3, 0.8), (4, 1.0)]]
    >>> summary = prediction_summary(rows)
    >>> summary.steps, round(summary.median_abs_error, 3), round(summary.max_abs_error, 3)
    (3, 0.2, 0.25)
    """
    usable = [m for m in metrics[warmup_steps:] if m.predicted_step_seconds and m.step_seconds > 0]
    if not usable:
        return None
    errors = [abs(m.step_seconds - m.predicted_step_seconds) / m.step_seconds for m in usable]
    return PredictionSummary(
        steps=len(usable),
        median_measured_seconds=statistics.median(m.step_seconds for m in usable),
        median_predicted_seconds=statistics.median(m.predicted_step_seconds for m in usable),
        median_abs_error=statistics.median(errors),
        max_abs_error=max(errors),
    )
