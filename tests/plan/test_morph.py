"""Morph table: the counts a job is given covered, fastest at each, B fixed, fewer devices explained."""

from __future__ import annotations

import pytest

from pipectl.cluster import load_cluster, local_cluster
from pipectl.plan.costs import hardware_for
from pipectl.plan.evaluate import Evaluator
from pipectl.plan.morph_table import PrefixMinimum, fastest_per_device_count
from pipectl.artifacts.plan import PlanRequest
from pipectl.plan.search import plan
from pipectl.plan.space import enumerate_specs, search_space
from pipectl.testing.profiles import synthetic_profile


def _profile():
    return synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4],
                             block_forward_seconds=[0.01, 0.012, 0.01, 0.015, 0.01, 0.011])


def test_prefix_minimum():
    tree = PrefixMinimum(10)
    for position, value in [(7, 3.0), (2, 5.0), (9, 1.0), (2, 4.0)]:
        tree.lower(position, value)
    expected = {1: float("inf"), 2: 4.0, 6: 4.0, 7: 3.0, 8: 3.0, 9: 1.0, 10: 1.0}
    for position, value in expected.items():
        assert tree.minimum(position) == value


def test_morph_entries_cover_a_node_then_whole_nodes_and_keep_the_batch():
    result = plan(_profile(), load_cluster("a100-8x8"), PlanRequest(global_batch=24, devices=8))
    counts = [e.devices for e in result.morph_table]
    assert counts == [*range(counts[0], 9), *range(16, 65, 8)]
    assert result.for_devices(8).candidate.devices <= 8
    for entry in result.morph_table:
        assert entry.candidate.global_batch == 24
        assert entry.candidate.devices <= entry.devices
        if entry.candidate.devices < entry.devices:
            assert f"uses {entry.candidate.devices} of {entry.devices}" in entry.note
    steps = [e.candidate.predicted_step_seconds for e in result.morph_table]
    assert all(b <= a for a, b in zip(steps, steps[1:]))  # more devices never slower


@pytest.mark.parametrize("cluster, batch, every, named, expected", [
    ("local-6", 12, False, [], range(1, 7)),  # one node: every count
    ("a100-8x8", 24, False, [], [*range(1, 9), *range(16, 65, 8)]),
    ("a100-8x8", 24, False, [13, 61], [*range(1, 9), 13, *range(16, 57, 8), 61, 64]),
    ("a100-8x8", 24, True, [], range(1, 65)),
])
def test_each_entry_is_the_exhaustive_fastest_on_at_most_its_count(cluster, batch, every, named, expected):
    """A node's counts then whole nodes, with counts named, with every count: entry c is the
    fastest runnable spec on at most c devices, on fewer only when faster."""
    profile = _profile()
    cluster = local_cluster(6) if cluster == "local-6" else load_cluster(cluster)
    request = PlanRequest(global_batch=batch, morph_counts=named, morph_every_count=every)
    hardware = hardware_for(cluster, profile)
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), hardware.devices).specs
    runnable = [s for s in specs if s.deepspeed_runnable]
    evaluator = Evaluator(hardware, batch)
    steps = {s.key: evaluator.step_seconds(s) for s in runnable}
    result = plan(profile, cluster, request)
    counts = [e.devices for e in result.morph_table]
    assert counts == [c for c in expected if c >= counts[0]]
    for entry in result.morph_table:
        best = min(steps[s.key] for s in runnable if s.devices <= entry.devices)
        assert entry.candidate.predicted_step_seconds == pytest.approx(best)


def _pool(*specs):
    """Stand-ins with a bound, a device count and a step time, as the morph table's loop reads them."""
    from pipectl.plan.spec_pool import SpecPool

    n = len(specs)
    return SpecPool.build(
        n, specs.__getitem__, bounds=[s.lower_bound_seconds for s in specs], devices=[s.devices for s in specs],
        pipeline_parallel=[1] * n, zero_stages=[0] * n, deepspeed=[True] * n, torch=[True] * n,
    )


