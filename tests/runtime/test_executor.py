"""Translation of our schedules into DeepSpeed pipe instructions (pure: no processes)."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds

from pipectl.errors import ScheduleError, UserInputError
from pipectl.runtime.engines.executor import PlannedSchedule, RecomputeForward, executable_schedule, translate_rank
from pipectl.schedule import generate
from pipectl.schedule.ir import Action, ActionKind, Schedule, ScheduleKind

KINDS = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.VARUNA]
COMPUTE = {ds.ForwardPass: "F", ds.BackwardPass: "B", RecomputeForward: "R"}


def planned(kind: ScheduleKind, p: int, m: int, recompute: bool = False) -> Schedule:
    return executable_schedule(generate(kind, p, m, recompute=recompute))


def instructions(program) -> list:
    return [instr for step in program.steps for instr in step]


def in_flight(actions: tuple[Action, ...]) -> int:
    """Most micro-batches between their first and last action on a rank, at any point."""
    first, last = {}, {}
    for index, action in enumerate(actions):
        if action.kind.has_microbatch:
            first.setdefault(action.microbatch, index)
            last[action.microbatch] = index
    return max(sum(1 for mb in first if first[mb] <= t <= last[mb]) for t in range(len(actions)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (3, 5), (4, 8)])
def test_compute_instructions_follow_the_planned_compute_order(kind, p, m):
    schedule = planned(kind, p, m, recompute=kind is ScheduleKind.VARUNA)
    for rank in range(p):
        program = translate_rank(schedule, rank)
        compute = [i for i in instructions(program) if type(i) in COMPUTE]
        assert [i.action for i in compute] == schedule.compute_order(rank)
        assert [COMPUTE[type(i)] for i in compute] == [a.kind.value for a in schedule.compute_order(rank)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 6)])
def test_buffers_are_as_many_as_micro_batches_in_flight(kind, p, m):
    schedule = planned(kind, p, m)
    for rank in range(p):
        program = translate_rank(schedule, rank)
        assert program.num_buffers == in_flight(schedule.actions[rank])
        if kind is ScheduleKind.GPIPE:
            assert program.num_buffers == m
        if kind is ScheduleKind.ONE_F_ONE_B:
            assert program.num_buffers <= p - rank + 1


def test_every_instruction_of_a_micro_batch_uses_its_buffer():
    schedule = planned(ScheduleKind.ONE_F_ONE_B, 3, 6)
    for rank in range(3):
        program = translate_rank(schedule, rank)
        # While a micro-batch is live no other live micro-batch shares its buffer.
        live: dict[int, int] = {}
        for action, step in zip(schedule.actions[rank], program.steps):
            if not action.kind.has_microbatch:
                continue
            buffer = program.buffer_of[action.microbatch]
            assert all(instr.buffer_id == buffer for instr in step)
            owner = live.setdefault(buffer, action.microbatch)
            assert owner == action.microbatch
            if action == [a for a in schedule.actions[rank] if a.microbatch == action.microbatch][-1]:
                del live[buffer]


def test_data_is_loaded_by_micro_batch_index_on_first_and_last_stage_only():
    schedule = planned(ScheduleKind.GPIPE, 3, 4)
    for rank in range(3):
        loads = [i for i in instructions(translate_rank(schedule, rank)) if isinstance(i, ds.LoadMicroBatch)]
        if rank in (0, 2):
            assert [i.micro_batch for i in loads] == [0, 1, 2, 3]
        else:
            assert loads == []


def test_communication_maps_to_deepspeed_p2p_and_the_step_ends_with_reduce_and_step():
    schedule = planned(ScheduleKind.ONE_F_ONE_B, 2, 2)
    first = [type(i) for i in instructions(translate_rank(schedule, 0))]
    last = [type(i) for i in instructions(translate_rank(schedule, 1))]
    assert first.count(ds.SendActivation) == 2 and first.count(ds.RecvGrad) == 2
    assert ds.RecvActivation not in first and ds.SendGrad not in first
    assert last.count(ds.RecvActivation) == 2 and last.count(ds.SendGrad) == 2
    for kinds in (first, last):
        assert kinds[-3:] == [ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]


def test_forwards_that_are_recomputed_drop_their_graph():
    schedule = planned(ScheduleKind.ONE_F_ONE_B, 2, 3, recompute=True)
    forwards0 = [i for i in instructions(translate_rank(schedule, 0)) if isinstance(i, ds.ForwardPass)]
    forwards1 = [i for i in instructions(translate_rank(schedule, 1)) if isinstance(i, ds.ForwardPass)]
    assert [f.keep_graph for f in forwards0] == [False, False, False]  # R before every B
    assert [f.keep_graph for f in forwards1] == [True, True, True]  # last stage: no recompute


def test_planned_schedule_yields_the_program_to_deepspeed():
    schedule = planned(ScheduleKind.GPIPE, 2, 3)
    program = translate_rank(schedule, 1)
    ds_schedule = PlannedSchedule(program, micro_batches=3, stages=2)
    assert ds_schedule.num_pipe_buffers() == 3
    assert [list(step) for step in program.steps] == list(ds_schedule)


def test_communication_is_added_when_missing_and_kept_when_present():
    bare = generate(ScheduleKind.ONE_F_ONE_B, 2, 2)
    with_comm = executable_schedule(bare)
    assert any(a.kind is ActionKind.SEND_FORWARD for a in with_comm.actions[0])
    assert executable_schedule(with_comm) is with_comm
    single = generate(ScheduleKind.GPIPE, 1, 4)
    assert executable_schedule(single) is single


def test_interleaved_schedules_are_refused():
    with pytest.raises(UserInputError, match="v=2"):
        executable_schedule(generate(ScheduleKind.INTERLEAVED, 2, 4, chunks=2))


def test_an_action_before_its_forward_is_a_schedule_error():
    broken = Schedule.from_text("# gpipe p=1 m=1 v=1\n0: 0B0 0F0 0AR 0STEP\n")
    with pytest.raises(ScheduleError, match="0B0 comes before micro-batch 0's forward"):
        translate_rank(broken, 0)


def test_an_emulated_slower_kind_holds_each_action_k_times_as_long():
    """`NodeType.compute_slowdown` k: the rank waits (k - 1) times what the action took, so that a
    split over emulated kinds runs slow where planned (what tests/runtime/test_heterogeneous_run.py
    sees end to end, there timed under load)."""
    import time

    from pipectl.runtime.engines.executor import record_action

    executed = []
    record_action(executed, Action.parse("0F0"), time.perf_counter() - 0.05, 1.0)  # as it is: no wait
    waited = time.perf_counter()
    record_action(executed, Action.parse("0B0"), waited - 0.05, 3.0)  # took 0.05 s: waits 0.1 s more
    assert time.perf_counter() - waited >= 0.1
    assert executed[0].seconds < 0.15 <= executed[1].seconds
