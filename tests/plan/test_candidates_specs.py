"""Specs built for many points of one shape at once equal the per-point definitions exactly."""

from __future__ import annotations

import pytest

from pipectl.cluster import load_cluster
from pipectl.plan.candidates import ScheduleVariant, ShapeBuilder, lower_bound_seconds
from pipectl.plan.spec_costs import data_parallel_costs, in_flight, specs_from_points, state_bytes, step_bytes
from pipectl.plan.costs import hardware_for
from pipectl.testing.profiles import synthetic_profile
from pipectl.models.registry import load_model_config
from pipectl.profile.derive import derive_profile
from pipectl.schedule import ScheduleKind

VARIANTS = [
    ScheduleVariant(ScheduleKind.ONE_F_ONE_B),
    ScheduleVariant(ScheduleKind.GPIPE),
    ScheduleVariant(ScheduleKind.INTERLEAVED, 2),
    ScheduleVariant(ScheduleKind.VARUNA),
    ScheduleVariant(ScheduleKind.PIPEDREAM_2BW),
]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.label)
def test_specs_on_a_shape_match_each_points_own_costs(tied, variant):
    profile = synthetic_profile(
        blocks=10, micro_batch_sizes=[1, 2], tied=tied,
        block_forward_seconds=[0.01 * (1 + 0.4 * (i % 4)) for i in range(10)],
    )
    _check_specs(profile, variant)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.label)
def test_specs_match_each_points_own_costs_with_block_shards(variant):
    # Derived gpt-small: block shards at t = 2 and 4 (tied embeddings, replicated over the tensor group).
    profile = derive_profile(load_model_config("gpt-small"), "a100-80gb", [1, 2])
    assert profile.shard_degrees() == [2, 4]
    _check_specs(profile, variant)


def _check_specs(profile, variant):
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    builder = ShapeBuilder(profile, hardware)
    points = []
    # Several shapes of different and equal depths (p = 4 twice: a balanced and a right-filled cut).
    for t, b, recompute, p, from_right in (
        (1, 1, False, 2, False), (2, 2, True, 3, False), (4, 1, True, 4, False), (4, 1, True, 4, True),
        (1, 2, False, 5, False),
    ):
        shape = builder.shape(t, b, recompute, p, variant.chunks, from_right=from_right)
        for d, zero in ((16, 1), (16, 0), (8, 1), (4, 0), (2, 1), (1, 0), (3, 1)):
            m = p * (1 + d % 3)
            per_device = state_bytes(profile.dtype, zero, d, variant.kind)
            points.append((shape, variant, (d, m, zero, per_device, in_flight(shape, variant, m))))
    specs = specs_from_points(points, hardware, profile.dtype)
    assert len(specs) == len(points)
    for spec, (shape, _, (d, m, zero, per_device, units)) in zip(specs, points):
        allreduce, optimizer = data_parallel_costs(shape, hardware, d, zero, profile.dtype)
        bound = lower_bound_seconds(shape, variant.kind, m, allreduce, optimizer)
        allocated = shape.memory.per_rank_bytes(per_device, step_bytes(profile.dtype, zero, d, variant.kind), units)
        peak = hardware.memory_budget.reserved(allocated)
        assert spec.shape is shape and spec.variant == variant
        assert (spec.data_parallel, spec.micro_batches, spec.zero_stage) == (d, m, zero)
        assert spec.lower_bound_seconds == bound
        assert spec.allreduce_seconds == tuple(allreduce.tolist())
        assert spec.optimizer_seconds == tuple(optimizer.tolist())
        assert spec.peak_memory_bytes == tuple(int(x) for x in peak)
