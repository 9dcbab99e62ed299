import math
import random
from dataclasses import replace

import pytest
from builders import random_stage_costs
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import ScheduleError
from pipectl.plan.simulate import simulate, simulate_rendezvous, simulate_step_seconds
from pipectl.plan.stage_costs import uniform_costs
from pipectl.plan.timing import executed_schedule, step_seconds_of, summary_of
from pipectl.schedule import generate
from pipectl.schedule.ir import Schedule, ScheduleKind

RUNNABLE = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.VARUNA]


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_uniform_free_transfers_keep_the_closed_form(kind, p, m):
    # The communication pass orders sends and receives by a timing with F = 1, B = 2 and free
    # transfers: under those costs (any scale) nobody waits at a rendezvous, so the blocking step
    # equals (m + p - 1)(t_f + t_b).
    tf, tb = 0.9, 1.8
    timeline = simulate_rendezvous(generate(kind, p, m), uniform_costs(p, 1, tf, tb))
    assert close(timeline.step_seconds, (m + p - 1) * (tf + tb))
    assert timeline.communication_seconds == 0.0


def test_a_send_waits_for_its_receive():
    # p=2 1F1B: rank 1 receives F1's activation before running B0, so a slow stage 0 holds up
    # rank 1's B0 (asynchronous transfers would let B0 run at once).
    costs = uniform_costs(2, 1, 1.0, 2.0)
    slow_first = costs.__class__(**{**costs.__dict__, "forward_seconds": (3.0, 1.0)})
    schedule = generate(ScheduleKind.ONE_F_ONE_B, 2, 2)
    blocking = simulate_rendezvous(schedule, slow_first)
    rank1 = {str(r.action): (r.start, r.end) for r in blocking.records if r.rank == 1}
    assert rank1["1F0"] == (3.0, 4.0)
    assert rank1["1B0"] == (6.0, 8.0)  # waits for 0F1 (3..6) to hand its activation over
    asynchronous = {str(r.action): r.start for r in simulate(schedule, slow_first).records if r.rank == 1}
    assert asynchronous["1B0"] == 4.0
    assert blocking.step_seconds > simulate(schedule, slow_first).step_seconds


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(RUNNABLE),
    p=st.integers(1, 5),
    m=st.integers(1, 9),
    seed=st.integers(0, 10_000),
)
def test_blocking_is_never_faster_than_asynchronous(kind, p, m, seed):
    # Every asynchronous constraint (a compute after its input landed) still holds with blocking
    # transfers, which only add waits: the step can only get longer. One stage has no transfers.
    if kind is ScheduleKind.VARUNA and p == 1:
        p = 2
    costs = random_stage_costs(p, 1, random.Random(seed))
    recompute = kind is ScheduleKind.VARUNA
    schedule = generate(kind, p, m, 1, recompute)
    blocking = simulate_rendezvous(schedule, costs)
    asynchronous = simulate(schedule, costs)
    assert blocking.step_seconds >= asynchronous.step_seconds * (1 - 1e-12)
    if p == 1:
        assert close(blocking.step_seconds, asynchronous.step_seconds)
    # Every compute action is timed once, each rank's actions back to back in its list order.
    assert len(blocking.records) == len(asynchronous.records)
    for rank in range(p):
        own = [r for r in blocking.records if r.rank == rank]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(own, own[1:]))
    assert blocking.peak_in_flight == asynchronous.peak_in_flight
    assert close(
        step_seconds_of(kind, p, m, 1, recompute, replace(costs, blocking_p2p=True)), blocking.step_seconds
    )


def test_executed_schedule_carries_its_transfers():
    schedule = executed_schedule(ScheduleKind.ONE_F_ONE_B, 2, 2, 1, False)
    assert schedule.to_text().splitlines()[1] == "0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0AR 0STEP"
    assert executed_schedule(ScheduleKind.ONE_F_ONE_B, 1, 2, 1, False) == generate(ScheduleKind.ONE_F_ONE_B, 1, 2)


def test_mismatched_sends_are_a_deadlock():
    # Rank 0 sends micro-batch 1 first while rank 1 waits for micro-batch 0: blocking p2p never
    # gets past it (the communication pass never emits this; a hand-written schedule can).
    schedule = Schedule.from_text(
        "# gpipe p=2 m=2 v=1\n"
        "0: 0F0 0F1 0SF1 0SF0 0RB0 0B0 0RB1 0B1 0AR 0STEP\n"
        "1: 1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1 1AR 1STEP\n"
    )
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at 0SF1, rank 1 at 1RF0"):
        simulate_rendezvous(schedule, uniform_costs(2, 1, 1.0, 2.0))


@pytest.mark.parametrize("kind", RUNNABLE)
def test_blocking_costs_route_every_entry_point_to_the_rendezvous_timing(kind):
    # The planner's entry points, in both modes, and the simulator itself.
    p, m = 3, 5
    recompute = kind is ScheduleKind.VARUNA
    costs = replace(random_stage_costs(p, 1, random.Random(7)), blocking_p2p=True)
    schedule = generate(kind, p, m, 1, recompute)
    expected = simulate_rendezvous(executed_schedule(kind, p, m, 1, recompute), costs)
    assert simulate(schedule, costs).step_seconds == expected.step_seconds
    assert simulate_step_seconds(schedule, costs) == expected.step_seconds
    for reference in (False, True):
        assert step_seconds_of(kind, p, m, 1, recompute, costs, reference=reference) == expected.step_seconds
        summary = summary_of(kind, p, m, 1, recompute, costs, reference=reference)
        assert summary == expected.summary()
    # The asynchronous timing of the same table is faster here: the flag matters.
    assert step_seconds_of(kind, p, m, 1, recompute, replace(costs, blocking_p2p=False)) < expected.step_seconds


def test_cpu_links_block_and_gpu_links_do_not():
    from pipectl.cluster import load_cluster, local_cluster
    from pipectl.plan.costs import hardware_for
    from pipectl.plan.cost_table import stage_costs
    from pipectl.testing.profiles import synthetic_profile

    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1], device="cpu", dtype="float32")
    local = stage_costs(profile, hardware_for(local_cluster(2), profile), [(0, 3), (3, 6)],
                        micro_batch_size=1, tensor_parallel=1, data_parallel=1)  # fmt: skip
    assert local.blocking_p2p
    a100 = hardware_for(load_cluster("a100-8x8"), profile)
    assert not a100.device.blocking_p2p


@pytest.mark.parametrize("kind, v", [(ScheduleKind.INTERLEAVED, 2), (ScheduleKind.INTERLEAVED, 3),
                                     (ScheduleKind.PIPEDREAM_2BW, 1)])  # fmt: skip
@pytest.mark.parametrize("p", [2, 3, 4])
def test_interleaved_and_2bw_time_as_rendezvous_too(kind, v, p):
    # The planner may time them for a CPU cluster (they never run in DeepSpeed's engine): the
    # communication pass's order must not deadlock, and blocking can only lengthen the step.
    m = 2 * p
    costs = random_stage_costs(p, v, random.Random(p))
    schedule = generate(kind, p, m, v)
    blocking = simulate_rendezvous(schedule, costs)
    assert blocking.step_seconds >= simulate(schedule, costs).step_seconds * (1 - 1e-12)
    assert len(blocking.records) == len(simulate(schedule, costs).records)
