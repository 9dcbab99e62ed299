"""A second execution path: pipectl schedules run by `torch.distributed.pipelining`.

DeepSpeed's pipeline engine holds one contiguous chunk of layers per rank, so interleaved
schedules (v > 1 chunks per rank) and the split backward of the zero-bubble family cannot run there.
PyTorch's `_PipelineScheduleRuntime` executes a per-rank list of actions over several stages per
rank. This module feeds it the very `Schedule` objects the simulator times (no second copy of any
schedule).

Stages and their order (`torch_stages`): the schedule translated into torch's actions, one
virtual stage built from pipectl's layers, and the compute order each rank really ran.

Tied weights (gpt-tiny's head reuses the embedding table): every stage holding a tied layer keeps
its own copy, initialised identically; after the backward the copies' gradients are summed
(locally, then with an all-reduce among the ranks holding the key), so every copy takes the same
AdamW update and stays equal, as DeepSpeed's `TiedLayerSpec` does.

`TorchPipelineEngine` is the launch engine for plans whose engine is torch (`runtime.worker`
builds it; the worker's session drives it as it drives DeepSpeed's engine): a rank's parameters
in one flat fp32 tensor under DeepSpeed's module names, so that `runtime.checkpoint.engine_state` checkpoints
both engines in one format, the optimizer settings and learning-rate schedule from the run's
DeepSpeed config. `train_rank` trains with it on local ranks (tests, `examples/torch_pipeline.py`).

Gradients are those of the mean of the micro-batch losses, the same as DeepSpeed's gradient
accumulation and `reference_run` here. This module divides each of the rank's parameters' gradient
by m itself, once, after the schedule: torch's own `scale_grads=True` divides per stage, so a
parameter two stages of one rank share (the tied embedding and head on rank 0 of ZBV's V) would be
divided twice.

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
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime,
)

from pipectl.artifacts.run import SEED_STRIDE
from pipectl.errors import LaunchError, UserInputError
from pipectl.runtime.engines.local_ranks import run_local_ranks
from pipectl.runtime.engines.loopback import keep_stores_on_loopback
from pipectl.models.base import ModelLayers
from pipectl.schedule.ir import Schedule
from pipectl.runtime.engines.torch_stages import (
    RecordingStage, StageModule, build_layer, check_cuts, tie_owner, build_stage_module,
    to_torch_actions,
)


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
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + step)
    return model.make_batch(global_batch, generator)


def _make_optimizer(params: list[nn.Parameter], job: TorchPipelineJob) -> torch.optim.Optimizer:
    return _adamw(params, OptimizerSettings.of_job(job))


def _adamw(params: list[nn.Parameter], settings: "OptimizerSettings") -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay, foreach=False
    )


def _check_job(job: TorchPipelineJob, model: ModelLayers) -> None:
    schedule = job.schedule
    check_cuts(job.cuts, len(model.layers), schedule.virtual_stages)
    if job.global_batch % schedule.micro_batches:
        raise UserInputError(
            f"global batch {job.global_batch} is not a multiple of the schedule's {schedule.micro_batches} micro-batches"
        )


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW (torch's, as DeepSpeed's `torch_adam` builds it), gradient clipping and the learning-rate
    schedule: read from the run's DeepSpeed config (`from_ds_config`), so that both engines train
    with the same settings. `scheduler` is that config's `scheduler` section (DeepSpeed's
    `lr_schedules` classes work on any torch optimizer)."""

    lr: float = 1e-3  # torch's AdamW defaults, as DeepSpeed passes a config's missing keys
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float | None = None
    scheduler: dict[str, Any] | None = None

    @classmethod
    def of_job(cls, job: TorchPipelineJob) -> "OptimizerSettings":
        return cls(job.lr, job.betas, job.eps, job.weight_decay, job.clip_norm)

    @classmethod
    def from_ds_config(cls, config: dict[str, Any]) -> "OptimizerSettings":
        """`optimizer` (AdamW only), `gradient_clipping` (0: none) and `scheduler` of a DeepSpeed config."""
        optimizer = config.get("optimizer") or {"type": "AdamW"}
        kind = str(optimizer.get("type", ""))
        if kind.lower() != "adamw":
            raise UserInputError(
                f"optimizer type {kind!r}: the torch engine trains with AdamW only",
                hint="remove the optimizer from the DeepSpeed config overlay, or re-plan with --engine deepspeed",
            )
        params = optimizer.get("params", {})
        unknown = sorted(set(params) - {"lr", "betas", "eps", "weight_decay", "torch_adam"})
        if unknown:
            raise UserInputError(f"AdamW settings {unknown} are not read by the torch engine")
        defaults = cls()
        clip = float(config.get("gradient_clipping", 0.0) or 0.0)
        return cls(
            lr=float(params.get("lr", defaults.lr)),
            betas=tuple(float(b) for b in params.get("betas", defaults.betas)),
            eps=float(params.get("eps", defaults.eps)),
            weight_decay=float(params.get("weight_decay", defaults.weight_decay)),
            clip_norm=clip if clip > 0 else None,
            scheduler=config.get("scheduler"),
        )


