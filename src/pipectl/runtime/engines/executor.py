"""Our `Schedule` executed by DeepSpeed's pipeline engine.

DeepSpeed chooses its train schedule in `PipelineEngine._train_schedule()` and runs it with
`_exec_schedule`, which dispatches each `PipeInstruction` through the class attribute
`_INSTRUCTION_MAP`; no configuration option selects a schedule. We therefore translate the
planned actions of one rank (after `add_communication`, so sends and receives are explicit) into
DeepSpeed instructions, and run them in a minimal `PipelineEngine` subclass. The simulator, the
validator and this adapter all read the same `Schedule` object: there is no second copy.

Translation of one rank's actions (stage s of p; "first"/"last" = s == 0 / s == p - 1):

    RF i   -> RecvActivation(buf)
    F i    -> LoadMicroBatch(buf, micro_batch=i)  (first and last stage: inputs / labels)
              ForwardPass(buf)                     (without an autograd graph when R i follows)
    SF i   -> SendActivation(buf)
    RB i   -> RecvGrad(buf)
    R i    -> RecomputeForward(buf)                (forward again, this time keeping the graph)
    B i    -> BackwardPass(buf)
    SB i   -> SendGrad(buf)
    AR     -> ReduceTiedGrads(), ReduceGrads()
    STEP   -> OptimizerStep()

`buf` is a pipe buffer: a micro-batch takes a free one at its first action on the rank and gives
it back after its last, so a rank needs as many buffers as it has micro-batches in flight (m for
GPipe, at most p - s for 1F1B). Example, GPipe p=2 m=2, rank 1:

    actions:  1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1 1AR 1STEP
    buffers:  mb0 -> 0, mb1 -> 1 (two in flight)
    steps:    [RecvActivation(0)] [LoadMicroBatch(0), ForwardPass(0)] [RecvActivation(1)]
              [LoadMicroBatch(1), ForwardPass(1)] [BackwardPass(0)] [SendGrad(0)] ...

What the engine subclass changes, and why (DEEPSPEED-ON-CPU.md, "Schedules"):

- The last stage keeps one `self.loss`; with several forwards before their backwards (GPipe) the
  backward would run on the wrong loss. The loss is kept per pipe buffer.
- `RecvGrad` writes into one shared gradient buffer; the received gradient is kept per pipe
  buffer, so a schedule may receive the gradients of several micro-batches before their backwards.
- Recomputation (Varuna; GPipe/1F1B with recompute): a forward followed later by `R i` runs
  under `torch.no_grad()` (only its input is kept, which the buffer holds anyway); `R i` runs the
  same forward again with the graph, right before the backward. The models are deterministic
  (no dropout), so the recomputed activations equal the originals bit for bit.
- Micro-batch i is loaded by index (not by the order of a data iterator), so the data of a step
  does not depend on the schedule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from pipectl.errors import ScheduleError, UserInputError
from pipectl.schedule.comm import add_communication
from pipectl.schedule.ir import Action, ActionKind, Schedule


class RecomputeForward(ds_schedule.BufferOpInstruction):
    """Run the forward pass of a buffer again, keeping the autograd graph for its backward."""


@dataclass(frozen=True)
class RankProgram:
    """One rank's share of a schedule, as DeepSpeed instruction steps (one step per action)."""

    rank: int
    steps: tuple[tuple[ds_schedule.PipeInstruction, ...], ...]
    num_buffers: int
    buffer_of: dict[int, int] = field(hash=False)  # micro-batch -> pipe buffer


def has_communication(schedule: Schedule) -> bool:
    return any(a.kind.is_p2p for actions in schedule.actions.values() for a in actions)


def executable_schedule(schedule: Schedule) -> Schedule:
    """The schedule with explicit sends/receives (added by `add_communication` when missing).

    A one-stage pipeline needs none. Interleaved schedules (v > 1) are refused: DeepSpeed's engine
    holds one contiguous range of layers per rank.
    """
    if schedule.chunks != 1:
        raise UserInputError(
            f"schedule {schedule.kind.value} with v={schedule.chunks} model chunks per rank cannot run "
            f"in DeepSpeed's pipeline engine (one layer range per rank)"
        )
    if schedule.pipeline_parallel == 1 or has_communication(schedule):
        return schedule
    return add_communication(schedule)


