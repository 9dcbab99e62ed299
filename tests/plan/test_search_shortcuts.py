"""The enumeration's exact shortcuts against the plain definitions on small, memory-tight cases."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pipectl.cluster import load_cluster
from pipectl.plan.candidates import Rejections, ScheduleVariant, ShapeBuilder, recomputing_stages
from pipectl.plan.spec_costs import in_flight, state_bytes, step_bytes
from pipectl.plan.costs import hardware_for
from pipectl.plan.partition import balanced_partition
from pipectl.artifacts.plan import PlanRequest, Recompute
from pipectl.plan.families import _variants_for
from pipectl.plan.family_cuts import Demands, Family, FamilyKey
from pipectl.plan.space import enumerate_specs, search_space
from pipectl.testing.profiles import synthetic_profile
from pipectl.schedule import ScheduleKind


def _profile(blocks: int, seed: int):
    rng = random.Random(seed)
    return synthetic_profile(
        blocks=blocks, micro_batch_sizes=[1, 2], hidden=128, seq_len=256,
        block_forward_seconds=[0.01 * rng.uniform(0.5, 2.0) for _ in range(blocks)],
        head_working_per_logit=rng.choice((0.0, 8.0)), attention_core=(0.4, 0.1),
    )


def _hardware(profile, memory_gib: float):
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    return dataclasses.replace(hardware, device=hardware.device.model_copy(update={"memory_gib": memory_gib, "outside_allocator_gib": 0.0}))


def _memory_fits(builder, shape, kind, per_device, per_step, units, capacity):
    """`balanced_partition`'s per-virtual-stage memory test, written out."""
    rows = builder.range_memory(shape.tensor_parallel, shape.micro_batch_size)
    stages, p = shape.virtual_stages, shape.pipeline_parallel
    recomputes = recomputing_stages(shape, kind)

    def fits(index, start, end):
        if shape.recompute in (Recompute.LAYER, Recompute.SELECTIVE):  # every stage: its layers' inputs, or
            keeps = shape.recompute  # its saved activations less the attention cores'
        else:
            keeps = bool(recomputes[index]) and index != stages - 1
        return rows.stage_bytes(
            start, end, state_bytes=per_device, step_bytes=per_step, units=units[index % p], recompute=keeps
        ) <= capacity

    return fits


