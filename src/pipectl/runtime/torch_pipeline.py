"""A second execution path: pipectl schedules run by `torch.distributed.pipelining`.

DeepSpeed's pipeline engine holds one contiguous chunk of layers per rank, so interleaved
schedules (v > 1 chunks per rank) and the split backward of the zero-bubble family cannot run there.
PyTorch's `_PipelineScheduleRuntime` executes a per-rank list of actions over several stages per
rank. This module feeds it the very `Schedule` objects the simulator times (no second copy of any
schedule):

- `to_torch_actions(schedule)` translates each rank's compute actions (F, B and, for split
  backwards, I and W) into torch's `_Action`s, one to one, same virtual-stage and micro-batch
  numbering (virtual stage s on rank s % p, which is also torch's default "loop" placement);
  torch's `_prepare_schedule_with_comms` then adds the sends and receives. pipectl's own p2p
  actions, AR and STEP are not passed on (torch inserts its communication; this module does the
  tied-weight all-reduce, clipping and the optimizer step after the schedule). Recompute (R) has no
  torch counterpart and is refused.
- `build_stage_module` makes one virtual stage from pipectl's `LayerDef`s, each layer built under
  its own seed `seed + layer index` in a forked RNG, as `runtime/pipeline.py` does for DeepSpeed,
  so every cut starts from the same weights.
- Tied weights (gpt-tiny's head reuses the embedding table): every stage holding a tied layer keeps
  its own copy, initialised identically; after the backward the copies' gradients are summed
  (locally, then with an all-reduce among the ranks holding the key), so every copy takes the same
  AdamW update and stays equal, as DeepSpeed's `TiedLayerSpec` does.
- The executed compute order is recorded by the engine itself: `RecordingStage` overrides the
  stage entry points torch's runtime calls for each compute action (`forward_one_chunk`,
  `backward_one_chunk`, `backward_weight_one_chunk`) and logs the stage index and micro-batch it
  was called with, in pipectl's text form (`2F0`, `3B1`, `1I0`, `1W0`).

Gradients are those of the mean of the micro-batch losses (torch's `scale_grads=True`), the same as
DeepSpeed's gradient accumulation and `reference_run` here.

torch's names used here are private (`_PipelineScheduleRuntime`, `_Action`, `_ComputationType`);
torch is pinned, and `tests/runtime/test_torch_pipeline.py` has a contract test for them.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
)

from pipectl.errors import LaunchError, ScheduleError, UserInputError
from pipectl.runtime.local_ranks import run_local_ranks
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


def _check_cuts(cuts: Sequence[tuple[int, int]], layer_count: int, stages: int) -> None:
    if len(cuts) != stages:
        raise UserInputError(f"{len(cuts)} layer ranges given for {stages} virtual stages")
    expected = 0
    for start, stop in cuts:
        if start != expected or stop <= start:
            raise UserInputError(f"layer ranges {list(cuts)} must be contiguous, non-empty and start at 0")
        expected = stop
    if expected != layer_count:
        raise UserInputError(f"layer ranges {list(cuts)} cover {expected} of the model's {layer_count} layers")


def _tie_owner(layers: Sequence[LayerDef]) -> dict[str, int]:
    owners: dict[str, int] = {}
    for index, layer in enumerate(layers):
        if layer.tie_key is not None:
            owners.setdefault(layer.tie_key, index)
    return owners


def _build_layer(layers: Sequence[LayerDef], index: int, seed: int, owners: dict[str, int]) -> nn.Module:
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
        owners = _tie_owner(model.layers)
        self.defs = list(model.layers[start:stop])
        self.first_layer = start
        self.layers = nn.ModuleList(_build_layer(model.layers, i, seed, owners) for i in range(start, stop))
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
    pipectl's action text form; the planned list is never consulted.
    """

    def __init__(self, *args: Any, record: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = record

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.record.append(f"{self.stage_index}F{fwd_chunk_id}")
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        self.record.append(f"{self.stage_index}{'B' if full_backward else 'I'}{bwd_chunk_id}")
        return super().backward_one_chunk(
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
        )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        self.record.append(f"{self.stage_index}W{bwd_chunk_id}")
        return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


@dataclass(frozen=True)
class TorchPipelineJob:
    """One training run on the torch pipelining path.

    `cuts[s]` is virtual stage s's layer range [start, stop). AdamW (torch's) and clipping at
    `clip_norm` mirror what `pipectl launch` configures for DeepSpeed (lr 3e-3, clipping 1.0).
    """

    model: str
    schedule: Schedule
    cuts: tuple[tuple[int, int], ...]
    steps: int
    global_batch: int
    seed: int = 0
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_norm: float | None = 1.0


@dataclass
class RankResult:
    """What one rank saw: the step losses (mean over micro-batches, from the last stage), the
    compute order torch's runtime executed at each step, and each step's wall time."""

    rank: int
    losses: list[float] = field(default_factory=list)
    executed: list[list[str]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)

    def median_step_seconds(self, skip: int = 1) -> float:
        times = self.step_seconds[skip:] or self.step_seconds
        return statistics.median(times)


def step_batch(model: ModelLayers, global_batch: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (0-based): the same on every rank and in the reference."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return model.make_batch(global_batch, generator)


def _make_optimizer(params: list[nn.Parameter], job: TorchPipelineJob) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=job.lr, betas=job.betas, eps=job.eps, weight_decay=job.weight_decay, foreach=False
    )


def _check_job(job: TorchPipelineJob, model: ModelLayers) -> None:
    schedule = job.schedule
    _check_cuts(job.cuts, len(model.layers), schedule.virtual_stages)
    if job.global_batch % schedule.micro_batches:
        raise UserInputError(
            f"global batch {job.global_batch} is not a multiple of the schedule's {schedule.micro_batches} micro-batches"
        )


def train_rank(job: TorchPipelineJob, group: dist.ProcessGroup | None = None) -> RankResult:
    """Train `job` on this rank of an initialised process group of `p` ranks (rank = pipeline rank)."""
    from pipectl.models.registry import build_model

    schedule = job.schedule
    p, m = schedule.pipeline_parallel, schedule.micro_batches
    rank = dist.get_rank(group)
    if dist.get_world_size(group) != p:
        raise LaunchError(f"schedule has p={p} ranks but the process group has {dist.get_world_size(group)}")
    model = build_model(job.model)
    _check_job(job, model)
    num_stages = schedule.virtual_stages
    my_stages = [s for s in range(num_stages) if schedule.rank_of(s) == rank]
    record: list[str] = []
    modules = {s: build_stage_module(model, *job.cuts[s], seed=job.seed) for s in my_stages}
    stages = [
        RecordingStage(modules[s], s, num_stages, torch.device("cpu"), group=group, record=record)
        for s in my_stages
    ]
    runtime = _PipelineScheduleRuntime(stages, m, loss_fn=model.loss_fn, scale_grads=True)
    runtime._prepare_schedule_with_comms(to_torch_actions(schedule))

    # Tie keys held on more than one rank need a group of those ranks (every rank creates every
    # group, in the same order, as new_group requires).
    holders: dict[str, set[int]] = {}
    for s in range(num_stages):
        start, stop = job.cuts[s]
        for layer in model.layers[start:stop]:
            if layer.tie_key is not None:
                holders.setdefault(layer.tie_key, set()).add(schedule.rank_of(s))
    tie_groups = {
        key: dist.new_group(sorted(ranks)) if len(ranks) > 1 else None for key, ranks in sorted(holders.items())
    }
    params = [q for mod in modules.values() for q in mod.parameters() if q.requires_grad]
    optimizer = _make_optimizer(params, job)
    # Parameters counted once in the gradient norm: a tied copy's weight is the holder's.
    copies = {id(mod.tied[key]) for mod in modules.values() for key in mod.tied_copies}
    norm_params = [q for q in params if id(q) not in copies]

    last_rank = schedule.rank_of(num_stages - 1)
    result = RankResult(rank)
    for step in range(job.steps):
        inputs, labels = step_batch(model, job.global_batch, job.seed, step)
        record.clear()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (inputs,) if 0 in modules else ()
        runtime.step(*args, target=labels, losses=losses, return_outputs=False)
        _sum_tied_grads(modules, tie_groups)
        if job.clip_norm is not None:
            _clip(norm_params, params, job.clip_norm, group)
        optimizer.step()
        loss = torch.stack(losses).mean().detach() if rank == last_rank else torch.zeros(())
        dist.broadcast(loss, src=dist.get_global_rank(group, last_rank) if group is not None else last_rank, group=group)
        result.step_seconds.append(time.perf_counter() - started)
        result.losses.append(float(loss))
        result.executed.append(list(record))
    return result


def _sum_tied_grads(modules: dict[int, StageModule], tie_groups: dict[str, dist.ProcessGroup | None]) -> None:
    """Sum each tie key's gradient over every copy (this rank's, then across its holders' ranks)
    and give every copy the sum: the gradient of the one shared weight."""
    for key, group in tie_groups.items():
        weights = [mod.tied[key] for mod in modules.values() if key in mod.tied]
        if not weights:
            continue
        total = torch.zeros_like(weights[0])
        for w in weights:
            if w.grad is not None:
                total += w.grad
        if group is not None:
            dist.all_reduce(total, group=group)
        for w in weights:
            w.grad = total.clone()


def _clip(norm_params: list[nn.Parameter], params: list[nn.Parameter], max_norm: float, group) -> None:
    """`clip_grad_norm_` over the whole pipeline: the squared norms of this rank's (non-copy)
    gradients summed over all ranks."""
    squares = torch.zeros((), dtype=torch.float64)
    for q in norm_params:
        if q.grad is not None:
            squares += q.grad.double().pow(2).sum()
    dist.all_reduce(squares, group=group)
    norm = float(squares.sqrt())
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for q in params:
            if q.grad is not None:
                q.grad.mul_(coefficient)


def reference_run(job: TorchPipelineJob) -> list[float]:
    """The same training in one process, no pipeline: one model (a tied weight is one parameter),
    the loss of each step the mean of its micro-batch losses, AdamW and clipping as in `train_rank`."""
    from pipectl.models.registry import build_model

    model = build_model(job.model)
    _check_job(job, model)
    m = job.schedule.micro_batches
    owners = _tie_owner(model.layers)
    modules: list[nn.Module] = []
    holder_modules: dict[str, nn.Module] = {}
    for index, layer in enumerate(model.layers):
        if layer.tie_key is not None and owners[layer.tie_key] != index:
            modules.append(holder_modules[layer.tie_key])
        else:
            module = _build_layer(model.layers, index, job.seed, owners)
            if layer.tie_key is not None:
                holder_modules[layer.tie_key] = module
            modules.append(module)
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for q in module.parameters():
            if id(q) not in seen:
                seen.add(id(q))
                params.append(q)
    optimizer = _make_optimizer(params, job)
    losses: list[float] = []
    for step in range(job.steps):
        inputs, labels = step_batch(model, job.global_batch, job.seed, step)
        optimizer.zero_grad(set_to_none=True)
        micro = []
        for x, y in zip(torch.tensor_split(inputs, m), torch.tensor_split(labels, m)):
            for layer, module in zip(model.layers, modules):
                x = layer.forward(module, x)
            micro.append(model.loss_fn(x, y))
        loss = torch.stack(micro).mean()
        loss.backward()
        if job.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, job.clip_norm)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


