"""metrics.jsonl: one `StepMetrics` line per optimizer step, appended by rank 0.

The worker gathers each rank's forward/backward seconds and peak memory (its heartbeat) and rank 0
writes the line:

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
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from pipectl.artifacts.run import (
    LOGS_DIR, METRICS_FILE, PREVIOUS_RESUME_FILE, RANKS_FILE, REFUSALS_FILE, RESUME_FILE, RankDetail, RankTiming,
    ResumeRecord, StepMetrics, WriteRefusal,
)  # fmt: skip
from pipectl.io import read_records
from pipectl.words import count

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends StepMetrics lines to RUN/metrics.jsonl. Ranks other than 0 write nothing.

    Each line is flushed and fsync'ed: `pipectl launch`/`status` tail the file while the job runs,
    and a killed job keeps every completed step. A line the disk refuses (full, over quota, an I/O
    error) never ends the job: the file is cut back to its last whole line, the lines wait in
    memory and go out with the next step's, and the first refusal is logged (`failed_writes`
    counts them); once they are written, the spell is recorded in logs/refused-writes.jsonl
    (`WriteRefusal`), which the launching terminal reports. Training is worth more than its log.
    """

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.ranks_path = Path(run_dir) / LOGS_DIR / RANKS_FILE
        self.refusals_path = Path(run_dir) / LOGS_DIR / REFUSALS_FILE
        self.rank = rank
        self.pending: list[str] = []  # lines not yet on disk, oldest first
        self.failed_writes = 0
        self._spell: tuple[float, str] | None = None  # (first refusal, its error) of the spell under way

    def write(self, metrics: StepMetrics) -> None:
        """The step's line to metrics.jsonl; its per-rank detail, if any, to logs/ranks.jsonl
        (`RankDetail`): the line stays the same size at any world size."""
        if self.rank != 0:
            return
        if metrics.ranks:
            self._write_detail(RankDetail(step=metrics.step, layout=metrics.layout, ranks=metrics.ranks))
            metrics = metrics.model_copy(update={"ranks": []})
        self.pending.append(metrics.model_dump_json() + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(self.pending).encode()
        # Unbuffered: a refusal surfaces here, not in a close that cannot be caught apart.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            whole = os.lseek(fd, 0, os.SEEK_END)  # the end of the last whole line
            try:
                self._append(fd, data)
                os.fsync(fd)
            except OSError as exc:
                self._refused(fd, whole, exc)
                return
        finally:
            os.close(fd)
        if self._spell is not None:
            log.warning("metrics.jsonl: written again, with %d held lines", len(self.pending))
            self._record_refusal(len(self.pending) - 1)  # the lines of earlier steps waited
        self.pending.clear()

    def _write_detail(self, detail: RankDetail) -> None:
        """Append without fsync: the detail helps read a run, it is not the run's record; a disk
        that refuses it loses that step's detail only."""
        try:
            self.ranks_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.ranks_path, "a") as handle:
                handle.write(detail.model_dump_json() + "\n")
        except OSError as exc:
            log.warning("%s: step %d's per-rank detail not written (%s)", self.ranks_path, detail.step, exc)

    def _record_refusal(self, lines: int) -> None:
        first, error = self._spell
        self._spell = None
        refusal = WriteRefusal(file=METRICS_FILE, error=error, first_unix=first, written_unix=time.time(), lines=max(lines, 1))
        try:
            with open(self.refusals_path, "a") as handle:
                handle.write(refusal.model_dump_json() + "\n")
        except OSError as exc:  # the log of a refusal is worth less than the lines it was about
            log.warning("%s: cannot record the refusal (%s)", self.refusals_path, exc)

    @staticmethod
    def _append(fd: int, data: bytes) -> None:
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])

    def _refused(self, fd: int, whole: int, exc: OSError) -> None:
        """Cut a torn line off (a later append would follow it) and keep the lines for the next step."""
        self.failed_writes += 1
        if self._spell is None:
            self._spell = (time.time(), str(exc))
        try:
            os.ftruncate(fd, whole)
        except OSError:  # a reader skips a torn line; the next write tries again
            pass
        if self.failed_writes == 1:
            log.warning("metrics.jsonl: cannot write (%s); lines held in memory, retried every step", exc)


def parse_metrics_lines(lines: list[str]) -> list[StepMetrics]:
    """Parse JSONL lines, skipping a torn last line (the job may be writing it) and bad lines.

    The last occurrence of a step wins, and drops the steps after it logged before it (a resumed
    run's abandoned steps, `_parse_metrics`); the result is sorted by step.
    """
    return _parse_metrics(lines, last_line_whole=False)[0]


