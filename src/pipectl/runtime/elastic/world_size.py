"""Elastic restarts: when torchrun re-forms the group with another world size, every rank takes
the morph table's layout for that size, and the DeepSpeed config's batch and pipeline keys of it.

`pipectl resize` chooses from the same morph table (`resize.choose`), so a user's resize and an
elastic one cannot disagree.
"""

from __future__ import annotations

from typing import Any

from pipectl.artifacts.plan import Candidate, Plan
from pipectl.errors import UserInputError
from pipectl.runtime.engines.dsconfig import (
    batch_section, check_candidate, has_uneven_replicas, stage_partition, uneven_replicas_section,
)


def plan_for_world_size(plan: Plan, world_size: int) -> Candidate:
    """The layout for `world_size` ranks: plan.chosen if it has that size, else the morph table's
    entry (it must use exactly `world_size` ranks: every started rank needs a place).
    """
    if plan.chosen.devices == world_size:
        return plan.chosen
    entry = plan.for_devices(world_size)
    if entry is None or entry.candidate is None:
        known = sorted(e.devices for e in plan.morph_table if e.candidate is not None)
        raise UserInputError(
            f"the plan has no layout for {world_size} ranks (morph table: {known or 'empty'})",
            hint="plan with --morph-counts naming every size the elastic range allows (or --morph-counts all)",
        )
    if entry.candidate.devices != world_size:
        raise UserInputError(
            f"the morph table's plan for {world_size} ranks uses only {entry.candidate.devices} "
            f"(the global batch {plan.global_batch} cannot be split over {world_size}); an elastic group "
            f"of {world_size} ranks cannot run it",
            hint="choose an elastic range whose sizes divide the global batch",
        )
    return entry.candidate


def ds_config_for_candidate(ds_config: dict[str, Any], candidate: Candidate, global_batch: int) -> dict[str, Any]:
    """`ds_config` with the batch keys and the pipeline section of `candidate`; everything else
    (optimizer, precision, clipping, ZeRO stage) kept. For the worker on an elastic restart.

        >>> from pipectl.artifacts.plan import Candidate
        >>> c = Candidate(devices=1, device="cpu", tensor_parallel=1, pipeline_parallel=1, data_parallel=1,
        ...     micro_batch_size=2, micro_batches=8, schedule="1f1b", recompute=False, zero_stage=1,
        ...     stage_layers=[(0, 9)], predicted_step_seconds=1.0, samples_per_second=16.0,
        ...     tflops_per_device=0.0, peak_memory_bytes=[1], bubble_fraction=0.0,
        ...     communication_fraction=0.0, cost_per_million_samples=0.0)
        >>> old = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
        ...        "gradient_accumulation_steps": 4, "optimizer": {"type": "AdamW"},
        ...        "pipeline": {"stages": 2, "partition": [0, 4, 9]}}
        >>> new = ds_config_for_candidate(old, c, 16)
        >>> new["gradient_accumulation_steps"], new["pipeline"]["partition"], new["optimizer"]
        (8, [0, 9], {'type': 'AdamW'})
    """
    check_candidate(candidate, global_batch=global_batch, layers=candidate.stage_layers[-1][1])
    config = dict(ds_config)
    config.update(
        batch_section(
            micro_batch_size=candidate.micro_batch_size,
            micro_batches=candidate.micro_batches,
            data_parallel=candidate.data_parallel,
        )
    )
    pipeline = dict(config.get("pipeline", {}))
    pipeline.update(stages=candidate.pipeline_parallel, partition=stage_partition(candidate.stage_layers))
    pipeline.pop("uneven_replicas", None)  # the launched layout's
    if has_uneven_replicas(candidate):
        pipeline["uneven_replicas"] = uneven_replicas_section(candidate, global_batch)
    config["pipeline"] = pipeline
    return config