@pytest.mark.parametrize("seed", range(4))
def test_a_memory_fitting_cut_exists_exactly_when_the_partitioner_finds_one(seed):
    profile = _profile(blocks=9, seed=seed)
    hardware = _hardware(profile, memory_gib=0.004 * (seed + 1))
    builder = ShapeBuilder(profile, hardware)
    capacity = hardware.memory_bytes
    rng = random.Random(seed)
    answers = set()
    for _ in range(150):
        t, b, recompute = rng.choice((1, 2)), rng.choice((1, 2)), rng.choice(list(Recompute))
        variant = rng.choice([ScheduleVariant(ScheduleKind.ONE_F_ONE_B), ScheduleVariant(ScheduleKind.GPIPE),
                              ScheduleVariant(ScheduleKind.INTERLEAVED, 2), ScheduleVariant(ScheduleKind.VARUNA)])
        if variant.kind is ScheduleKind.VARUNA and recompute in (Recompute.LAYER, Recompute.SELECTIVE):
            continue  # Varuna recomputes whole stages: never searched with per-layer or selective recompute
        p = rng.randint(1, builder.layers // variant.chunks)
        m = p * rng.randint(1, 4)
        zero, d = rng.choice(((0, 1), (1, 2), (1, 8), (0, 4)))
        per_device = state_bytes(profile.dtype, zero, d, variant.kind)
        per_step = step_bytes(profile.dtype, zero, d, variant.kind)
        family = Family(builder, FamilyKey(t, b, recompute, p, variant), capacity, Demands([], [], Rejections(), {per_device: per_step}))
        shape = builder.shape(t, b, recompute, p, variant.chunks)
        units = in_flight(shape, variant, m)
        fits = _memory_fits(builder, shape, variant.kind, per_device, per_step, units, capacity)
        partition = balanced_partition(builder.work(t, b, recompute), p * variant.chunks, fits=fits)
        answer = family.has_memory_fitting_cut(per_device, units)
        assert answer == (partition is not None), (t, b, recompute, p, variant.label, m, zero, d)
        answers.add(answer)
    assert answers == {True, False}  # both outcomes were exercised


def _reference_specs(profile, hardware, space, max_devices):
    """Every point judged on its own, without the caches and dominance shortcuts: the balanced
    cut, else the right-filled cut, else the optimal memory-constrained cut, if it fits."""
    builder = ShapeBuilder(profile, hardware)
    capacity = hardware.memory_bytes
    B = space.global_batch
    found = []
    for t in space.tensor_parallel:
        for b in space.micro_batch_sizes:
            for recompute in space.recompute:
                for p in range(1, builder.layers + 1):
                    if t * p > max_devices or (recompute is Recompute.STAGE and p == 1):
                        continue
                    if B % b:
                        continue
                    # Every d with a micro-batch for each replica; uneven ones run ⌈B/(d*b)⌉ at most.
                    ds = [d for d in range(1, B // b + 1) if t * p * d <= max_devices
                          and (space.uneven_replicas or B % (d * b) == 0)]
                    for variant in _variants_for(space.variants, p, recompute):
                        if p * variant.chunks > builder.layers:
                            continue
                        for d in sorted(ds, reverse=True):
                            m = -(-B // (d * b))
                            if variant.chunks > 1 and (m % p or B % (d * b)):
                                continue
                            for zero in sorted(space.zero_stages if d > 1 else {max(space.zero_stages)}, reverse=True):
                                shape = _reference_fit(builder, t, b, recompute, p, variant, m, zero, d, capacity)
                                if shape is not None:
                                    found.append((t, b, recompute, p, variant.label, d, m, zero, shape.stage_layers))
    return found


def _reference_fit(builder, t, b, recompute, p, variant, m, zero, d, capacity):
    kind = variant.kind
    per_device = state_bytes(builder.profile.dtype, zero, d, kind)
    per_step = step_bytes(builder.profile.dtype, zero, d, kind)
    balanced = builder.shape(t, b, recompute, p, variant.chunks)
    units = in_flight(balanced, variant, m)
    for shape in (balanced, builder.shape(t, b, recompute, p, variant.chunks, from_right=True)):
        if shape.memory.fits(per_device, per_step, units, capacity):
            return shape
    fits = _memory_fits(builder, balanced, kind, per_device, per_step, units, capacity)
    partition = balanced_partition(builder.work(t, b, recompute), p * variant.chunks, fits=fits)
    if partition is None:
        return None
    shape = builder.shape_from_cuts(t, b, recompute, p, variant.chunks, partition.stage_layers)
    return shape if shape.memory.fits(per_device, per_step, units, capacity) else None


@pytest.mark.parametrize("seed", range(3))
def test_enumeration_keeps_exactly_the_points_judged_one_by_one(seed):
    profile = _profile(blocks=8, seed=seed)
    hardware = _hardware(profile, memory_gib=0.003 * (seed + 2))
    request = PlanRequest(global_batch=16, schedules=[ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE, ScheduleKind.VARUNA])
    space = search_space(request, profile, hardware)
    enumeration = enumerate_specs(profile, hardware, space, 32)
    got = [
        (s.shape.tensor_parallel, s.shape.micro_batch_size, s.shape.recompute, s.shape.pipeline_parallel,
         s.variant.label, s.data_parallel, s.micro_batches, s.zero_stage, s.shape.stage_layers)
        for s in enumeration.specs
    ]
    expected = _reference_specs(profile, hardware, space, 32)
    assert got == expected
    assert got and enumeration.rejections.counts  # some points fit and some did not