def translate_rank(schedule: Schedule, rank: int) -> RankProgram:
    """Translate `rank`'s actions of a schedule with communication into DeepSpeed instructions.

    Compute instructions carry the planned `Action` as the `action` keyword, so the engine can
    record what it executed.
    """
    if rank not in schedule.actions:
        raise ScheduleError(f"schedule has no actions for rank {rank} (ranks: {sorted(schedule.actions)})")
    stages = schedule.pipeline_parallel
    is_first, is_last = rank == 0, rank == stages - 1
    actions = schedule.actions[rank]

    recomputed = {a.microbatch for a in actions if a.kind is ActionKind.RECOMPUTE}
    last_use = {a.microbatch: index for index, a in enumerate(actions) if a.kind.has_microbatch}

    free_buffers: list[int] = []
    buffer_count = 0
    buffer_of: dict[int, int] = {}
    live: dict[int, int] = {}
    steps: list[tuple[ds_schedule.PipeInstruction, ...]] = []

    for index, action in enumerate(actions):
        kind, micro_batch = action.kind, action.microbatch
        if kind.has_microbatch and micro_batch not in live:
            if kind not in (ActionKind.RECV_FORWARD, ActionKind.FORWARD):
                raise ScheduleError(f"rank {rank}: {action} comes before micro-batch {micro_batch}'s forward")
            if free_buffers:
                buffer = free_buffers.pop(0)
            else:
                buffer, buffer_count = buffer_count, buffer_count + 1
            live[micro_batch] = buffer
            buffer_of[micro_batch] = buffer
        buffer = live.get(micro_batch) if kind.has_microbatch else None

        if kind is ActionKind.RECV_FORWARD:
            step = (ds_schedule.RecvActivation(buffer),)
        elif kind is ActionKind.FORWARD:
            load = (ds_schedule.LoadMicroBatch(buffer, micro_batch=micro_batch),) if is_first or is_last else ()
            keep_graph = micro_batch not in recomputed
            step = load + (ds_schedule.ForwardPass(buffer, action=action, keep_graph=keep_graph),)
        elif kind is ActionKind.SEND_FORWARD:
            step = (ds_schedule.SendActivation(buffer),)
        elif kind is ActionKind.RECV_BACKWARD:
            step = (ds_schedule.RecvGrad(buffer),)
        elif kind is ActionKind.RECOMPUTE:
            step = (RecomputeForward(buffer, action=action),)
        elif kind is ActionKind.BACKWARD:
            step = (ds_schedule.BackwardPass(buffer, action=action),)
        elif kind is ActionKind.SEND_BACKWARD:
            step = (ds_schedule.SendGrad(buffer),)
        elif kind is ActionKind.ALL_REDUCE:
            step = (ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads())
        elif kind is ActionKind.OPTIMIZER_STEP:
            step = (ds_schedule.OptimizerStep(),)
        else:  # pragma: no cover - every ActionKind is handled above
            raise ScheduleError(f"rank {rank}: no DeepSpeed instruction for {action}")
        steps.append(step)

        if kind.has_microbatch and last_use[micro_batch] == index:
            free_buffers.append(live.pop(micro_batch))
            free_buffers.sort()

    return RankProgram(rank=rank, steps=tuple(steps), num_buffers=max(1, buffer_count), buffer_of=buffer_of)


class PlannedSchedule(ds_schedule.PipeSchedule):
    """A DeepSpeed `PipeSchedule` that yields a `RankProgram`'s steps."""

    def __init__(self, program: RankProgram, micro_batches: int, stages: int) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=program.rank)
        self.program = program

    def steps(self):
        yield from (list(step) for step in self.program.steps)

    def num_pipe_buffers(self) -> int:
        return self.program.num_buffers


@dataclass(frozen=True)
class ExecutedAction:
    """A compute action the engine ran, with its duration: on the host clock on a CPU, from CUDA
    events on a GPU (`DeviceTimes`)."""

    action: Action
    seconds: float


def record_action(executed: list[ExecutedAction], action: Action, start: float, compute_slowdown: float) -> None:
    """Record a compute action that began at `start`. On an emulated slower device kind
    (`NodeType.compute_slowdown` k) the rank first waits (k - 1) times what the action took,
    holding its core idle as a slower device would, so the action ends k times later."""
    seconds = time.perf_counter() - start
    if compute_slowdown != 1.0:
        time.sleep(seconds * (compute_slowdown - 1.0))
        seconds = time.perf_counter() - start
    executed.append(ExecutedAction(action, seconds))