def test_a_tie_within_one_entry_keeps_the_smaller_job():
    from types import SimpleNamespace

    larger = SimpleNamespace(devices=16, lower_bound_seconds=1.0, step=10.0, preference=(16,))
    smaller = SimpleNamespace(devices=12, lower_bound_seconds=2.0, step=10.0, preference=(12,))
    evaluator = SimpleNamespace(step_seconds=lambda spec: spec.step, tighter_bound_seconds=lambda spec: spec.lower_bound_seconds)
    best = fastest_per_device_count(_pool(larger, smaller), evaluator, [8, 16])
    assert best[16][1] is smaller


def test_pruned_morph_search_simulates_less_than_everything():
    profile = _profile()
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    request = PlanRequest(global_batch=48)
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 64).specs
    evaluator = Evaluator(hardware, 48)
    best = fastest_per_device_count(specs, evaluator, list(range(1, 65)))
    assert best
    assert evaluator.simulations < len(specs) / 4


def test_prime_batch_uses_fewer_devices_and_says_why():
    result = plan(_profile(), local_cluster(6), PlanRequest(global_batch=5))
    entry = result.for_devices(6)
    assert entry.candidate.data_parallel in (1, 5)
    assert entry.candidate.devices <= 6
    if entry.candidate.devices < 6:
        assert "uses" in entry.note


def test_a_count_a_pinned_degree_rules_out_names_the_pin():
    """With p = 2 pinned, 3 devices can run nothing (3 is not a multiple of 2): the note says the
    pin, not the batch and memory (which read as the reason, though a p = 3 layout fits)."""
    result = plan(_profile(), local_cluster(4), PlanRequest(global_batch=12, devices=2, pipeline_parallel=2))
    entry = result.for_devices(3)
    assert entry.candidate.devices == 2
    assert entry.note == "uses 2 of 3 devices: 3 is not a multiple of 2 (pinned p = 2)", entry.note


def test_a_rounding_level_tie_keeps_the_preferred_plan_whichever_is_found_first():
    from types import SimpleNamespace

    from pipectl.plan.morph_table import fastest_per_device_count

    # `Spec.preference`: no recomputation before recomputation, on as many devices.
    preferred = SimpleNamespace(devices=8, lower_bound_seconds=2.0, step=10.0, preference=(8, False))
    tied = SimpleNamespace(devices=8, lower_bound_seconds=1.0, step=10.0 * (1 - 1e-14), preference=(8, True))
    faster = SimpleNamespace(devices=16, lower_bound_seconds=3.0, step=9.0, preference=(16, False))
    evaluator = SimpleNamespace(step_seconds=lambda spec: spec.step, tighter_bound_seconds=lambda spec: spec.lower_bound_seconds)
    best = fastest_per_device_count(_pool(tied, faster, preferred), evaluator, list(range(1, 17)))
    assert best[8][1] is preferred
    assert best[16][1] is faster


def test_the_tighter_bound_prunes_more_and_keeps_the_table():
    from pipectl.plan.morph_table import morph_table

    class SpecBoundOnly(Evaluator):
        def tighter_bound_seconds(self, spec):
            return spec.lower_bound_seconds

    profile = synthetic_profile(blocks=12, micro_batch_sizes=[1, 2],
                                block_forward_seconds=[0.01, 0.0101] * 6)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    # ZeRO-0 and 1, every one of them in the table's pool: enough specs for the bounds to differ
    request = PlanRequest(global_batch=96, zero_stages=[0, 1], for_deepspeed=False, uneven_replicas=False)
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 64).specs
    tight, loose = Evaluator(hardware, 96), SpecBoundOnly(hardware, 96)
    assert morph_table(specs, tight, 64, request, 8) == morph_table(specs, loose, 64, request, 8)
    assert tight.simulations < loose.simulations


