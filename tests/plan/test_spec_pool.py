"""The specs of a search as columns: the same order, figures and engines as the spec objects give."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipectl.artifacts.plan import Engine, Objective, PlanRequest
from pipectl.cluster import load_cluster
from pipectl.plan.costs import hardware_for
from pipectl.plan.homogeneous import goal_for
from pipectl.plan.morph_table import LIKELY_TIMED, _split_count
from pipectl.plan.space import enumerate_specs, search_space
from pipectl.plan.spec_costs import _figures_of_one_depth, point_bounds
from pipectl.plan.spec_pool import SpecPool
from pipectl.schedule import ScheduleKind
from pipectl.testing.profiles import synthetic_profile


def _enumeration(request: PlanRequest, devices: int = 32, workers: int = 1):
    profile = synthetic_profile(blocks=8, micro_batch_sizes=[1, 2, 4])
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    space = search_space(request, profile, hardware)
    return profile, hardware, enumerate_specs(profile, hardware, space, devices, workers=workers)


@pytest.fixture(scope="module")
def searched():
    request = PlanRequest(global_batch=32, schedules=list(ScheduleKind), zero_stages=[0, 1, 2, 3])
    return _enumeration(request)


def test_columns_are_what_each_spec_says(searched):
    _, _, enumeration = searched
    pool = enumeration.specs
    specs = list(pool)
    assert len(specs) > 100
    assert pool.bounds.tolist() == [spec.lower_bound_seconds for spec in specs]
    assert pool.devices.tolist() == [spec.devices for spec in specs]
    assert pool.zero_stages.tolist() == [spec.zero_stage for spec in specs]
    assert pool.pipeline_parallel.tolist() == [spec.shape.pipeline_parallel for spec in specs]
    for engine in Engine:
        assert pool.runs_on(engine).tolist() == [spec.runs_on(engine) for spec in specs]
    # Both engines' answers differ somewhere, or the columns above would test little.
    assert 0 < pool.runs_on(Engine.DEEPSPEED).sum() < len(pool)
    assert 0 < pool.runs_on(Engine.TORCH).sum() < len(pool)


def test_a_spec_is_one_object_however_it_is_reached(searched):
    _, _, enumeration = searched
    pool = enumeration.specs
    part = pool.take(pool.devices <= 8)
    positions = np.flatnonzero(pool.devices <= 8)
    assert len(part) == len(positions) > 0
    assert all(part[i] is pool[int(j)] for i, j in enumerate(positions))


def test_figures_read_one_at_a_time_are_those_of_all_points_at_once(monkeypatch):
    # The points each unit bounds, captured on their way: the pool's specs are them, in order.
    import pipectl.plan.space as space_module

    found = []

    def capture(points, *args, **kwargs):
        found.extend(points)
        return point_bounds(points, *args, **kwargs)

    monkeypatch.setattr(space_module, "point_bounds", capture)
    profile, hardware, enumeration = _enumeration(
        PlanRequest(global_batch=32, schedules=list(ScheduleKind), zero_stages=[0, 1, 2, 3])
    )
    specs = list(enumeration.specs)
    assert len(specs) == len(found) > 100
    groups: dict[tuple, list[int]] = {}
    for index, (shape, variant, _) in enumerate(found):
        groups.setdefault((shape.pipeline_parallel, variant), []).append(index)
    for (_, variant), indices in groups.items():  # every point of a depth and schedule at once
        peaks, allreduce, optimizer, bounds = _figures_of_one_depth(
            [found[i][0] for i in indices], [found[i][1] for i in indices], [found[i][2] for i in indices], hardware, profile.dtype, {}
        )
        for row, index in enumerate(indices):
            spec = specs[index]
            assert (spec.data_parallel, spec.micro_batches, spec.zero_stage) == found[index][2][:3]
            assert spec.lower_bound_seconds == bounds[row]
            assert spec.peak_memory_bytes == tuple(peaks[row].tolist())
            assert spec.allreduce_seconds == tuple(allreduce[row].tolist())
            assert spec.optimizer_seconds == tuple(optimizer[row].tolist())


def test_the_pool_is_the_same_from_several_processes(monkeypatch):
    import pipectl.plan.space as space_module

    monkeypatch.setattr(space_module, "PARALLEL_MIN_FAMILIES", 0)  # share even this small search
    request = PlanRequest(global_batch=32, schedules=list(ScheduleKind), zero_stages=[0, 1, 2, 3])
    *_, one = _enumeration(request, workers=1)
    *_, two = _enumeration(request, workers=2)
    assert one.specs.bounds.tolist() == two.specs.bounds.tolist()
    assert [s.key for s in one.specs] == [s.key for s in two.specs]
    assert [s.peak_memory_bytes for s in one.specs] == [s.peak_memory_bytes for s in two.specs]
    assert [s.allreduce_seconds for s in one.specs] == [s.allreduce_seconds for s in two.specs]


def test_a_unit_sent_to_another_process_rebuilds_every_point():
    import pickle

    from pipectl.plan.candidates import ShapeBuilder
    from pipectl.plan.families import UnitContext

    request = PlanRequest(global_batch=32, schedules=list(ScheduleKind), zero_stages=[0, 1, 2, 3])
    profile = synthetic_profile(blocks=8, micro_batch_sizes=[1, 2, 4])
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    space = search_space(request, profile, hardware)
    builder = ShapeBuilder(profile, hardware, kept_together=space.kept_together)
    context = UnitContext(profile, hardware, space, 32)
    result = context.enumerate_unit(builder, 1, 2)
    sent = pickle.loads(pickle.dumps(result.portable()))
    assert len(sent) == len(result.accepted) > 50
    elsewhere = ShapeBuilder(profile, hardware, kept_together=space.kept_together)
    for row, (shape, variant, point) in enumerate(result.accepted):
        cut, sent_variant = sent.pairs[sent.pair_of[row]]
        rebuilt = elsewhere.shape_from_cuts(*cut)
        assert sent_variant == variant
        assert (rebuilt.pipeline_parallel, rebuilt.stage_layers, rebuilt.recompute) == (
            shape.pipeline_parallel, shape.stage_layers, shape.recompute
        )
        assert context.point(rebuilt, variant, int(sent.data_parallel[row]), int(sent.zero_stages[row])) == point
    assert {point[2] for _, _, point in result.accepted} >= {0, 1, 2}  # ZeRO-2/3 points rebuilt too


@pytest.mark.parametrize("price", [0.5, 1e9])  # cost per sample below and above the step times
@pytest.mark.parametrize("objective", [Objective.TIME, Objective.COST, Objective.COST_DEADLINE])
def test_bound_order_is_a_stable_sort_by_the_bound_key(searched, objective, price):
    profile, hardware, enumeration = searched
    hardware = dataclasses.replace(hardware, price_per_device_hour=price)
    # A deadline that about half of the specs' bounds meet, so both kinds of key are ranked.
    bounds = enumeration.specs.bounds
    deadline_hours = float(np.median(bounds)) * 1000 / 3600
    request = PlanRequest(
        global_batch=32, objective=objective,
        **({"deadline_hours": deadline_hours, "samples": 32_000} if objective is Objective.COST_DEADLINE else {}),
    )
    goal = goal_for(request, profile, hardware)
    pool = enumeration.specs
    expected = sorted(range(len(pool)), key=lambda i: goal.bound_key(pool[i]))
    assert goal.bound_order(pool).tolist() == expected
    if objective is Objective.COST_DEADLINE:
        met = [goal.bound_key(pool[i])[0] == 0 for i in expected]
        assert 0 < sum(met) < len(met)


def test_split_count_halves_the_specs_likely_to_be_evaluated(searched):
    _, _, enumeration = searched
    pool = enumeration.specs
    specs = list(pool)
    # Spec by spec: the count at which half of the likely ones are on as many devices or fewer.
    least_at: dict[int, float] = {}
    for spec in specs:
        least_at[spec.devices] = min(least_at.get(spec.devices, float("inf")), spec.lower_bound_seconds)
    least = float("inf")
    for count in sorted(least_at):
        least = least_at[count] = min(least, least_at[count])
    likely = sorted(
        (spec.devices, 1) for spec in specs
        if spec.lower_bound_seconds <= least_at[spec.devices] * (1 + LIKELY_TIMED)
    )
    half, done, expected = sum(work for _, work in likely) / 2, 0, None
    for count, work in likely:
        done += work
        if done >= half:
            expected = count
            break
    assert _split_count(pool) == expected
    assert min(pool.devices) < expected <= max(pool.devices)
