"""The stages `torch.distributed.pipelining` runs for a pipectl schedule (`torch_pipeline` trains with
them):

- `to_torch_actions(schedule)` translates each rank's compute actions (F, B and, for split
  backwards, I and W) into torch's `_Action`s, one to one, same virtual-stage and micro-batch
  numbering (virtual stage s on rank `Schedule.rank_of(s)`: s % p, torch's default "loop"
  placement, or the V of zbv: torch's `_prepare_schedule_with_comms` reads the placement off the
  action lists into every stage's `stage_index_to_group_rank`, as its own `ScheduleZBVZeroBubble`
  sets it) and adds the sends and receives; stages next to each other on one rank hand over
  locally. pipectl's own p2p actions, AR and STEP are not passed on (torch inserts its
  communication; `torch_pipeline` does the tied-weight all-reduce, clipping and the optimizer step after the schedule). Recompute (R) has no
  torch counterpart and is refused.
- `build_stage_module` makes one virtual stage from pipectl's `LayerDef`s, each layer built under
  its own seed `seed + layer index` in a forked RNG, as `runtime/engines/pipeline.py` does for DeepSpeed,
  so every cut starts from the same weights.
- The executed compute order is recorded by the engine itself: `RecordingStage` overrides the
  stage entry points torch's runtime calls for each compute action (`forward_one_chunk`,
  `backward_one_chunk`, `backward_weight_one_chunk`) and logs the stage index and micro-batch it
  was called with, in pipectl's text form (`2F0`, `3B1`, `1I0`, `1W0`).

torch's names used here are private (`_PipelineScheduleRuntime`, `_Action`, `_ComputationType`);
torch is pinned, and `tests/runtime/test_torch_pipeline.py` has a contract test for them.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
)

from pipectl.errors import ScheduleError, UserInputError
from pipectl.models.base import LayerDef, ModelLayers
from pipectl.schedule.ir import ActionKind, Schedule

# pipectl action kinds (by their text value) -> torch computation types. "I"/"W" are the split
# backward (input gradient, weight gradient) of the zero-bubble schedules.
_TORCH_COMPUTE = {
    "F": _ComputationType.FORWARD,
    "B": _ComputationType.FULL_BACKWARD,
    "I": _ComputationType.BACKWARD_INPUT,
    "W": _ComputationType.BACKWARD_WEIGHT,
}
# What this path does itself, outside torch's action list.
_HANDLED_HERE = ("AR", "STEP")


def to_torch_actions(schedule: Schedule) -> dict[int, list[_Action]]:
    """Per rank, the schedule's compute actions as torch `_Action`s (compute only, in order).

    >>> from pipectl.schedule import interleaved
    >>> {r: [str(a) for a in acts] for r, acts in to_torch_actions(interleaved(2, 2, 2)).items()}
    {0: ['0F0', '0F1', '2F0', '2F1', '2B0', '2B1', '0B0', '0B1'], 1: ['1F0', '1F1', '3F0', '3F1', '3B0', '3B1', '1B0', '1B1']}
    """
    out: dict[int, list[_Action]] = {}
    for rank in range(schedule.pipeline_parallel):
        actions: list[_Action] = []
        for action in schedule.actions[rank]:
            kind = action.kind.value
            if kind in _TORCH_COMPUTE:
                actions.append(_Action(action.stage, _TORCH_COMPUTE[kind], action.microbatch))
            elif action.kind is ActionKind.RECOMPUTE:
                raise ScheduleError(
                    f"{schedule.kind.value} schedule with recomputation ({action}): torch's pipelining "
                    "runtime has no recompute action",
                    hint="generate the schedule with recompute=False for the torch path",
                )
            elif action.kind.is_p2p or kind in _HANDLED_HERE:
                continue  # torch inserts its own sends/receives; AR and STEP are done after step()
            else:  # a kind added to the IR that this path does not know yet
                raise ScheduleError(f"the torch pipelining path cannot run {action} ({action.kind.name})")
        out[rank] = actions
    return out


def planned_compute_order(schedule: Schedule, rank: int) -> list[str]:
    """The rank's planned compute actions as text (what `RecordingStage` records when they run)."""
    return [str(a) for a in schedule.compute_order(rank)]


