"""The plan artifact (plan.json): the chosen configuration, the ranked candidates, the morph table.

`launch` reads `chosen`; `resize` reads `morph_table`. Layer ranges are half-open: a stage holding
layers [start, end) owns layer indices start..end-1 of the profile.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, model_validator

from pipectl.artifacts.base import Artifact, Strict
from pipectl.schedule.ir import ScheduleKind


class Objective(str, Enum):
    TIME = "time"
    COST = "cost"
    COST_DEADLINE = "cost-deadline"


class PlanRequest(Strict):
    """What the user asks of the planner (the job part of the three inputs)."""

    global_batch: int = Field(description="B: samples per optimizer step; never changed by the planner.")
    objective: Objective = Objective.TIME
    schedules: list[ScheduleKind] | None = Field(
        default=None, description="Schedules to consider; default 1f1b, gpipe, interleaved, varuna (2bw only if listed)."
    )
    chunks: list[int] = Field(default_factory=lambda: [2, 4], description="v values tried for interleaved.")
    max_tensor_parallel: int | None = Field(default=None, description="Upper bound on t.")
    tensor_parallel: int | None = Field(default=None, description="Pinned t.")
    pipeline_parallel: int | None = Field(default=None, description="Pinned p.")
    data_parallel: int | None = Field(default=None, description="Pinned d.")
    micro_batch_size: int | None = Field(default=None, description="Pinned b.")
    schedule: ScheduleKind | None = Field(default=None, description="Pinned schedule.")
    devices: int | None = Field(default=None, description="Devices to plan for (default: the whole cluster).")
    deadline_hours: float | None = Field(default=None, description="cost-deadline: hours available.")
    samples: int | None = Field(default=None, description="cost-deadline: samples to train on.")
    tokens: int | None = Field(default=None, description="cost-deadline: tokens to train on (samples = tokens / seq_len).")
    allow_recompute: bool = True
    zero_stages: list[int] = Field(default_factory=lambda: [0, 1])
    include_all: bool = Field(default=False, description="Simulate and keep every feasible candidate.")
    for_deepspeed: bool = Field(default=True, description="Choose only schedules DeepSpeed's engine can run.")
    top: int = Field(default=10, description="Candidates kept in the ranking (without include_all).")
    morph: bool = Field(default=True, description="Compute the morph table.")
    workers: int | None = Field(
        default=None,
        exclude=True,
        description="Processes the enumeration may use (default: $PIPECTL_PLAN_WORKERS, else the cores "
        "available). Not recorded in plan.json: the plan is the same for any number.",
    )


class ReplicaShare(Strict):
    """Heterogeneous plans: how much of the global batch one data-parallel replica processes."""

    replica: int = Field(ge=0, description="Data-parallel replica index.")
    device: str = Field(description="Device kind of the replica's devices.")
    micro_batch_size: int = Field(gt=0)
    micro_batches: int = Field(gt=0)
    samples: int = Field(gt=0, description="Samples per step: micro_batch_size * micro_batches.")
    gradient_weight: float = Field(gt=0, description="samples / global batch: weight of its mean gradient.")


class Candidate(Strict):
    """One fully specified configuration and its predicted cost."""

    devices: int = Field(gt=0, description="Devices used: t * p * d (may be fewer than available).")
    device: str = Field(description="Device kind (catalog name); 'mixed' for heterogeneous plans.")
    tensor_parallel: int = Field(gt=0)
    pipeline_parallel: int = Field(gt=0)
    data_parallel: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0, description="b: samples per micro-batch.")
    micro_batches: int = Field(gt=0, description="m: micro-batches per pipeline per step = B / (d * b).")
    chunks: int = Field(default=1, gt=0, description="v: model chunks per device (interleaved).")
    schedule: ScheduleKind
    recompute: bool
    zero_stage: int = Field(ge=0, le=3)
    stage_layers: list[tuple[int, int]] = Field(
        description="Half-open layer index range [start, end) of every (virtual) stage, in order."
    )
    predicted_step_seconds: float = Field(gt=0)
    samples_per_second: float = Field(gt=0)
    tflops_per_device: float = Field(ge=0)
    peak_memory_bytes: list[int] = Field(description="Predicted peak memory per stage (per device).")
    bubble_fraction: float = Field(ge=0, le=1)
    communication_fraction: float = Field(ge=0, le=1)
    cost_per_million_samples: float = Field(ge=0, description="USD per 1 M samples at the cluster's prices.")
    replicas: list[ReplicaShare] | None = Field(
        default=None, description="Uneven batch split over replicas (heterogeneous plans only)."
    )
    deepspeed_runnable: bool = Field(
        default=True, description="Whether DeepSpeed's pipeline engine can execute this schedule."
    )
    notes: list[str] = Field(default_factory=list)

    @property
    def global_batch(self) -> int:
        if self.replicas:
            return sum(r.samples for r in self.replicas)
        return self.data_parallel * self.micro_batch_size * self.micro_batches

    @model_validator(mode="after")
    def _consistent(self) -> "Candidate":
        if self.devices != self.tensor_parallel * self.pipeline_parallel * self.data_parallel:
            raise ValueError(
                f"devices {self.devices} != tensor {self.tensor_parallel} x pipeline "
                f"{self.pipeline_parallel} x data {self.data_parallel}"
            )
        expected = self.pipeline_parallel * self.chunks
        if len(self.stage_layers) != expected:
            raise ValueError(f"stage_layers has {len(self.stage_layers)} ranges, expected p*v = {expected}")
        for (_, end), (start, _) in zip(self.stage_layers, self.stage_layers[1:]):
            if end != start:
                raise ValueError(f"stage_layers must be contiguous, got {self.stage_layers}")
        return self


class MorphEntry(Strict):
    """The best plan at one device count; `candidate` is None when nothing fits there."""

    devices: int = Field(gt=0, description="Devices available.")
    candidate: Candidate | None = None
    note: str = Field(default="", description="Why nothing fits, or why fewer devices are used.")


class Plan(Artifact):
    """plan.json."""

    schema_version: Literal[1] = 1
    model: str = Field(description="Model name from the profile.")
    profile_path: str | None = Field(default=None, description="Profile the plan was made from.")
    cluster: str = Field(description="Cluster name.")
    global_batch: int = Field(gt=0, description="B: samples per optimizer step, fixed by the user.")
    objective: Objective
    layers: int = Field(gt=0, description="Layers in the profile (cuttable units).")
    chosen: Candidate
    candidates: list[Candidate] = Field(default_factory=list, description="Ranked feasible candidates.")
    infeasible: dict[str, int] = Field(
        default_factory=dict, description="Reasons candidates were rejected, with counts."
    )
    morph_table: list[MorphEntry] = Field(default_factory=list, description="Best plan per device count.")
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _batch_kept(self) -> "Plan":
        for cand in [self.chosen, *self.candidates, *(e.candidate for e in self.morph_table if e.candidate)]:
            if cand.global_batch != self.global_batch:
                raise ValueError(
                    f"candidate with d={cand.data_parallel} b={cand.micro_batch_size} "
                    f"m={cand.micro_batches} covers {cand.global_batch} samples, not the global batch "
                    f"{self.global_batch}"
                )
        return self

    def for_devices(self, devices: int) -> MorphEntry | None:
        return next((e for e in self.morph_table if e.devices == devices), None)