# What a rank's step spends besides its compute, timed per step (`phase_seconds`): its sends and
# receives (a receive waits for the peer: the pipeline's bubble and the transfer), its tied and
# data-parallel gradient reductions, its optimizer step, and the optimizer step's wait for a
# checkpoint's copies to host memory (`wait_for_snapshot`; 0 where the copy is not overlapped).
TIMED_PHASES = ("p2p", "reductions", "optimizer", "checkpoint")


@dataclass(frozen=True)
class Began:
    """When an action or a phase began: on the host clock, and on a GPU as an event on the training stream."""

    host: float
    event: Any = None


def _recorded_event() -> Any:
    """A timing event recorded now on the current (training) stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def begin(cuda: bool) -> Began:
    return Began(time.perf_counter(), _recorded_event() if cuda else None)


class DeviceTimes:
    """A GPU rank's action and phase times from CUDA events (where a step's time goes).

    On a GPU the host only enqueues kernels: its clock says when an action was issued, not how long
    the GPU ran it (a forward's host time is its launch overhead; the GPU's time turns up later, in
    whatever waits first). Each action and phase records an event before and after it on the
    training stream; once the step is over (`apply`), their elapsed times replace the host's in
    `executed` and `phase_seconds`, so a step's metrics split it as the GPU spent it: forward,
    backward, pipeline transfers and waits, gradient reductions, the optimizer step.
    """

    def __init__(self) -> None:
        self.actions: list[tuple[int, Any, Any]] = []  # (index in executed, start, end)
        self.phases: list[tuple[str, Any, Any]] = []

    def action(self, index: int, began: Began) -> None:
        self.actions.append((index, began.event, _recorded_event()))

    def phase(self, name: str, began: Began) -> None:
        self.phases.append((name, began.event, _recorded_event()))

    def apply(self, engine: Any) -> None:
        """Put the GPU's times of the step just ended into the engine's `executed` and `phase_seconds`."""
        if not self.actions and not self.phases:
            return
        torch.cuda.current_stream().synchronize()
        executed = list(engine.executed)
        for index, start, end in self.actions:
            executed[index] = ExecutedAction(executed[index].action, start.elapsed_time(end) / 1e3)
        phases = dict.fromkeys(TIMED_PHASES, 0.0)
        for name, start, end in self.phases:
            phases[name] += start.elapsed_time(end) / 1e3
        engine.executed, engine.phase_seconds = executed, phases
        self.actions, self.phases = [], []


class TimedActions:
    """What both planned DeepSpeed engines time alike: each compute action on the host clock, and
    on a GPU by events too (`DeviceTimes`). Needs `executed`, `compute_slowdown` and `device_times`."""

    def _begin(self) -> Began:
        return begin(self.device_times is not None)

    def _record(self, action: Action, began: Began) -> None:
        record_action(self.executed, action, began.host, self.compute_slowdown)
        if self.device_times is not None:
            self.device_times.action(len(self.executed) - 1, began)

    def _add_phase(self, phase: str, began: Began) -> None:
        """What a phase (`TIMED_PHASES`) that began at `began` took, added to the step's."""
        self.phase_seconds[phase] += time.perf_counter() - began.host
        if self.device_times is not None:
            self.device_times.phase(phase, began)


def device_times_for(engine: Any) -> DeviceTimes | None:
    """Event timing for an engine on a GPU; None on a CPU, whose host clock is the device's."""
    device = getattr(engine, "device", None)
    return DeviceTimes() if device is not None and torch.device(device).type == "cuda" else None


def wait_for_snapshot(engine: Any) -> None:
    """Before an optimizer step: the training stream waits for a checkpoint's copies still on
    their side stream (`snapshot.SideCopies`), which read the state this step overwrites.

    The wait is the step's "checkpoint" phase: on a GPU the events around it span the time the
    training stream stood still for the copies (the copies' own sharing of the GPU with the
    forwards and backwards they overlap shows in those, not here)."""
    copied = getattr(engine, "snapshot_copied", None)
    if copied is not None:
        began = engine._begin()
        torch.cuda.current_stream().wait_event(copied)
        engine._add_phase("checkpoint", began)
        engine.snapshot_copied = None


def _after_snapshot(function):
    """`function` (the optimizer step's instruction, timed), once a checkpoint's copies have landed."""

    def run(self, *args, **kwargs):
        wait_for_snapshot(self)
        return function(self, *args, **kwargs)

    return run


