"""`ResizeOptions`: everything `pipectl resize` takes, declared once (`pipectl.config`).

A resize acts on one run at one moment, so none of its options belongs in a config file: each is
a flag of one invocation, its description the `--help` text.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from pipectl.artifacts.base import INT64_MAX
from pipectl.config import Opt
from pipectl.rundir.stragglers import StragglerPolicy


class ResizeOptions(BaseModel):
    """`pipectl resize`'s flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    devices: Annotated[int, Opt(None)] = Field(description="Devices to run on from now on.")
    steps: Annotated[int | None, Opt(None)] = Field(
        default=None, le=INT64_MAX, description="Total steps to train up to (default: the job's own total)."
    )
    exclude_stragglers: Annotated[bool, Opt(None)] = Field(
        default=False, description="Leave out ranks much slower than their data-parallel peers."
    )
    straggler_slowdown: Annotated[float, Opt(None)] = Field(
        default=StragglerPolicy.slowdown_threshold,
        ge=1.0,
        description="A straggler computes at least this many times as long as its peers.",
    )
    stop_timeout: Annotated[float, Opt(None)] = Field(
        default=300.0, ge=1.0, description="Seconds to wait for a running job to checkpoint and exit."
    )
    timeout: Annotated[float | None, Opt(None)] = Field(
        default=None, ge=1.0, description="Stop the relaunched job after this many seconds."
    )
    dry_run: Annotated[bool, Opt(None)] = Field(default=False, description="Show the new layout; stop, write and start nothing.")
    live: Annotated[bool, Opt(None, flag="--live/--restart")] = Field(
        default=True,
        description="--live (default): a job running here (local or torchrun engine) moves without a restart, its ranks "
        "handing their state over in memory at the next step boundary; otherwise, and with --restart, the job stops at "
        "a step boundary, checkpoints and is relaunched.",
    )
    submit: Annotated[bool, Opt(None)] = Field(default=False, description="Slurm run: submit the new job.sbatch with sbatch.")
    scancel: Annotated[bool, Opt(None)] = Field(
        default=False, description="Slurm run: scancel the running job once its ranks have checkpointed and stopped."
    )