def _parse_metrics(
    lines: list[str], *, last_line_whole: bool, resumed: ResumeRecord | None = None
) -> tuple[list[StepMetrics], list[int]]:
    """`parse_metrics_lines`, and the numbers of the lines skipped as not step records; a bad last
    line counts among them only if `last_line_whole` (its newline was read, so it is not torn).

    The file is the run's history: a run that resumed from an older checkpoint than its last step
    (killed between checkpoints, or a newer one that did not load) logs those steps again, and the
    steps the older lines hold past that point were abandoned. So a line of step s drops every
    step after s logged before it, and with `resumed` (the latest start's record) a line older than
    that start and past its step is dropped even before the new timeline logs anything.
    """
    by_step: dict[int, StepMetrics] = {}
    newest = -1
    unreadable: list[int] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            metrics = StepMetrics.model_validate(json.loads(line))
        except (json.JSONDecodeError, ValidationError, RecursionError) as exc:  # RecursionError: nested too deeply
            if number != len(lines) or last_line_whole:
                log.warning("metrics line %d skipped: %s", number, _first_reason(exc))
                unreadable.append(number)
            continue
        if resumed is not None and metrics.step > resumed.step and metrics.time_unix < resumed.time_unix:
            continue
        if metrics.step <= newest:
            by_step = {step: kept for step, kept in by_step.items() if step < metrics.step}
        by_step[metrics.step] = metrics
        newest = metrics.step
    return [by_step[s] for s in sorted(by_step)], unreadable


def _first_reason(exc: Exception) -> str:
    """One line of why a metrics line was skipped (pydantic's own message takes ten for one line).

    >>> try:
    ...     StepMetrics.model_validate({"step": 3, "loss": "x"})
    ... except ValidationError as exc:
    ...     _first_reason(exc)
    'loss: Input should be a valid number, unable to parse string as a number (and 4 more)'
    """
    if isinstance(exc, ValidationError):
        first, more = exc.errors()[0], exc.error_count() - 1
        where = ".".join(map(str, first["loc"])) or "the line"
        return f"{where}: {first['msg']}" + (f" (and {more} more)" if more else "")
    return str(exc).splitlines()[0]


