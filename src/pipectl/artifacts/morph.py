"""The morph history of a run: RUN/morphs.jsonl, one `MorphRecord` per resize (job morphing, docs/design.md, 'Resize and recovery').

A resize takes one of two paths. A restart stops the job at a step boundary, checkpoints, and
relaunches it on the new layout; its record is appended at the relaunch, before the new layout has
run a step, and its downtime is filled in once metrics.jsonl shows the first step completed there:

    requested_unix ──(stop at a step boundary, checkpoint)──► relaunched_unix ──► first_step_unix
    └──────────────────────────── downtime_seconds ──────────────────────────────┘

A live resize (`runtime/elastic/live_resize.py`) keeps the job running: at a step boundary the ranks hand their
state to the new layout's ranks in memory and go on; rank 0 appends the record after the first step
on the new layout, with the pause (last step completed before -> first step begun after), its phases
and the bytes moved.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, model_validator

from pipectl.artifacts.base import Artifact
from pipectl.artifacts.layout import LayoutLabel

MORPHS_FILE = "morphs.jsonl"


class MorphTrigger(str, Enum):
    """Who asked for the new layout."""

    RESIZE = "resize"  # `pipectl resize` (a user or a scheduler)
    ELASTIC = "elastic"  # the elastic engine re-formed the group with another world size
    FAILURE = "failure"  # a data-parallel replica was lost; the survivors took over in memory
    RESUME = "resume"  # `pipectl launch --resume` with a plan of another layout (the user's choice)


class MorphRecord(Artifact):
    """One line of RUN/morphs.jsonl: the job moved from one layout to another."""

    schema_version: Literal[1] = 1
    trigger: MorphTrigger = Field(default=MorphTrigger.RESIZE, description="Who asked for the new layout.")
    requested_unix: float = Field(description="When the resize was requested (seconds since the epoch).")
    requested_devices: int = Field(gt=0, description="Devices asked for (before leaving out stragglers).")
    from_devices: int = Field(gt=0, description="Ranks of the layout that ran before.")
    from_layout: LayoutLabel = Field(description="Layout label before, e.g. 't1p2d1 1f1b b2 m4'.")
    to_devices: int = Field(gt=0, description="Ranks of the new layout (may be fewer than requested).")
    to_layout: LayoutLabel = Field(description="Layout label after.")
    global_batch: int = Field(gt=0, description="B: the same before and after, by construction.")
    resume_step: int = Field(ge=0, description="Optimizer steps in the checkpoint the new layout starts from.")
    target_steps: int = Field(gt=0, description="Total steps the relaunched job trains up to.")
    stopped_running_job: bool = Field(description="Whether a running job had to be stopped first.")
    stop_seconds: float | None = Field(
        default=None, ge=0, description="Request -> the old job's ranks exited (after their checkpoint)."
    )
    relaunched_unix: float | None = Field(default=None, description="When the new layout's launcher started.")
    first_step_unix: float | None = Field(
        default=None, description="When the first step on the new layout completed (from metrics.jsonl)."
    )
    downtime_seconds: float | None = Field(
        default=None, ge=0, description="requested -> first completed step on the new layout."
    )
    plan_source: Literal["morph-table", "re-planned", "chosen"] = Field(
        description="Where the new layout came from."
    )
    excluded_ranks: list[int] = Field(default_factory=list, description="Straggler ranks left out.")
    path: Literal["restart", "live"] = Field(
        default="restart",
        description="restart: stopped, checkpointed and relaunched; live: the running ranks handed their state over in memory.",
    )
    pause_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Live: training halted, from the last step completed before to the first step begun after.",
    )
    pause_phases: dict[str, float] = Field(
        default_factory=dict,
        description="Live: rank 0's seconds per phase of the pause (capture, exchange, group, build, restore).",
    )
    bytes_moved: int | None = Field(default=None, ge=0, description="Live: state bytes sent from rank to rank.")
    notes: list[str] = Field(default_factory=list, description="What the user should know (fewer devices, ...).")
    failed_exit_code: int | None = Field(
        default=None,
        description="Set when the relaunched job ended with this exit code before it trained a step on the new layout: the move did not take place.",
    )

    @model_validator(mode="after")
    def _downtime_matches_times(self) -> "MorphRecord":
        if self.first_step_unix is not None and self.downtime_seconds is None:
            raise ValueError("first_step_unix is set but downtime_seconds is not")
        return self


LIVE_REQUEST_FILE = "resize_requested.json"  # in RUN: a live resize for the running job to take


class LiveResizeRequest(Artifact):
    """RUN/resize_requested.json: written by `pipectl resize` once any joining ranks are ready; the
    running ranks take it at their next step boundary (`runtime/elastic/live_resize.py`)."""

    schema_version: Literal[1] = 1
    generation: int = Field(ge=1, description="1 for the job's first live resize, then 2, ...")
    from_devices: int = Field(gt=0, description="Ranks handing their state over.")
    to_devices: int = Field(gt=0, description="Ranks of the new layout (its run files in `staged`).")
    master_addr: str = Field(description="Where the new layout's ranks meet.")
    master_port: int = Field(gt=0, lt=65536, description="A port free for the new layout's process group.")
    record: MorphRecord = Field(description="The morph as decided; the ranks fill in what they measure.")
    survivors: list[int] = Field(
        default_factory=list,
        description="A recovery after a loss: the old ranks still alive, in their new order (rank i of the meeting "
        "group is survivors[i]); they hand over what they hold of every old rank's state. Empty: a planned resize.",
    )
    meeting_port: int | None = Field(
        default=None, gt=0, lt=65536, description="A recovery: where all the survivors first meet to hand over."
    )
    staged: str | None = Field(
        default=None,
        description="The folder (relative to the run) holding the new layout's run files; rank 0 moves them into "
        "the run after the first step on it. None: the run's own files already describe it (a recovery).",
    )

    @model_validator(mode="after")
    def _recovery_is_whole(self) -> "LiveResizeRequest":
        if self.survivors and self.meeting_port is None:
            raise ValueError("survivors are named but no meeting_port")
        if len(set(self.survivors)) != len(self.survivors) or any(not 0 <= r < self.from_devices for r in self.survivors):
            raise ValueError(f"survivors {self.survivors} are not distinct ranks below from_devices {self.from_devices}")
        if self.survivors and self.to_devices > len(self.survivors):
            raise ValueError(f"to_devices {self.to_devices} exceeds the {len(self.survivors)} survivors")
        return self

    @property
    def recovery(self) -> bool:
        return bool(self.survivors)


RECOVERY_FILE = "recovery.json"  # in RUN/logs: what the replicas agent did about a lost replica


class RecoveryRecord(Artifact):
    """RUN/logs/recovery.json: a data-parallel replica was lost under `launch --recover-in-memory`,
    and whether the survivors took over in memory (`resize/replicas.py`)."""

    schema_version: Literal[1] = 1
    time_unix: float = Field(description="When the loss was seen (seconds since the epoch).")
    lost_replicas: list[int] = Field(description="Data-parallel replicas lost (their torchrun exited with an error).")
    lost_ranks: list[int] = Field(description="Their ranks.")
    recovered: bool = Field(description="Whether the survivors were asked to take over in memory.")
    reason: str = Field(description="What happened, or why the survivors could not take over.")
    to_layout: LayoutLabel | None = Field(default=None, description="The survivors' layout, when recovered.")