def _lr_scheduler(optimizer: torch.optim.Optimizer, section: dict[str, Any] | None):
    """DeepSpeed's scheduler for a config's `scheduler` section, built as its engine builds it
    (`DeepSpeedEngine._scheduler_from_config`); None without one."""
    if not section:
        return None
    from deepspeed.runtime import lr_schedules

    name = section.get("type")
    if not hasattr(lr_schedules, str(name)):
        raise UserInputError(f"learning-rate schedule {name!r} is not one of DeepSpeed's (lr_schedules)")
    return getattr(lr_schedules, name)(optimizer, **section.get("params", {}))


class _Grid:
    """What pipectl reads of DeepSpeed's process grid, for a pipeline of p ranks (no data or
    tensor parallelism)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.data_parallel_id = 0

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_slice_parallel_rank(self) -> int:
        return 0

    def get_slice_parallel_world_size(self) -> int:
        return 1


class FlatOptimizer:
    """The torch engine's optimizer as `engine_state` reads one: `optimizer` (torch's AdamW over the
    one flat fp32 tensor holding every parameter of the rank) and `param_names` (parameter -> its
    layout-independent name)."""

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: dict[nn.Parameter, str]) -> None:
        self.optimizer = optimizer
        self.param_names = param_names


class TorchPipelineEngine:
    """One rank of a pipeline run by torch's `_PipelineScheduleRuntime`: what `pipectl launch`
    starts for a plan whose engine is torch (`runtime.worker`), and what `train_rank` trains with.

    The rank's parameters live in one flat fp32 tensor (each parameter a view of its piece) on which
    AdamW keeps its moments: the layout DeepSpeed's ZeRO-1 optimizer keeps at d = 1, so that
    `runtime.checkpoint.engine_state` captures and restores both engines with the same code and a checkpoint
    re-cuts across them. The modules are registered under DeepSpeed's `PipelineModule` names (layer
    i: `"{i}.<param>"`; a tied module: `"tied_modules.<key>.<param>"`), which makes the checkpoint
    names the same too. Every parameter of a tied copy is held (DeepSpeed's copy holds them too); a
    rank holding two layers of one tie key holds one module for both.

    Per step (`train_step`): the runtime runs the rank's actions (the schedule's compute, torch's
    sends and receives), tied gradients are summed over their holders, the gradients are copied
    into the flat gradient, clipped by the norm over the pipeline (a tied weight counted once),
    AdamW steps, the learning-rate schedule steps, and the last stage's mean loss is broadcast.
    """

    def __init__(
        self,
        model: ModelLayers,
        schedule: Schedule,
        cuts: Sequence[tuple[int, int]],
        settings: OptimizerSettings,
        *,
        seed: int = 0,
        group: dist.ProcessGroup | None = None,
        samples_per_step: int = 0,
    ) -> None:
        p, m = schedule.pipeline_parallel, schedule.micro_batches
        if dist.get_world_size(group) != p:
            raise LaunchError(f"schedule has p={p} ranks but the process group has {dist.get_world_size(group)}")
        check_cuts(cuts, len(model.layers), schedule.virtual_stages)
        rank = dist.get_rank(group)
        self.schedule = schedule
        self.group = group
        self.global_rank = dist.get_rank()
        self.stage_id = rank  # the rank's place in the pipeline (it holds the virtual stages rank_of maps to it)
        self.grid = _Grid(p)
        self.device = torch.device("cpu")
        self.settings = settings
        num_stages = schedule.virtual_stages
        self.stages_held = [s for s in range(num_stages) if schedule.rank_of(s) == rank]
        self.first = 0 in self.stages_held
        self.last = num_stages - 1 in self.stages_held
        self.last_rank = schedule.rank_of(num_stages - 1)
        self.record: list[str] = []
        self.timings: list[tuple[str, float]] = []
        self.modules = {s: build_stage_module(model, *cuts[s], seed=seed) for s in self.stages_held}
        self.module = self._named(model)
        stages = [
            RecordingStage(self.modules[s], s, num_stages, self.device, group=group, record=self.record, timings=self.timings)
            for s in self.stages_held
        ]
        # Gradients are divided by m in `step`, once per parameter (not per stage: see the module doc).
        self.runtime = _PipelineScheduleRuntime(stages, m, loss_fn=model.loss_fn, scale_grads=False)
        self.runtime._prepare_schedule_with_comms(to_torch_actions(schedule))
        self.tie_groups = _tie_groups(model, schedule, cuts)
        named = list(self.module.named_parameters())
        self.params = [q for _, q in named]
        self.flat = _flatten(self.params)
        self.optimizer = FlatOptimizer(_adamw([self.flat], settings), {q: name for name, q in named})
        self.lr_scheduler = _lr_scheduler(self.optimizer.optimizer, settings.scheduler)
        self.last_grad_norm: float | None = None  # the last step's, when it clips
        owners = {id(mod.tied[key]) for mod in self.modules.values() for key in mod.tied if key not in mod.tied_copies}
        copies = {id(mod.tied[key]) for mod in self.modules.values() for key in mod.tied_copies} - owners
        self.norm_params = [q for q in self.params if id(q) not in copies]
        self.global_steps = self.global_samples = self.skipped_steps = 0
        self.samples_per_step = samples_per_step
        self.executed: list[Any] = []
        self.phase_seconds: dict[str, float] = {}

    def _named(self, model: ModelLayers) -> nn.Module:
        """The rank's layers under DeepSpeed's names; a second holder of a tie key on this rank is
        given the first's module (one parameter, its gradient the sum of both uses)."""
        named = nn.Module()
        named.tied_modules = nn.ModuleDict()
        for stage in sorted(self.modules):
            mod = self.modules[stage]
            for index, (layer, module) in enumerate(zip(mod.defs, mod.layers), start=mod.first_layer):
                if layer.tie_key is None:
                    named.add_module(str(index), module)
                elif layer.tie_key not in named.tied_modules:
                    named.tied_modules[layer.tie_key] = module
                else:
                    holder = named.tied_modules[layer.tie_key]
                    mod.layers[index - mod.first_layer] = holder
                    mod.tied[layer.tie_key] = layer.tied_weight(holder)
        return named

    # ----------------------------------------------------------------- what the worker calls

    def is_first_stage(self) -> bool:
        return self.first

    def is_last_stage(self) -> bool:
        return self.last

    def optimizer_groups(self) -> list[Any]:
        """The one optimizer group `engine_state` captures and restores: the flat tensor, every
        parameter and where each lies in it."""
        from pipectl.runtime.checkpoint.engine_state import OptimizerGroup, Piece

        pieces, offset = [], 0
        for q in self.params:
            pieces.append(Piece(q, offset=offset, start=0, numel=q.numel()))
            offset += q.numel()
        settings = {k: v for k, v in self.optimizer.optimizer.param_groups[0].items() if k != "params"}
        return [OptimizerGroup(self.flat, list(self.params), pieces, settings)]

    def executed_order(self) -> list[str]:
        """The compute actions the rank ran in its last step, as torch's runtime called them."""
        return list(self.record)

    def get_lr(self) -> list[float]:
        """The learning rate of the next step (DeepSpeed's engine's name)."""
        return [float(self.optimizer.optimizer.param_groups[0]["lr"])]

    def get_global_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping; None without clipping (as DeepSpeed)."""
        return self.last_grad_norm

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> float:
        """One optimizer step over the step's micro-batches; the loss. A rank holding neither the
        first nor the last virtual stage is given None for each (it reads no data)."""
        if any(batch is None for batch in micro_batches):
            return self.step(None, None)
        inputs = torch.cat([x for x, _ in micro_batches])
        labels = torch.cat([y for _, y in micro_batches])
        return self.step(inputs, labels)

    def step(self, inputs: torch.Tensor | None, labels: torch.Tensor | None) -> float:
        """One optimizer step: `inputs` are read on the rank holding the first virtual stage,
        `labels` on the one holding the last (None elsewhere is fine)."""
        from pipectl.runtime.engines.executor import ExecutedAction
        from pipectl.schedule.ir import Action

        self.record.clear()
        self.timings.clear()
        started = time.perf_counter()
        for q in self.params:
            q.grad = None
        self.flat.grad = None
        losses: list[torch.Tensor] = []
        self.runtime.step(
            *((inputs,) if self.first else ()), target=labels if self.last else None, losses=losses, return_outputs=False
        )
        scheduled = time.perf_counter()
        m = self.schedule.micro_batches
        for q in self.params:  # the mean over micro-batches, each parameter once
            if q.grad is not None:
                q.grad.div_(m)
        _sum_tied_grads(self.modules, self.tie_groups)
        self.flat.grad = torch.cat(
            [q.grad.reshape(-1) if q.grad is not None else torch.zeros(q.numel()) for q in self.params]
        )
        reduced = time.perf_counter()
        if self.settings.clip_norm is not None:
            self.last_grad_norm = _grad_norm(self.norm_params, self.group)
            coefficient = self.settings.clip_norm / (self.last_grad_norm + 1e-6)
            if coefficient < 1.0:
                self.flat.grad.mul_(coefficient)
        self.optimizer.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += int(inputs.shape[0]) if inputs is not None else self.samples_per_step
        loss = torch.stack(losses).mean().detach() if self.last else torch.zeros(())
        source = dist.get_global_rank(self.group, self.last_rank) if self.group is not None else self.last_rank
        dist.broadcast(loss, src=source, group=self.group)
        finished = time.perf_counter()
        self.executed = [ExecutedAction(Action.parse(text), seconds) for text, seconds in self.timings]
        compute = sum(seconds for _, seconds in self.timings)
        self.phase_seconds = {
            "p2p": max(0.0, scheduled - started - compute), "reductions": reduced - scheduled, "optimizer": finished - reduced,
            "checkpoint": 0.0,  # this engine's checkpoint copies are taken between steps, not overlapped
        }
        return float(loss)


def _flatten(params: list[nn.Parameter]) -> nn.Parameter:
    """One fp32 tensor holding `params` end to end; each parameter becomes a view of its piece."""
    flat = torch.empty(sum(q.numel() for q in params), dtype=torch.float32)
    offset = 0
    with torch.no_grad():
        for q in params:
            piece = flat.narrow(0, offset, q.numel())
            piece.copy_(q.reshape(-1))
            q.data = piece.view(q.shape)
            offset += q.numel()
    return nn.Parameter(flat)


def _tie_groups(model: ModelLayers, schedule: Schedule, cuts: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Per tie key held on more than one rank, a group of those ranks (every rank creates every
    group, in the same order, as new_group requires); None for a key held on one rank."""
    holders: dict[str, set[int]] = {}
    for s in range(schedule.virtual_stages):
        start, stop = cuts[s]
        for layer in model.layers[start:stop]:
            if layer.tie_key is not None:
                holders.setdefault(layer.tie_key, set()).add(schedule.rank_of(s))
    return {key: dist.new_group(sorted(ranks)) if len(ranks) > 1 else None for key, ranks in sorted(holders.items())}


