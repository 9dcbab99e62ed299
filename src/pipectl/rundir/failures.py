"""A rank's failure as a record: logs/failure-rank{R}.json (`RankFailure`); and where the ranks
resumed: logs/resume.json (`ResumeRecord`), so that the launching terminal can say so.

The worker catches what ends its training, prints the traceback to its log, and writes this
record; `pipectl launch` reads the records when the job exits non-zero and tells the user which
rank failed, where, and why, instead of only the launcher's exit code.

Where it failed is read from the exception's traceback frames, so nothing has to be tracked while
training runs:

- the executor's handler that was running (`_exec_planned_forward`, `_exec_planned_backward`,
  `_exec_recompute`, or any other `_exec_*` instruction of the engine, e.g. the optimizer step)
  gives the phase, and the planned `action` it ran gives the micro-batch;
- when the stage module's `forward` is among the frames, DeepSpeed's `PipelineModule` had set
  `curr_layer` (the model's layer index) right before calling that layer, so it names the layer.
  A backward runs in autograd's C++ engine, outside any layer's Python code: the record then
  names the stage's layer range only.

Out of memory is `torch.OutOfMemoryError` (CUDA), Python's `MemoryError`, or the `RuntimeError`
torch's CPU allocator raises ("DefaultCPUAllocator: can't allocate memory", measured with torch
2.13 on Linux) — each also when it is the cause or context of the exception that escaped.

This module imports no torch: the CLI reads records with it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import ValidationError

from pipectl.artifacts.run import FAILURE_FILE, LOGS_DIR, RESUME_FILE, RankFailure, ResumeRecord
from pipectl.io import write_json_atomic

log = logging.getLogger(__name__)

MESSAGE_CHARS = 2000  # kept of an exception's message (CUDA's out-of-memory message is ~600)

# Messages of out-of-memory errors that are not typed as such: torch's CPU allocator (c10
# alloc_cpu.cpp) and CUDA errors raised outside the caching allocator.
_OOM_MESSAGES = ("can't allocate memory", "out of memory")

_PHASES = {"_exec_planned_forward": "forward", "_exec_recompute": "recompute", "_exec_planned_backward": "backward"}


@dataclass
class RankContext:
    """What a rank knows about itself, filled in by `train` as it learns it."""

    rank: int
    stage: int | None = None
    step: int | None = None  # the step being trained (1-based)
    phase: str = "start-up"  # what the worker was doing, when the frames do not say more
    layout: Any = None  # artifacts.layout.Layout
    layer_names: list[str] = field(default_factory=list)
    predicted_peak_memory_bytes: tuple[int, ...] = ()
    engine: Any = None  # the PlannedPipelineEngine, once built
    device: str = "cpu"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, its cause or its context is an out-of-memory error.

    >>> is_out_of_memory(MemoryError())
    True
    >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
    True
    >>> wrapped = ValueError("bad")
    >>> wrapped.__cause__ = MemoryError()
    >>> is_out_of_memory(wrapped), is_out_of_memory(RuntimeError("Connection closed by peer"))
    (True, False)
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError) or type(current).__name__ == "OutOfMemoryError":
            return True
        if isinstance(current, RuntimeError) and any(text in str(current) for text in _OOM_MESSAGES):
            return True
        current = current.__cause__ or current.__context__
    return False


def exception_name(exc: BaseException) -> str:
    """'MemoryError', 'torch.OutOfMemoryError', 'pipectl.errors.LaunchError'."""
    module = type(exc).__module__
    return type(exc).__qualname__ if module == "builtins" else f"{module}.{type(exc).__qualname__}"


def _frames(tb: TracebackType | None) -> list[Any]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def locate(exc: BaseException, engine: Any) -> tuple[str, int | None]:
    """(phase, layer index) of the failure, read from the traceback's frames (module docstring)."""
    phase, layer = "", None
    module = getattr(engine, "module", None)
    in_layers = False
    for frame in _frames(exc.__traceback__):
        owner = frame.f_locals.get("self")
        name = frame.f_code.co_name
        if engine is not None and owner is engine and name.startswith("_exec_"):
            if name in _PHASES:
                action = frame.f_locals.get("action")
                micro_batch = getattr(action, "microbatch", None)
                phase = _PHASES[name] + (f" of micro-batch {micro_batch}" if micro_batch is not None else "")
            elif not phase.startswith(tuple(_PHASES.values())):
                phase = name.removeprefix("_exec_").replace("_", " ")
        if module is not None and owner is module and name == "forward":
            in_layers = True
    if in_layers and isinstance(getattr(module, "curr_layer", None), int):
        layer = module.curr_layer
    return phase, layer