# ---------------------------------------------------------------------------------------------
# Local ranks (tests, measurements): not a launch engine.


def _rank_main(rank: int, world: int, port: int, jobs: Sequence[TorchPipelineJob], results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            outcomes = []
            for job in jobs:
                outcomes.append(train_rank(job))
                dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, outcomes))
    except BaseException as exc:  # the parent reports it
        import traceback

        results.put(LaunchError(f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))


def spawn_local(jobs: Sequence[TorchPipelineJob], timeout_seconds: float = 120) -> dict[int, list[RankResult]]:
    """Run `jobs` one after another on p local gloo ranks (one process group, started once); per
    rank, one `RankResult` per job. All jobs must have the same pipeline-parallel degree."""
    worlds = {job.schedule.pipeline_parallel for job in jobs}
    if len(worlds) != 1:
        raise UserInputError(f"jobs of one spawn need one pipeline-parallel degree, got {sorted(worlds)}")
    world = worlds.pop()
    return run_local_ranks(
        _rank_main, (list(jobs),), world,
        preload=["torch", "pipectl.runtime.torch_pipeline"], timeout_seconds=timeout_seconds, what="torch pipeline",
    )  # fmt: skip


__all__ = [
    "RankResult",
    "RecordingStage",
    "StageModule",
    "TorchPipelineJob",
    "build_stage_module",
    "even_cuts",
    "planned_compute_order",
    "reference_run",
    "spawn_local",
    "step_batch",
    "to_torch_actions",
    "train_rank",
]
