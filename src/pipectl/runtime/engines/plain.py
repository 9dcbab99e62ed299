"""One-stage plans with ZeRO-2 or ZeRO-3, in DeepSpeed's ordinary engine.

DeepSpeed's `PipelineEngine` refuses ZeRO-2 ("ZeRO-2 and ZeRO-3 are incompatible with pipeline
parallelism"). A plan with one pipeline stage has nothing to pipeline, so it runs in DeepSpeed's
ordinary `DeepSpeedEngine`, which partitions the gradients too: each replica reduce-scatters its
gradients as the backward produces them and keeps 1/d of them (ZeRO-2), where ZeRO-1 keeps them
whole until the end of the step. With ZeRO-3 it partitions the weights as well: the model is built
whole (every rank draws the same seeded layers) and `deepspeed.initialize` partitions it, after
which each layer's weights are all-gathered before its forward and its backward and released
after. Everything else stays as the pipeline path has it:

- the model is the same one-stage `PipelineModule` (the same layers, seeds and tied modules),
  its children registered under the same names in a plain module (`LayerStack`), so checkpoints,
  resizes and exports name every parameter as the pipeline path does;
- ZeRO-2's optimizer is DeepSpeed's ZeRO-1/2 class (`DeepSpeedZeroOptimizer`), ZeRO-3's its
  `DeepSpeedZeroOptimizer_Stage3`; `engine_state` captures and restores the flat fp32 partitions
  of either and their links to the parameters in one format: a ZeRO-2 or ZeRO-3 run's checkpoint
  loads into any layout, and any layout's into it (ZeRO-2's live hand-over too);
- a step runs the planned micro-batches in the schedule's compute order (one stage: 1F1B's
  F0 B0 F1 B1 ..., GPipe's forwards first), returns the loss averaged over the micro-batches and the
  replicas as the pipeline engine does, and records what it ran (each forward and backward, the end
  of the step) for the same metrics.

`plan_plain_engine` turns the engine `deepspeed.initialize` returns into a `PlannedPlainEngine`, as
`executor.plan_engine` does for the pipeline engine; the worker uses either through the same
attributes (`train_step`, `executed`, `phase_seconds`, `grid`, `stage_id`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from pipectl.errors import UserInputError
from pipectl.runtime.engines.executor import TIMED_PHASES, ExecutedAction, TimedActions, device_times_for, wait_for_snapshot
from pipectl.schedule.ir import Action, ActionKind, Schedule


class LayerStack(torch.nn.Module):
    """A one-stage `PipelineModule`'s layers in a plain module: its children under their own names
    (`0`, `1`, ..., `tied_modules`), its forward run as it is. DeepSpeed builds a `PipelineEngine`
    for any `PipelineModule`; this one gets the ordinary engine."""

    def __init__(self, pipe: torch.nn.Module) -> None:
        super().__init__()
        for name, child in pipe.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "pipe", pipe)  # not a child: its children are this module's

    def forward(self, inputs):
        return self.pipe(inputs)


class PlannedPlainEngine(TimedActions, DeepSpeedEngine):
    """`DeepSpeedEngine` running a one-stage plan's micro-batches (see the module docstring).

    `deepspeed.initialize()` returns a `DeepSpeedEngine`; `plan_plain_engine` turns it into this
    class (no new constructor state; everything is set by `attach_schedule`)."""

    def attach_schedule(self, pipe: torch.nn.Module, schedule: Schedule, compute_slowdown: float = 1.0) -> None:
        if schedule.pipeline_parallel != 1:
            raise UserInputError(f"DeepSpeed's ordinary engine runs one stage; the schedule has p={schedule.pipeline_parallel}")
        if schedule.micro_batches != self.gradient_accumulation_steps():
            raise UserInputError(
                f"schedule has m={schedule.micro_batches} micro-batches but the DeepSpeed config sets "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps()}"
            )
        self.grid = pipe._grid  # the one-stage topology's grid: data-parallel rank, tensor rank
        self.stage_id, self.num_stages = 0, 1
        self.loss_fn = pipe.loss_fn
        self.planned_schedule = schedule
        self.compute_order = schedule.compute_order(0)
        self.compute_slowdown = compute_slowdown
        self.executed: list[ExecutedAction] = []
        self.phase_seconds = dict.fromkeys(TIMED_PHASES, 0.0)
        self.snapshot_copied = None  # a checkpoint's copies the next optimizer step waits for
        self.device_times = device_times_for(self)

    def is_first_stage(self) -> bool:
        return True

    def is_last_stage(self) -> bool:
        return True

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step on this replica's micro-batches (inputs, labels), in the schedule's
        compute order. Returns the loss averaged over the micro-batches and the data-parallel
        replicas (the same number on every rank), as `PipelineEngine.train_batch` does."""
        if len(micro_batches) != len(self.compute_order) // 2:
            raise UserInputError(f"got {len(micro_batches)} micro-batches for a step of {len(self.compute_order) // 2}")
        self.executed = []
        self.phase_seconds = dict.fromkeys(TIMED_PHASES, 0.0)
        self.module.train()
        losses: dict[int, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for action in self.compute_order:
            start = self._begin()
            index = action.microbatch
            if action.kind is ActionKind.FORWARD:
                inputs, labels = micro_batches[index]
                outputs = self(inputs.to(self.device))
                losses[index] = self.loss_fn(outputs, labels.to(self.device))
                total += losses[index].detach().float()
                self._record(action, start)
            elif action.kind is ActionKind.BACKWARD:
                self.backward(losses.pop(index))
                self._record(action, start)
                boundary = self.is_gradient_accumulation_boundary()  # before `step` counts this one
                if boundary:
                    wait_for_snapshot(self)
                start = self._begin()
                # Counts the micro-batch; at the step's last one, updates (DeepSpeed reduced the
                # gradients in that micro-batch's backward, where they are timed).
                self.step()
                if boundary:
                    self._add_phase("optimizer", start)
            else:
                raise UserInputError(f"one stage runs forwards and backwards only, not {action}")
        total /= len(micro_batches)
        if self.grid.get_data_parallel_world_size() > 1:
            torch.distributed.all_reduce(total, group=self.grid.get_data_parallel_group())
            total /= self.grid.get_data_parallel_world_size()
        if self.device_times is not None:
            self.device_times.apply(self)
        return float(total)

    def executed_order(self) -> list[Action]:
        """The compute actions of the last step, in the order they ran."""
        return [record.action for record in self.executed]


def plan_plain_engine(
    engine: DeepSpeedEngine, pipe: torch.nn.Module, schedule: Schedule, *, compute_slowdown: float = 1.0
) -> PlannedPlainEngine:
    """Turn the ordinary engine `deepspeed.initialize()` returned for `LayerStack(pipe)` into one
    running `schedule`'s micro-batches."""
    if not isinstance(engine, DeepSpeedEngine):
        raise UserInputError(f"expected a DeepSpeedEngine, got {type(engine).__name__}")
    engine.__class__ = PlannedPlainEngine
    engine.attach_schedule(pipe, schedule, compute_slowdown)
    return engine
