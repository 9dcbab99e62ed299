"""What rank 0 tells people about each step besides metrics.jsonl: a one-line summary on its
output every `log_every` steps (a rank's output is what a Slurm job's slurm-ID.out and a local
run's logs/engine.log show while it trains), TensorBoard scalars against the step when the job
asks for them (`launch --tensorboard`, through torch's own `SummaryWriter`), and Weights & Biases
(`launch --wandb PROJECT`).

A resumed or requeued job appends to the same TensorBoard folder: each start writes a new
event file, and TensorBoard merges a folder's files by step. A resume trains again the steps after
its checkpoint, so each start marks its first step (`SummaryWriter`'s `purge_step`): TensorBoard
hides what earlier starts wrote from that step on, and shows one trajectory, as metrics.jsonl's
readers do. W&B's steps only go forward: there a step trained again keeps the values it was first
logged with, and the start logs from the first step W&B has not seen. W&B sees one run for the whole run:
its id is made at the first launch and kept in job.json, and every start (a resume, a requeue, a
resize) resumes that W&B run (`resume="allow"`). Its files go under RUN/wandb/ (offline with
WANDB_MODE=offline, synced later with `wandb sync`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pipectl.artifacts.run import StepMetrics

TENSORBOARD_DIR = "tensorboard"  # in the run directory


def step_line(line: StepMetrics, steps: int) -> str:
    """'step 12/100 loss 4.4572 lr 1.00e-03 grad-norm 1.23 207.3 samples/s 26,534 tokens/s MFU 41.2 %
    step 77.2 ms (predicted 60.3 ms)': what the step did, in one line.

    >>> m = StepMetrics(step=3, loss=4.5, step_seconds=0.5, predicted_step_seconds=0.4, samples_per_second=32,
    ...                 global_batch=16, world_size=2, learning_rate=1e-3, grad_norm=0.5, tokens_per_second=4096)
    >>> step_line(m, 10)
    'step 3/10 loss 4.5000 lr 1.00e-03 grad-norm 0.500 32.0 samples/s 4,096 tokens/s step 500.0 ms (predicted 400.0 ms)'
    """
    parts = [f"step {line.step}/{steps}", f"loss {line.loss:.4f}"]
    if line.learning_rate is not None:
        parts.append(f"lr {line.learning_rate:.2e}")
    if line.grad_norm is not None:
        # Three figures, trailing zeros kept: a norm that moves from 2.71 to 2.70 keeps its width.
        parts.append(f"grad-norm {line.grad_norm:#.3g}".rstrip("."))
    parts.append(f"{line.samples_per_second:.1f} samples/s")
    if line.tokens_per_second is not None:
        parts.append(f"{line.tokens_per_second:,.0f} tokens/s")
    if line.mfu is not None:
        parts.append(f"MFU {100 * line.mfu:.1f} %")
    parts.append(f"step {line.step_seconds * 1e3:.1f} ms")
    if line.predicted_step_seconds:
        parts[-1] += f" (predicted {line.predicted_step_seconds * 1e3:.1f} ms)"
    return " ".join(parts)


def scalars(line: StepMetrics) -> dict[str, float]:
    """The line's figures as TensorBoard tags (those it has)."""
    figures = {
        "train/loss": line.loss,
        "train/learning_rate": line.learning_rate,
        "train/grad_norm": line.grad_norm,
        "speed/samples_per_second": line.samples_per_second,
        "speed/tokens_per_second": line.tokens_per_second,
        "speed/mfu": line.mfu,
        "time/step_seconds": line.step_seconds,
        "time/predicted_step_seconds": line.predicted_step_seconds,
    }
    for stage, peak in enumerate(line.stage_peak_memory_bytes):
        figures[f"memory/stage{stage}_peak_gib"] = peak / 2**30
    return {tag: float(value) for tag, value in figures.items() if value is not None}


class StepMonitor:
    """Rank 0's step summaries and TensorBoard writer (`step` after each metrics line)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None,
        steps: int,
        *,
        log_every: int,
        tensorboard: bool,
        wandb: tuple[str, str] | None = None,
        first_step: int = 1,
    ) -> None:
        self.steps = steps
        self.log_every = log_every
        self.writer: Any = None
        self.wandb: Any = None
        if tensorboard and run_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (launch checks)

            purge = first_step if first_step > 1 else None  # a resume: what earlier starts wrote from here on is stale
            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge)
        if wandb is not None and run_dir is not None:
            import wandb as wandb_module  # the optional extra (launch checks)

            project, run_id = wandb
            # The rank's output stays its own (console capture off): a Slurm job's log reads as without W&B.
            self.wandb = wandb_module.init(
                project=project, id=run_id, resume="allow", dir=str(run_dir), name=Path(run_dir).name,
                settings=wandb_module.Settings(console="off"),
            )  # fmt: skip

    def step(self, line: StepMetrics) -> None:
        if self.log_every and (line.step % self.log_every == 0 or line.step == self.steps):
            print(step_line(line, self.steps), file=sys.stdout, flush=True)
        if self.writer is not None:
            for tag, value in scalars(line).items():
                self.writer.add_scalar(tag, value, global_step=line.step, walltime=line.time_unix or None)
            self.writer.flush()  # a reader (or a kill) sees every step written
        if self.wandb is not None and line.step >= self.wandb.step:  # W&B drops, with a warning, steps below its own
            self.wandb.log(scalars(line), step=line.step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