def _timed(function, phase: str):
    """`function` (an engine method), its wall time added to the step's `phase_seconds[phase]`."""

    def run(self, *args, **kwargs):
        began = self._begin()
        try:
            return function(self, *args, **kwargs)
        finally:
            self._add_phase(phase, began)

    return run


class PlannedPipelineEngine(TimedActions, PipelineEngine):
    """`PipelineEngine` running a planned `Schedule` (see the module docstring for what changes).

    `deepspeed.initialize()` picks the engine class itself, so `attach_schedule` turns the engine
    it returns into this class (no new constructor state; everything is set by `attach_schedule`).
    """

    def attach_schedule(self, schedule: Schedule, compute_slowdown: float = 1.0) -> None:
        """Run `schedule` (this rank's stage of it) from the next `train_batch` on; with a
        `compute_slowdown` k > 1, as a device k times slower would (`_record`)."""
        schedule = executable_schedule(schedule)
        if schedule.pipeline_parallel != self.num_stages:
            raise UserInputError(
                f"schedule has p={schedule.pipeline_parallel} stages but the engine runs {self.num_stages}"
            )
        if schedule.micro_batches != self.micro_batches:
            raise UserInputError(
                f"schedule has m={schedule.micro_batches} micro-batches but the DeepSpeed config sets "
                f"gradient_accumulation_steps={self.micro_batches}"
            )
        self.planned_schedule = schedule
        self.rank_program = translate_rank(schedule, self.stage_id)
        self.planned_batches: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
        self.executed: list[ExecutedAction] = []
        self.phase_seconds = dict.fromkeys(TIMED_PHASES, 0.0)
        self.compute_slowdown = compute_slowdown
        self.snapshot_copied = None  # a checkpoint's copies the next optimizer step waits for
        self.device_times = device_times_for(self)
        self._loss_by_buffer: dict[int, torch.Tensor] = {}
        self._grad_by_buffer: dict[int, object] = {}

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step on this replica's micro-batches (inputs, labels), in index order.

        Returns the loss averaged over the micro-batches and the data-parallel replicas (the same
        number on every rank).
        """
        if len(micro_batches) != self.micro_batches:
            raise UserInputError(f"got {len(micro_batches)} micro-batches for a step of {self.micro_batches}")
        self.planned_batches = micro_batches
        self.executed = []
        self.phase_seconds = dict.fromkeys(TIMED_PHASES, 0.0)
        loss = self.train_batch()
        self.planned_batches = ()
        if self.device_times is not None:
            self.device_times.apply(self)
        return float(loss)

    def executed_order(self) -> list[Action]:
        """The compute actions of the last step, in the order they ran."""
        return [record.action for record in self.executed]

    # --- DeepSpeed hooks -------------------------------------------------------------------

    def _train_schedule(self):
        return PlannedSchedule(self.rank_program, self.micro_batches, self.num_stages)

    def _exec_load_planned_micro_batch(self, buffer_id: int, micro_batch: int) -> None:
        # DeepSpeed loads from an iterator; hand it exactly the micro-batch the action names.
        self.data_iterator = iter([self.planned_batches[micro_batch]])
        PipelineEngine._exec_load_micro_batch(self, buffer_id)
        self.data_iterator = None

    def _exec_planned_forward(self, buffer_id: int, action: Action, keep_graph: bool = True) -> None:
        start = self._begin()
        if keep_graph:
            PipelineEngine._exec_forward_pass(self, buffer_id)
        else:
            with torch.no_grad():
                PipelineEngine._exec_forward_pass(self, buffer_id)
        if self.is_last_stage():
            self._loss_by_buffer[buffer_id] = self.loss
        self._record(action, start)

    def _exec_recompute(self, buffer_id: int, action: Action) -> None:
        start = self._begin()
        if self.is_last_stage():
            # The loss was counted by the first forward; don't count it twice.
            counted = (self.total_loss, list(self.fwd_outputs), self.total_additional_losses)
            PipelineEngine._exec_forward_pass(self, buffer_id)
            self.total_loss, self.fwd_outputs, self.total_additional_losses = counted
            self._loss_by_buffer[buffer_id] = self.loss
        else:
            PipelineEngine._exec_forward_pass(self, buffer_id)
        self._record(action, start)

    def _exec_planned_recv_grads(self, buffer_id: int) -> None:
        PipelineEngine._exec_recv_grads(self, buffer_id)
        received = self.grad_layer
        if isinstance(received, torch.Tensor):
            self._grad_by_buffer[buffer_id] = received.clone()
        else:
            self._grad_by_buffer[buffer_id] = [t.clone() for t in received]

    def _exec_planned_backward(self, buffer_id: int, action: Action) -> None:
        start = self._begin()
        if self.is_last_stage():
            self.loss = self._loss_by_buffer.pop(buffer_id)
        received = self._grad_by_buffer.pop(buffer_id, None)
        shared = self.grad_layer
        if received is not None:
            self.grad_layer = received
        try:
            PipelineEngine._exec_backward_pass(self, buffer_id)
        finally:
            # Keep DeepSpeed's shared receive buffer for the next RecvGrad.
            self.grad_layer = shared
        self._record(action, start)

    def clip_fp32_gradients(self) -> None:
        """Clip by the norm of the WHOLE model's gradient, not of stage 0's part.

        DeepSpeed's ZeRO-0 fp32 path (`runtime.utils.clip_grad_norm_`) counts a parameter only on
        model-parallel rank 0 (which, in a pipeline grid, is stage 0) unless it is tagged as
        model-parallel; every later stage's gradients are left out of the norm, so with p > 1 each
        step is clipped by a different factor than with p = 1 (`tests/runtime/test_equivalence.py`
        compares the two). ZeRO-1 computes the norm correctly; this makes ZeRO-0 agree with it.

        Each gradient is counted once: tied copies on non-owner stages (`ds_pipe_replicated`)
        are skipped, and with tensor parallelism a parameter replicated across the tensor group is
        counted on tensor rank 0 only, a sharded one (`tensor_model_parallel`) on every rank.
        """
        from deepspeed import comm as ds_dist  # initialised by now: its comm module needs a process group
        from deepspeed.runtime.utils import is_model_parallel_parameter

        tensor_rank = self.grid.get_slice_parallel_rank()
        grads = [
            p.grad
            for p in self.module.parameters()
            if p.grad is not None
            and not getattr(p, "ds_pipe_replicated", False)
            and (tensor_rank == 0 or is_model_parallel_parameter(p))
        ]
        squares = torch.zeros(1, dtype=torch.float32, device=self.device)
        for grad in grads:
            squares += grad.detach().float().pow(2).sum()
        ds_dist.all_reduce(squares, group=self.grid.get_model_parallel_group())
        total_norm = squares.sqrt()
        # The same coefficient as DeepSpeed's clip_grad_norm_ (and torch's): max / (norm + 1e-6), <= 1.
        clip_coef = torch.clamp(self.gradient_clipping() / (total_norm + 1e-6), max=1.0)
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(clip_coef.to(p.grad.dtype))

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.LoadMicroBatch: _exec_load_planned_micro_batch,
        ds_schedule.ForwardPass: _exec_planned_forward,
        ds_schedule.BackwardPass: _exec_planned_backward,
        ds_schedule.RecvGrad: _timed(_exec_planned_recv_grads, "p2p"),
        RecomputeForward: _exec_recompute,
        **{
            instruction: _timed(PipelineEngine._INSTRUCTION_MAP[instruction], "p2p")
            for instruction in (ds_schedule.SendActivation, ds_schedule.RecvActivation, ds_schedule.SendGrad)
        },
        **{
            instruction: _timed(PipelineEngine._INSTRUCTION_MAP[instruction], "reductions")
            for instruction in (ds_schedule.ReduceTiedGrads, ds_schedule.ReduceGrads)
        },
        ds_schedule.OptimizerStep: _after_snapshot(_timed(PipelineEngine._INSTRUCTION_MAP[ds_schedule.OptimizerStep], "optimizer")),
    }


def plan_engine(engine: PipelineEngine, schedule: Schedule, *, compute_slowdown: float = 1.0) -> PlannedPipelineEngine:
    """Turn the engine `deepspeed.initialize()` returned into one running `schedule` (on an
    emulated device kind `compute_slowdown` times slower than this one)."""
    if not isinstance(engine, PipelineEngine):
        raise UserInputError(f"expected a DeepSpeed PipelineEngine, got {type(engine).__name__}")
    engine.__class__ = PlannedPipelineEngine
    engine.attach_schedule(schedule, compute_slowdown)
    return engine