def resume_record(run_dir: str | os.PathLike[str], name: str = RESUME_FILE) -> ResumeRecord | None:
    """logs/NAME's resume record (`ResumeRecord`); None where there is none, or it does not read
    (said in the log). `rundir.failures.read_resume` reads this start's through it."""
    path = Path(run_dir) / LOGS_DIR / name
    try:
        return ResumeRecord.model_validate_json(path.read_text(errors="replace"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, ValidationError) as exc:
        log.warning("%s skipped: %s", path, _first_reason(exc))
        return None


def latest_resume(run_dir: str | os.PathLike[str]) -> ResumeRecord | None:
    """Where the run last resumed: this start's record, else the one before it, which the launch
    put aside (a start that ended before its rank 0 loaded a checkpoint wrote none), else None."""
    return resume_record(run_dir) or resume_record(run_dir, PREVIOUS_RESUME_FILE)


def read_metrics(run_dir: str | os.PathLike[str], *, as_resumed: bool = True) -> list[StepMetrics]:
    """All steps recorded so far (empty if the job has not finished a step). `as_resumed` False:
    the steps past the latest resume's checkpoint that no new line has replaced yet are kept (what
    the job trained before it restarted: a morph's downtime runs from its last step)."""
    return read_metrics_and_unreadable(run_dir, as_resumed=as_resumed)[0]


def read_metrics_and_unreadable(
    run_dir: str | os.PathLike[str], *, as_resumed: bool = True
) -> tuple[list[StepMetrics], list[int]]:
    """`read_metrics`, and the numbers of metrics.jsonl's whole lines it skipped (not step records)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return [], []
    text = path.read_text(errors="replace")  # a stray byte: its line is skipped, as any line not a step
    resumed = latest_resume(run_dir) if as_resumed else None
    metrics, unreadable = _parse_metrics(text.splitlines(), last_line_whole=text.endswith("\n"), resumed=resumed)
    return with_rank_details(metrics, run_dir), unreadable


def newest_step(metrics: list[StepMetrics]) -> StepMetrics | None:
    """The step completed last (by its time: a resumed run logs steps again after later ones), None
    before the first."""
    return max(metrics, key=lambda m: m.time_unix) if metrics else None


def with_rank_details(metrics: list[StepMetrics], run_dir: str | os.PathLike[str]) -> list[StepMetrics]:
    """`metrics` with each step's per-rank detail from logs/ranks.jsonl (the last written for a
    step and layout: a step trained again after a resume replaces it). Lines written with their
    detail inline (before the split) keep it."""
    details = {(d.step, d.layout): d.ranks for d in read_records(RankDetail, Path(run_dir) / LOGS_DIR / RANKS_FILE)}
    if not details:
        return metrics
    return [m if m.ranks or (m.step, m.layout) not in details else m.model_copy(update={"ranks": details[m.step, m.layout]})
            for m in metrics]  # fmt: skip


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

    def __init__(self, run_dir: str | os.PathLike[str], *, from_end: bool = False) -> None:
        """`from_end`: only what is appended from now on (a resumed run's earlier launches logged
        steps its resume may abandon: they are not this job's progress)."""
        self.path = Path(run_dir) / METRICS_FILE
        self.offset = 0
        if from_end and self.path.is_file():
            self.offset = self.path.stat().st_size
        self.last: StepMetrics | None = None

    def latest(self) -> StepMetrics | None:
        """The newest complete step line so far (a torn last line waits for its newline)."""
        if not self.path.is_file():
            return self.last
        with self.path.open("rb") as handle:
            if os.fstat(handle.fileno()).st_size < self.offset:
                # Shorter than what was read (the file replaced): read it again.
                self.offset, self.last = 0, None
            handle.seek(self.offset)
            appended = handle.read()
        complete = appended[: appended.rfind(b"\n") + 1]
        self.offset += len(complete)
        parsed = parse_metrics_lines(complete.decode(errors="replace").splitlines())
        if parsed:  # the step logged last, also where a resumed run logs a step again
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


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory figures (see `RankTiming` for what each field measures)."""

    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_rss_bytes: int | None


def node_name() -> str:
    """The node this process runs on, as its user knows it: Slurm's name for it in a Slurm job
    (SLURMD_NODENAME, what squeue and sinfo show), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def peak_rss_bytes() -> int | None:
    """The process's peak resident set size so far, in bytes.

    Linux: `VmHWM` of /proc/self/status (kB), the high-water mark of this process image (proc(5)).
    Not getrusage's ru_maxrss there: Linux carries it across fork and exec, so a rank started by a
    large parent reports the parent's size (a fresh interpreter forked from a large test process
    reports that process's peak). Elsewhere ru_maxrss (bytes on macOS, getrusage(2)).
    None where neither exists.
    """
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_memory(device: str) -> None:
    """Start a step's peak: on CUDA reset the allocator's peak statistics (RSS cannot be reset)."""
    if device == "cuda":
        import torch  # the rank imported it long before

        torch.cuda.reset_peak_memory_stats()


def rank_memory(device: str) -> RankMemory:
    """The peaks since `reset_peak_memory` (CUDA) and the process's peak RSS."""
    allocated = reserved = None
    if device == "cuda":
        import torch  # the rank imported it long before

        allocated = int(torch.cuda.max_memory_allocated())
        reserved = int(torch.cuda.max_memory_reserved())
    return RankMemory(allocated, reserved, peak_rss_bytes())


RSS_NOTE = (
    "RSS is the whole process (interpreter, torch, DeepSpeed, communication buffers and tensors), "
    "not comparable 1:1 with the plan's figure (model state and activations on the device)"
)


@dataclass(frozen=True)
class StageMemoryComparison:
    """One pipeline stage: the plan's peak against the highest peak its ranks measured."""

    stage: int
    ranks: tuple[int, ...]
    predicted_bytes: int | None
    measured_bytes: int  # CUDA: max allocated; CPU: peak RSS; max over the stage's ranks and steps
    reserved_bytes: int | None  # CUDA only

    @property
    def ratio(self) -> float | None:
        """measured / predicted."""
        return None if not self.predicted_bytes else self.measured_bytes / self.predicted_bytes

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured: negative when the plan predicted less than was used."""
        if self.predicted_bytes is None or self.measured_bytes <= 0:
            return None
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


@dataclass(frozen=True)
class MemorySummary:
    """Predicted vs measured peak memory per stage, over the steps of the run's last layout."""

    measure: str  # "cuda" (max_memory_allocated) or "rss" (peak resident set size, CPU)
    layout: str
    steps: int
    stages: list[StageMemoryComparison]

    @property
    def comparable(self) -> bool:
        """Whether measured and predicted count the same thing (device tensors, on CUDA)."""
        return self.measure == "cuda"

    def to_dict(self) -> dict:
        return {
            "measure": self.measure,
            "measured_field": "peak_allocated_bytes" if self.comparable else "peak_rss_bytes",
            "comparable": self.comparable,
            "note": "" if self.comparable else RSS_NOTE,
            "layout": self.layout,
            "steps": self.steps,
            "stages": [
                {
                    "stage": s.stage,
                    "ranks": list(s.ranks),
                    "predicted_peak_bytes": s.predicted_bytes,
                    "measured_peak_bytes": s.measured_bytes,
                    "peak_reserved_bytes": s.reserved_bytes,
                    "measured_over_predicted": s.ratio,
                    "error": s.error if self.comparable else None,
                }
                for s in self.stages
            ],
        }


def peak_measure(timings: list[RankTiming]) -> tuple[str, Callable[[RankTiming], int | None]] | None:
    """Which peak ranks' timings are compared by: 'cuda', the allocator's, where any rank measured
    it; else 'rss', the process's; None when neither was measured."""
    if any(r.peak_allocated_bytes is not None for r in timings):
        return "cuda", lambda r: r.peak_allocated_bytes
    if any(r.peak_rss_bytes is not None for r in timings):
        return "rss", lambda r: r.peak_rss_bytes
    return None


def stage_peaks(timings: list[RankTiming], stages: int) -> list[int]:
    """Each stage's highest peak over its ranks in one step (by `peak_measure`), for the step's
    line; [] when the step has no rank detail or a stage measured nothing.

    >>> t = lambda rank, stage, rss: RankTiming(rank=rank, stage=stage, forward_seconds=0, backward_seconds=0, peak_rss_bytes=rss)
    >>> stage_peaks([t(0, 0, 5), t(1, 1, 7), t(2, 1, 6)], 2), stage_peaks([], 2)
    ([5, 7], [])
    """
    chosen = peak_measure(timings)
    if chosen is None:
        return []
    peaks: dict[int, int] = {}
    for timing in timings:
        if (figure := chosen[1](timing)) is not None:
            peaks[timing.stage] = max(peaks.get(timing.stage, 0), figure)
    return [peaks[s] for s in range(stages)] if len(peaks) == stages else []


def memory_summary(metrics: list[StepMetrics], predicted_bytes: list[int] | None = None) -> MemorySummary | None:
    """Each stage's highest measured peak (over its ranks and the steps of the last layout) against
    the plan's figure for that stage. None when no step recorded memory (files written before it).

    The prediction is the one the steps recorded, else `predicted_bytes` (the plan's, for runs
    whose lines predate the field).

    >>> from pipectl.artifacts.run import RankTiming
    >>> def line(step, peaks):
    ...     ranks = [RankTiming(rank=r, stage=r, forward_seconds=0, backward_seconds=0, peak_allocated_bytes=b)
    ...              for r, b in enumerate(peaks)]
    ...     return StepMetrics(step=step, loss=1.0, step_seconds=1.0, samples_per_second=1.0, global_batch=1,
    ...                        world_size=2, layout="p2", ranks=ranks, predicted_peak_memory_bytes=[100, 90])
    >>> summary = memory_summary([line(1, [80, 60]), line(2, [125, 75])])
    >>> [(s.stage, s.measured_bytes, round(s.error, 2)) for s in summary.stages]
    [(0, 125, -0.2), (1, 75, 0.2)]
    """
    if not metrics:
        return None
    layout = metrics[-1].layout
    lines = [m for m in metrics if m.layout == layout]
    timings = [r for m in lines for r in m.ranks]
    chosen = peak_measure(timings)
    if chosen is None:
        return None
    measure, value = chosen
    predicted = next((m.predicted_peak_memory_bytes for m in reversed(lines) if m.predicted_peak_memory_bytes), None)
    predicted = predicted or predicted_bytes or []
    measured: dict[int, int] = {}
    reserved: dict[int, int] = {}
    ranks: dict[int, set[int]] = {}
    for timing in timings:
        figure = value(timing)
        if figure is None:
            continue
        measured[timing.stage] = max(measured.get(timing.stage, 0), figure)
        ranks.setdefault(timing.stage, set()).add(timing.rank)
        if timing.peak_reserved_bytes is not None:
            reserved[timing.stage] = max(reserved.get(timing.stage, 0), timing.peak_reserved_bytes)
    stages = [
        StageMemoryComparison(
            stage=stage,
            ranks=tuple(sorted(ranks[stage])),
            predicted_bytes=predicted[stage] if stage < len(predicted) else None,
            measured_bytes=measured[stage],
            reserved_bytes=reserved.get(stage),
        )
        for stage in sorted(measured)
    ]
    return MemorySummary(measure=measure, layout=layout, steps=len(lines), stages=stages)


def read_refusals(run_dir: str | os.PathLike[str], *, since_unix: float = 0.0) -> list[WriteRefusal]:
    """The spells of refused metrics lines recorded at or after `since_unix` (unreadable lines skipped)."""
    refusals = read_records(WriteRefusal, Path(run_dir) / LOGS_DIR / REFUSALS_FILE)
    return [refusal for refusal in refusals if refusal.written_unix >= since_unix]


def refusal_line(refusal: WriteRefusal) -> str:
    """'metrics.jsonl could not be written for 4.2 s ([Errno 28] No space left on device): 3 lines
    waited in memory and are written now; training went on'"""
    return (
        f"{refusal.file} could not be written for {refusal.written_unix - refusal.first_unix:.1f} s ({refusal.error}): "
        f"{count(refusal.lines, 'line')} waited in memory and {'is' if refusal.lines == 1 else 'are'} written now; "
        "training went on"
    )