def _memory_now(device: str) -> dict[str, int | None]:
    """The rank's peaks when it failed (torch only if this rank already imported it)."""
    from pipectl.rundir.metrics import rank_memory  # torch-free at import

    figures = rank_memory(device)
    return {
        "peak_allocated_bytes": figures.peak_allocated_bytes,
        "peak_reserved_bytes": figures.peak_reserved_bytes,
        "peak_rss_bytes": figures.peak_rss_bytes,
    }


def failure_record(exc: BaseException, context: RankContext) -> RankFailure:
    """The record of `exc` ending rank `context.rank`."""
    phase, layer = locate(exc, context.engine) if context.engine is not None else ("", None)
    phase = phase or context.phase
    layout = context.layout
    stage_layers = None
    if layout is not None and context.stage is not None and context.stage < len(layout.stage_layers):
        start, end = layout.stage_layers[context.stage]
        stage_layers = (int(start), int(end))
    predicted = None
    if context.stage is not None and context.stage < len(context.predicted_peak_memory_bytes):
        predicted = int(context.predicted_peak_memory_bytes[context.stage])
    try:
        memory = _memory_now(context.device)
    except Exception as measure_error:  # the record matters more than the figures
        log.debug("memory figures unavailable: %s", measure_error)
        memory = {}
    return RankFailure(
        rank=context.rank,
        stage=context.stage,
        step=context.step,
        phase=phase,
        layer_index=layer,
        layer_name=context.layer_names[layer] if layer is not None and layer < len(context.layer_names) else "",
        stage_layers=stage_layers,
        exception=exception_name(exc),
        message=str(exc)[:MESSAGE_CHARS],
        out_of_memory=is_out_of_memory(exc),
        device=context.device,
        layout=layout.label() if layout is not None else "",
        micro_batch_size=layout.micro_batch_size if layout is not None else None,
        recompute=(layout.recompute or layout.checkpoint_layers or layout.selective_recompute) if layout is not None else None,
        pipeline_parallel=layout.pipeline_parallel if layout is not None else None,
        predicted_peak_memory_bytes=predicted,
        time_unix=time.time(),
        **memory,
    )


def failure_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / FAILURE_FILE.format(rank=rank)


def write_failure(run_dir: str | os.PathLike[str], record: RankFailure) -> Path:
    return write_json_atomic(failure_path(run_dir, record.rank), record)


def read_failures(run_dir: str | os.PathLike[str], *, since_unix: float = 0.0) -> list[RankFailure]:
    """The failure records written at or after `since_unix`, the first failure first.

    Out-of-memory records come first: when one rank runs out of memory its peers fail too
    (their connection to it closes), usually a moment later, but the cause is the memory.
    Unreadable records are skipped with a warning.
    """
    records = []
    for path in sorted((Path(run_dir) / LOGS_DIR).glob(FAILURE_FILE.format(rank="*"))):
        try:
            record = RankFailure.model_validate_json(path.read_text())
        except (OSError, ValueError, ValidationError) as exc:
            log.warning("%s skipped: %s", path, exc)
            continue
        if record.time_unix >= since_unix:
            records.append(record)
    return sorted(records, key=lambda r: (not r.out_of_memory, r.time_unix, r.rank))


def write_resume(run_dir: str | os.PathLike[str], record: ResumeRecord) -> Path:
    """logs/resume.json (rank 0, once the checkpoint is loaded)."""
    return write_json_atomic(Path(run_dir) / LOGS_DIR / RESUME_FILE, record)


def read_resume(run_dir: str | os.PathLike[str], *, since_unix: float = 0.0) -> ResumeRecord | None:
    """The resume record written at or after `since_unix` (by the job started then), or None."""
    from pipectl.rundir.metrics import resume_record  # one reader: metrics.jsonl's readers take it too

    record = resume_record(run_dir)
    return record if record is not None and record.time_unix >= since_unix else None


def resume_lines(record: ResumeRecord) -> list[str]:
    """Lines for the terminal on where a job resumed: one per checkpoint that could not be loaded
    (the last one ending with the step resumed from); nothing for a fresh start with nothing skipped.

    >>> resume_lines(ResumeRecord(step=4, tag="step00000004", skipped=["checkpoint step 8 could not be loaded (f: why)"]))
    ['checkpoint step 8 could not be loaded (f: why); resumed from step 4']
    """
    start = f"resumed from step {record.step}" if record.tag is not None else "started from step 0"
    if not record.skipped:
        return [start] if record.tag is not None else []
    return [*record.skipped[:-1], f"{record.skipped[-1]}; {start}"]