def test_the_varuna_bound_prunes_varuna_specs_and_keeps_the_table():
    from pipectl.plan.morph_table import morph_table
    from pipectl.schedule import ScheduleKind

    class ChainsForVaruna(Evaluator):
        def tighter_bound_seconds(self, spec):
            if spec.variant.kind is ScheduleKind.VARUNA:
                return spec.lower_bound_seconds
            return super().tighter_bound_seconds(spec)

    profile = synthetic_profile(blocks=12, micro_batch_sizes=[1, 2],
                                block_forward_seconds=[0.01, 0.0101] * 6)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    request = PlanRequest(global_batch=128, schedules=["varuna"])
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 64).specs
    tight, loose = Evaluator(hardware, 128), ChainsForVaruna(hardware, 128)
    assert morph_table(specs, tight, 64, request, 8) == morph_table(specs, loose, 64, request, 8)
    assert tight.simulations < loose.simulations


def test_timing_ahead_in_two_processes_leaves_the_loop_nothing_to_time(monkeypatch):
    """The lower range of device counts is timed as the whole loop would, the upper one as a
    superset: afterwards the loop finds every time it asks for, and its answer is the same."""
    from pipectl.plan import morph_table as morph

    monkeypatch.setattr(morph, "PARALLEL_SPECS", 0)  # fork for a small search too
    profile = synthetic_profile(blocks=12, micro_batch_sizes=[1, 2],
                                block_forward_seconds=[0.01, 0.0101] * 6)
    hardware = hardware_for(load_cluster("a100-8x8"), profile)
    request = PlanRequest(global_batch=128, schedules=["1f1b", "varuna"])
    specs = enumerate_specs(profile, hardware, search_space(request, profile, hardware), 64).specs
    split = morph._split_count(specs)
    assert min(s.devices for s in specs) <= split < max(s.devices for s in specs)

    counts = list(range(1, 65))
    alone = Evaluator(hardware, 128)
    expected = fastest_per_device_count(specs, alone, counts)
    ahead = Evaluator(hardware, 128)
    morph._time_ahead(specs, ahead, counts)
    timed = ahead.simulations
    assert timed >= alone.simulations  # both processes' simulations are counted
    assert {s.key for s in specs if s.devices > split} & set(ahead.timings()[0])  # the other range came back
    assert fastest_per_device_count(specs, ahead, counts) == expected
    assert ahead.simulations == timed
    assert fastest_per_device_count(specs, Evaluator(hardware, 128), counts, workers=2) == expected
    nodes = [*range(1, 9), *range(16, 65, 8)]  # a split at a table count: the same answer for whole nodes
    assert fastest_per_device_count(specs, Evaluator(hardware, 128), nodes, workers=2) == fastest_per_device_count(
        specs, Evaluator(hardware, 128), nodes
    )


def test_more_cpu_ranks_than_cores_are_said_to_share_them():
    """A resize of a local run to 64 ranks on a 2-core host re-planned onto 2 and said only that 2
    were faster than any layout of 64, which read as false: the ranks would share 2 cores."""
    from pipectl.artifacts.profile import RuntimeCosts

    runtime = RuntimeCosts(
        engine="test", forward_overhead_seconds=1e-4, backward_overhead_seconds=1e-4, step_fixed_seconds=1e-3,
        step_seconds_per_parameter=1e-8, compute_ratios=[], calibration_parameter_count=1000,
        busy_handoff_seconds=2e-4, alone_compute_slowdown=1.0, concurrent_compute_slowdown=2.0,
        busy_allreduce_latency_seconds=6e-4, busy_allreduce_bandwidth_bytes_per_second=2e8,
        concurrent_ranks=2, host_cores=2,
    )
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[2], device="cpu").model_copy(update={"runtime": runtime})
    entry = plan(profile, local_cluster(8), PlanRequest(global_batch=8, devices=8)).for_devices(8)
    assert entry.candidate.devices < 8
    assert entry.note.endswith("faster than any configuration of all 8 (8 ranks would share this host's 2 cores)"), entry.note