def even_cuts(layer_count: int, stages: int) -> tuple[tuple[int, int], ...]:
    """`stages` contiguous layer ranges covering `layer_count` layers, sizes differing by <= 1.

    >>> even_cuts(9, 4)
    ((0, 3), (3, 5), (5, 7), (7, 9))
    """
    if not 1 <= stages <= layer_count:
        raise UserInputError(f"cannot cut {layer_count} layers into {stages} non-empty stages")
    base, extra = divmod(layer_count, stages)
    cuts, start = [], 0
    for s in range(stages):
        stop = start + base + (1 if s < extra else 0)
        cuts.append((start, stop))
        start = stop
    return tuple(cuts)


def check_cuts(cuts: Sequence[tuple[int, int]], layer_count: int, stages: int) -> None:
    if len(cuts) != stages:
        raise UserInputError(f"{len(cuts)} layer ranges given for {stages} virtual stages")
    expected = 0
    for start, stop in cuts:
        if start != expected or stop <= start:
            raise UserInputError(f"layer ranges {list(cuts)} must be contiguous, non-empty and start at 0")
        expected = stop
    if expected != layer_count:
        raise UserInputError(f"layer ranges {list(cuts)} cover {expected} of the model's {layer_count} layers")


def tie_owner(layers: Sequence[LayerDef]) -> dict[str, int]:
    owners: dict[str, int] = {}
    for index, layer in enumerate(layers):
        if layer.tie_key is not None:
            owners.setdefault(layer.tie_key, index)
    return owners


def build_layer(layers: Sequence[LayerDef], index: int, seed: int, owners: dict[str, int]) -> nn.Module:
    """Layer `index` under seed `seed + index` (a tied layer: its first holder's index), RNG forked."""
    layer = layers[index]
    layer_seed = seed + (owners[layer.tie_key] if layer.tie_key is not None else index)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed)
        return layer.build()


class StageModule(nn.Module):
    """One virtual stage: layers [start, stop) of the model, run in order.

    A tied layer after its first holder is a full copy of the holder's module whose forward is
    `LayerDef.tied_forward`; only its tied weight trains (the copy's other parameters are unused
    and frozen). `tied` maps tie key -> the tied weight held here.
    """

    def __init__(self, model: ModelLayers, start: int, stop: int, seed: int) -> None:
        super().__init__()
        owners = tie_owner(model.layers)
        self.defs = list(model.layers[start:stop])
        self.first_layer = start
        self.layers = nn.ModuleList(build_layer(model.layers, i, seed, owners) for i in range(start, stop))
        self.tied: dict[str, nn.Parameter] = {}
        self.tied_copies: set[str] = set()  # keys whose weight here is a copy (not the first holder)
        for index, (layer, module) in zip(range(start, stop), zip(self.defs, self.layers)):
            if layer.tie_key is None:
                continue
            weight = layer.tied_weight(module)
            if owners[layer.tie_key] != index:
                self.tied_copies.add(layer.tie_key)
                for param in module.parameters():
                    if param is not weight:
                        param.requires_grad_(False)
            self.tied[layer.tie_key] = weight

    def forward(self, x: Any) -> Any:
        for layer, module in zip(self.defs, self.layers):
            x = layer.forward(module, x)
        return x


def build_stage_module(model: ModelLayers, start: int, stop: int, seed: int = 0) -> StageModule:
    return StageModule(model, start, stop, seed)


class RecordingStage(PipelineStage):
    """A `PipelineStage` that logs every compute entry point torch's runtime calls on it.

    The record is what executed, as the runtime dispatched it (stage index, kind, micro-batch), in
    pipectl's action text form; the planned list is never consulted. With `timings`, each call's
    wall time is appended there too (`(text, seconds)`: the launch engine's metrics).
    """

    def __init__(self, *args: Any, record: list[str], timings: list[tuple[str, float]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = record
        self.timings = timings

    def _timed(self, text: str, call, *args: Any, **kwargs: Any) -> Any:
        self.record.append(text)
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            if self.timings is not None:
                self.timings.append((text, time.perf_counter() - started))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self._timed(f"{self.stage_index}F{fwd_chunk_id}", super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        return self._timed(
            f"{self.stage_index}{'B' if full_backward else 'I'}{bwd_chunk_id}", super().backward_one_chunk,
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward,
        )  # fmt: skip

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        return self._timed(
            f"{self.stage_index}W{bwd_chunk_id}", super().backward_weight_one_chunk, bwd_chunk_id, last_backward=last_backward
        )


__all__ = [
    "build_stage_module",
    "even_cuts",
    "planned_compute_order",
    "RecordingStage",
    "StageModule",
    "to_torch_actions",
]