def train_rank(job: TorchPipelineJob, group: dist.ProcessGroup | None = None) -> RankResult:
    """Train `job` on this rank of an initialised process group of `p` ranks (rank = pipeline rank)."""
    from pipectl.models.registry import build_model

    model = build_model(job.model)
    _check_job(job, model)
    engine = TorchPipelineEngine(model, job.schedule, job.cuts, OptimizerSettings.of_job(job), seed=job.seed, group=group)
    result = RankResult(dist.get_rank(group))
    for step in range(job.steps):
        inputs, labels = step_batch(model, job.global_batch, job.seed, step)
        started = time.perf_counter()
        loss = engine.step(inputs, labels)
        result.step_seconds.append(time.perf_counter() - started)
        result.losses.append(loss)
        result.executed.append(engine.executed_order())
    return result


def _sum_tied_grads(modules: dict[int, StageModule], tie_groups: dict[str, dist.ProcessGroup | None]) -> None:
    """Sum each tie key's gradient over every copy (this rank's, then across its holders' ranks)
    and give every copy the sum: the gradient of the one shared weight."""
    for key, group in tie_groups.items():
        weights = list({id(w): w for w in (mod.tied[key] for mod in modules.values() if key in mod.tied)}.values())
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


def _grad_norm(norm_params: list[nn.Parameter], group) -> float:
    """The gradient norm over the whole pipeline: the squared norms of this rank's (non-copy)
    gradients summed over all ranks."""
    squares = torch.zeros((), dtype=torch.float64)
    for q in norm_params:
        if q.grad is not None:
            squares += q.grad.double().pow(2).sum()
    dist.all_reduce(squares, group=group)
    return float(squares.sqrt())


def reference_run(job: TorchPipelineJob) -> list[float]:
    """The same training in one process, no pipeline: one model (a tied weight is one parameter),
    the loss of each step the mean of its micro-batch losses, AdamW and clipping as in `train_rank`."""
    from pipectl.models.registry import build_model

    model = build_model(job.model)
    _check_job(job, model)
    m = job.schedule.micro_batches
    owners = tie_owner(model.layers)
    modules: list[nn.Module] = []
    holder_modules: dict[str, nn.Module] = {}
    for index, layer in enumerate(model.layers):
        if layer.tie_key is not None and owners[layer.tie_key] != index:
            modules.append(holder_modules[layer.tie_key])
        else:
            module = build_layer(model.layers, index, job.seed, owners)
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
        keep_stores_on_loopback()  # rank 0's store serves 127.0.0.1 only
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
        preload=["torch", "pipectl.runtime.engines.torch_pipeline"], timeout_seconds=timeout_seconds, what="torch pipeline",
    )  # fmt: skip


__all__ = [
    "RankResult",
    "reference_run",
    "spawn_local",
    "step_batch",
    "TorchPipelineJob",
    "train_rank",
]
