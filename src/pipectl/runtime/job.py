"""What a rank trains: the model, its layout, the DeepSpeed config, the steps, checkpoints and
metrics settings, read from a run directory (job.json, plan.json, ds_config.json) by
`TrainingJob.from_run_dir`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipectl.artifacts.layout import Layout
from pipectl.artifacts.plan import Engine, Plan
from pipectl.artifacts.run import JobSpec
from pipectl.io import load_model, read_mapping
from pipectl.runtime.engines.dsconfig import check_torch_candidate
from pipectl.runtime.elastic.world_size import ds_config_for_candidate, plan_for_world_size
from pipectl.runtime.liveness import job_collective_timeout_seconds
from pipectl.schedule.ir import Schedule


@dataclass(frozen=True)
class TrainingJob:
    """Everything `train` needs; `from_run_dir` reads it from a run directory."""

    model: str
    layout: Layout
    ds_config: dict[str, Any]
    steps: int
    seed: int = 0
    data: str | None = None  # None/"corpus": built-in byte corpus; "synthetic"; or a token file path
    run_dir: Path | None = None
    checkpoint_every: int = 0
    checkpoint_every_seconds: float = 0.0
    checkpoint_auto: bool = False
    mtbf_hours: float | None = None
    keep_checkpoints: int = 3
    predicted_step_seconds: float | None = None
    predicted_peak_memory_bytes: tuple[int, ...] = ()  # per pipeline stage, from the plan
    schedule: Schedule | None = None  # overrides the generated schedule (tests)
    collective_timeout_seconds: float | None = None  # None: torch's and DeepSpeed's defaults
    replica_kinds: tuple[str, ...] = ()  # the device kind of each data-parallel replica, from the plan
    compute_slowdowns: dict[str, float] = field(default_factory=dict)  # emulated slower kinds (JobSpec's)
    recover_in_memory: bool = False  # keep a copy of the neighbour replica's state (`recovery`)
    train_without_checkpoints: bool = False  # train on when the first checkpoint finds no room (`Checkpointer`)
    seq_len: int | None = None  # tokens per sample (transformers): tokens/s in metrics
    ideal_step_seconds: float | None = None  # the step at 100 % MFU (`plan.flops.ideal_step_seconds`)
    log_every: int = 0  # rank 0 prints a step summary every this many steps
    tensorboard: bool = False  # rank 0 writes RUN/tensorboard/
    wandb: tuple[str, str] | None = None  # (project, run id): rank 0 logs each step to Weights & Biases

    @classmethod
    def from_run_dir(cls, run_dir: str | os.PathLike[str], files: str | os.PathLike[str] | None = None) -> "TrainingJob":
        """The job of `run_dir`, its run files read from `files` (default the run itself; a live
        resize's staged folder, `live_requests.files_of`)."""
        run_dir = Path(run_dir)
        files = run_dir if files is None else Path(files)
        job = load_model(JobSpec, files / "job.json")
        plan = load_model(Plan, files / job.plan_file)
        ds_config = read_mapping(files / job.ds_config_file)
        candidate = plan.chosen
        # The worker on an elastic restart may see another world size: take the morph table's plan.
        world = int(os.environ.get("WORLD_SIZE", candidate.devices))
        if world != candidate.devices:
            candidate = plan_for_world_size(plan, world)
            ds_config = ds_config_for_candidate(ds_config, candidate, plan.global_batch)
        elif candidate.engine is Engine.TORCH:
            # What launch checked, again: the run directory may have been edited since.
            check_torch_candidate(candidate)
        from pipectl.plan.flops import PRECISION_DTYPE, ideal_step_seconds

        data = job.data.source()
        return cls(
            model=job.model,
            layout=Layout.from_candidate(candidate),
            ds_config=ds_config,
            steps=job.steps,
            seed=job.seed,
            data=data,
            run_dir=run_dir,
            checkpoint_every=job.checkpoint_every,
            checkpoint_every_seconds=job.checkpoint_every_seconds,
            checkpoint_auto=job.checkpoint_auto,
            mtbf_hours=job.mtbf_hours,
            keep_checkpoints=job.keep_checkpoints,
            train_without_checkpoints=job.train_without_checkpoints,
            predicted_step_seconds=candidate.predicted_step_seconds,
            predicted_peak_memory_bytes=tuple(candidate.peak_memory_bytes),
            collective_timeout_seconds=job_collective_timeout_seconds(job, candidate),
            replica_kinds=candidate.replica_kinds,
            compute_slowdowns=job.compute_slowdowns,
            recover_in_memory=job.recover_in_memory,
            seq_len=plan.model_shape.seq_len if plan.model_shape is not None else None,
            ideal_step_seconds=ideal_step_seconds(plan, candidate, PRECISION_DTYPE[job.precision.value]),
            log_every=job.log_every,
            tensorboard=job.tensorboard,
            wandb=(job.wandb_project, job.wandb_run_id) if job.wandb_project and job.wandb_run_id else None,
        )
