"""Each step's record in a rank (loss, step time, forward and backward seconds from the executed
actions, memory, learning rate, gradient norm) and the metrics line rank 0 writes from it, with
every rank's detail gathered on the steps it is due."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from pipectl.artifacts.run import RankTiming, StepMetrics
from pipectl.rundir.metrics import RankMemory, node_name, stage_peaks
from pipectl.schedule.ir import ActionKind
from pipectl.runtime.job import TrainingJob


@dataclass
class StepRecord:
    """What one rank saw of one step."""

    step: int  # 1-based: optimizer steps completed after it
    loss: float
    step_seconds: float
    forward_seconds: float
    backward_seconds: float
    memory: RankMemory | None = None  # the rank's peaks in this step
    p2p_seconds: float | None = None  # in sends and receives (waiting for peers included)
    end_of_step_seconds: float | None = None  # gradient reductions, the optimizer step and its checkpoint wait
    optimizer_seconds: float | None = None  # the optimizer step alone
    checkpoint_seconds: float | None = None  # the optimizer step's wait for a checkpoint's copies
    learning_rate: float | None = None  # the step's (read before it: the scheduler moves on after)
    grad_norm: float | None = None  # before clipping, where the engine computes it


# Backward work: whole backwards, and the split backward's input and weight gradients (zb-h1).
BACKWARD_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


def step_record(engine, step: int, loss: float, elapsed: float, memory: RankMemory) -> StepRecord:
    forward = sum(r.seconds for r in engine.executed if r.action.kind not in BACKWARD_KINDS)
    backward = sum(r.seconds for r in engine.executed if r.action.kind in BACKWARD_KINDS)
    phases = getattr(engine, "phase_seconds", {})
    optimizer = phases.get("optimizer")
    end = None if optimizer is None else phases.get("reductions", 0.0) + optimizer
    checkpoint = phases.get("checkpoint")
    if end is not None and checkpoint is not None:
        end += checkpoint
    return StepRecord(
        step, loss, elapsed, forward, backward, memory, phases.get("p2p"), end,
        optimizer_seconds=optimizer, checkpoint_seconds=checkpoint,
    )  # fmt: skip


def learning_rate_of(engine) -> float | None:
    """The learning rate the next step trains with (DeepSpeed's `get_lr`, the torch engine's)."""
    try:
        rates = engine.get_lr()
    except (AttributeError, IndexError, TypeError):
        return None
    return float(rates[0]) if rates else None


def grad_norm_of(engine) -> float | None:
    """The global gradient norm of the step just taken, before clipping; None where the engine
    computes none (DeepSpeed does when it clips)."""
    try:
        norm = engine.get_global_grad_norm()
    except AttributeError:
        return None
    if norm is None:
        return None
    norm = float(norm.item() if hasattr(norm, "item") else norm)
    return norm if math.isfinite(norm) else None


RANK_DETAIL_EVERY_STEP_UP_TO = 64  # ranks; a larger job gathers its ranks' detail every RANK_DETAIL_EVERY steps
RANK_DETAIL_EVERY = 10


def rank_detail_due(world_size: int, step: int) -> bool:
    """Whether this step gathers every rank's timings and memory (one all-gather of a tuple per
    rank): every step up to 64 ranks, else the first step and every 10th, so that a job of
    thousands of ranks spends no collective per step on its own bookkeeping.

    >>> [rank_detail_due(3072, s) for s in (1, 2, 10)], rank_detail_due(64, 7)
    ([True, False, True], True)
    """
    return world_size <= RANK_DETAIL_EVERY_STEP_UP_TO or step == 1 or step % RANK_DETAIL_EVERY == 0


def write_metrics(writer, job: TrainingJob, engine, record: StepRecord) -> StepMetrics | None:
    """Gather every rank's heartbeat and memory (one collective), rank 0 appends the line (and
    returns it; other ranks return None)."""
    import torch.distributed as torch_dist  # torch, after dsinit

    memory = record.memory
    replica = engine.grid.data_parallel_id
    micro_batch_size, micro_batches = job.layout.replica_share(replica)
    mine = (
        engine.global_rank,
        engine.stage_id,
        micro_batch_size * micro_batches,
        job.replica_kinds[replica] if job.replica_kinds else None,
        node_name(),
        record.forward_seconds,
        record.backward_seconds,
        record.p2p_seconds,
        record.end_of_step_seconds,
        record.optimizer_seconds,
        record.checkpoint_seconds,
        memory.peak_allocated_bytes if memory else None,
        memory.peak_reserved_bytes if memory else None,
        memory.peak_rss_bytes if memory else None,
    )
    gathered: list[Any] = []
    if rank_detail_due(job.layout.world_size, record.step):  # the same answer on every rank
        gathered = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(gathered, mine)
    if engine.global_rank != 0:
        return None
    layout = job.layout
    samples_per_second = layout.global_batch / record.step_seconds if record.step_seconds > 0 else 0.0
    ranks = [
        RankTiming(
            rank=r,
            stage=s,
            samples=samples,
            device=device,
            host=host,
            forward_seconds=f,
            backward_seconds=b,
            p2p_seconds=p2p,
            end_of_step_seconds=end,
            optimizer_seconds=optimizer,
            checkpoint_seconds=checkpoint,
            peak_allocated_bytes=allocated,
            peak_reserved_bytes=reserved,
            peak_rss_bytes=rss,
        )
        for r, s, samples, device, host, f, b, p2p, end, optimizer, checkpoint, allocated, reserved, rss in gathered
    ]
    line = StepMetrics(
        step=record.step,
        loss=record.loss,
        step_seconds=record.step_seconds,
        predicted_step_seconds=job.predicted_step_seconds,
        samples_per_second=samples_per_second,
        learning_rate=record.learning_rate,
        grad_norm=record.grad_norm,
        tokens_per_second=samples_per_second * job.seq_len if job.seq_len else None,
        mfu=job.ideal_step_seconds / record.step_seconds if job.ideal_step_seconds and record.step_seconds > 0 else None,
        global_batch=layout.global_batch,
        world_size=layout.world_size,
        layout=layout.label(),
        time_unix=time.time(),
        ranks=ranks,
        predicted_peak_memory_bytes=list(job.predicted_peak_memory_bytes),
        stage_peak_memory_bytes=stage_peaks(ranks, layout.pipeline_parallel),
    )
    writer.write(line)
    return line
