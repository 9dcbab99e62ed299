"""The engine a rank trains with, built for its layout: DeepSpeed's pipeline engine running
pipectl's schedule, DeepSpeed's plain engine for a one-stage ZeRO-2/3 plan, or torch's pipelining
runtime for a plan whose engine is torch; with the few DeepSpeed behaviours pipectl replaces (no
model broadcast where every rank builds the same weights, each uneven replica's loss weighted by
its share of the batch)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

from pipectl.artifacts.layout import Layout
from pipectl.artifacts.plan import Engine
from pipectl.errors import UserInputError
from pipectl.runtime.engines import dsinit
from pipectl.schedule import generate
from pipectl.runtime.job import TrainingJob


def build_engine(job: TrainingJob, initialise: bool = True, memory: Any = None):
    """Distributed start-up, model, DeepSpeed engine running the planned schedule. Every rank.
    `initialise=False`: the parameters are left undrawn (every one is restored next: live resize).
    `memory`: an `engine_state.TouchedMemory` the optimizer's flat tensors are taken from.
    A layout for engine torch gets PyTorch's pipelining runtime instead (`build_torch_engine`)."""
    dsinit.init_distributed(job.collective_timeout_seconds)
    # torch reads OMP_NUM_THREADS and DeepSpeed its accelerator when first imported: both only after
    # dsinit has set this rank's environment (the modules below import them too).
    import torch.distributed as torch_dist

    layout = job.layout
    world = torch_dist.get_world_size()
    if world != layout.world_size:
        raise UserInputError(
            f"{world} ranks started for a layout of t{layout.tensor_parallel} x p{layout.pipeline_parallel} "
            f"x d{layout.data_parallel} = {layout.world_size}"
        )
    if layout.engine is Engine.TORCH:
        return build_torch_engine(job)
    import deepspeed

    from pipectl.models import build_model
    from pipectl.models.tensor_parallel import new_tensor_parallel_groups, shard_model
    from pipectl.runtime.checkpoint.engine_state import drawing_from
    from pipectl.runtime.engines.executor import plan_engine
    from pipectl.runtime.engines.pipeline import build_pipeline_module, planned_topology
    from pipectl.runtime.engines.plain import LayerStack, plan_plain_engine

    topology = planned_topology(layout.pipeline_parallel, layout.data_parallel, layout.tensor_parallel)
    model = build_model(job.model, allow_shape_only=True)  # a LayerDef list: each rank builds its stage only
    ds_config = job.ds_config
    replica = topology.get_coord(torch_dist.get_rank()).data
    _, micro_batches = layout.replica_share(replica)
    if layout.replica_shares:
        model, ds_config = weighted_replica(model, ds_config, layout, replica)
    if layout.tensor_parallel > 1:
        model = shard_model(model, new_tensor_parallel_groups(topology))
        # DeepSpeed's default with a 'model' axis splits the activations it sends between stages
        # across the tensor group (written for Megatron's tuple outputs); our stages send one
        # replicated tensor, so send it whole unless the config says otherwise.
        pipeline = {"pipe_partitioned": False, "grad_partitioned": False, **ds_config.get("pipeline", {})}
        ds_config = {**ds_config, "pipeline": pipeline}
    module = build_pipeline_module(
        model, layout.stage_layers, topology=topology, seed=job.seed, chunks=layout.chunks, initialise=initialise,
        checkpoint_layers=layout.checkpoint_layers, selective_recompute=layout.selective_recompute,
    )
    # One stage with ZeRO-2 or ZeRO-3: DeepSpeed's ordinary engine (its pipeline engine refuses both).
    plain = layout.pipeline_parallel == 1 and ds_config.get("zero_optimization", {}).get("stage", 0) >= 2
    with no_unused_grad_partition(), nullcontext() if initialise else no_model_broadcast(), drawing_from(memory):
        engine, *_ = deepspeed.initialize(
            model=LayerStack(module) if plain else module,
            config=ds_config,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            # The ordinary engine takes its groups from the stage's grid, as the pipeline engine
            # does (not from DeepSpeed's module-level groups, which a live resize leaves stale).
            **({"mpu": module._grid} if plain else {}),
        )
    schedule = job.schedule or generate(
        layout.schedule, layout.pipeline_parallel, micro_batches, recompute=layout.recompute
    )
    slowdown = job.compute_slowdowns.get(job.replica_kinds[replica], 1.0) if job.replica_kinds else 1.0
    if plain:
        return model, plan_plain_engine(engine, module, schedule, compute_slowdown=slowdown)
    return model, plan_engine(engine, schedule, compute_slowdown=slowdown)


def build_torch_engine(job: TrainingJob):
    """Model and the rank's `TorchPipelineEngine` running the plan's schedule (1f1b, gpipe,
    interleaved with v chunks, zb-h1, zbv) over the plan's virtual-stage cut, with the optimizer,
    clipping and learning-rate schedule of the run's DeepSpeed config; the process group is already
    up (`build_engine`). The session drives it as it drives a DeepSpeed engine: the same data,
    metrics and checkpoints (`engine_state` reads both)."""
    from pipectl.models import build_model
    from pipectl.runtime.engines.torch_pipeline import OptimizerSettings, TorchPipelineEngine

    layout = job.layout
    if dsinit.cuda_available():
        raise UserInputError(
            "the torch engine trains on CPU ranks (gloo) only; this rank sees a GPU",
            hint="re-plan with --engine deepspeed to train on GPUs",
        )
    model = build_model(job.model, allow_shape_only=True)
    schedule = job.schedule or generate(layout.schedule, layout.pipeline_parallel, layout.micro_batches, layout.chunks)
    settings = OptimizerSettings.from_ds_config(job.ds_config)
    return model, TorchPipelineEngine(
        model, schedule, layout.stage_layers, settings, seed=job.seed, samples_per_step=layout.global_batch
    )


@contextmanager
def no_unused_grad_partition():
    """DeepSpeed's ZeRO-1/2 optimizer allocates a zero gradient for each fp32 partition as it is
    built and, unless it offloads to the CPU, drops it on the next line
    (`DeepSpeedZeroOptimizer.initialize_optimizer_states`, DeepSpeed 0.19): on a small model a third
    of the engine's build, all of it writing zeros to fresh memory. Skipped when it
    is that no-op (no offload, not Adagrad, whose state the method also rebuilds)."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.initialize_optimizer_states

    def initialize(self):
        if self.cpu_offload or isinstance(self.optimizer, torch.optim.Adagrad):
            original(self)

    DeepSpeedZeroOptimizer.initialize_optimizer_states = initialize
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer.initialize_optimizer_states = original


@contextmanager
def no_model_broadcast():
    """DeepSpeed broadcasts every parameter from the first replica as it builds an engine, so that
    replicas start equal. An engine whose every parameter is restored next, from the same state on
    every replica (a live resize), skips that: the whole model sent, and waited for, in the pause."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._broadcast_model
    DeepSpeedEngine._broadcast_model = lambda self: None
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = original


class WeightedLoss:
    """The model's loss times a constant: replica r's share of the global-batch mean (see below)."""

    def __init__(self, loss_fn: Callable, weight: float) -> None:
        self.loss_fn = loss_fn
        self.weight = weight
        self.__name__ = f"{getattr(loss_fn, '__name__', 'loss')} x {weight:g}"

    def __call__(self, outputs, labels):
        return self.loss_fn(outputs, labels) * self.weight


def weighted_replica(model, ds_config: dict[str, Any], layout: Layout, replica: int):
    """Uneven replicas (heterogeneous plans): this replica's DeepSpeed batch keys and loss weight.

    VirtualFlow (Or et al., MLSys 2022; docs/design.md, 'The global batch'): replica r with s_r = b_r * m_r of the B samples must contribute
    (s_r / B) x its mean gradient, so that every sample counts equally. DeepSpeed divides each
    micro-batch loss by the replica's accumulation count m_r and averages the replicas' gradients
    (and reported losses) over d, giving (1/d) x (1/m_r) x sum_j grad L_rj. Multiplying the loss by
    w_r = d * s_r / B turns that into (s_r / B) x (1/m_r) x sum_j grad L_rj = (b_r / B) x sum_j
    grad L_rj: the gradient of the mean loss over all B samples, and the reported loss becomes that
    mean too. Each rank gets a config with its own b_r and m_r (DeepSpeed checks the batch keys per
    rank only: train_batch_size = b_r * m_r * d there).

        d = 2, shares 3x2 and 1x2 (B = 8): w_0 = 2 * 6 / 8 = 1.5, w_1 = 2 * 2 / 8 = 0.5
    """
    micro_batch_size, micro_batches = layout.replica_share(replica)
    samples = micro_batch_size * micro_batches
    weight = layout.data_parallel * samples / layout.global_batch
    config = {
        **ds_config,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": samples * layout.data_parallel,
    }
    return replace(model, loss_fn=WeightedLoss(model.loss_fn, weight)), config


def build_model_layers(job: TrainingJob):
    """The job's model as a `LayerDef` list (no module is built)."""
    from pipectl.models import build_model

    return build_model(job.model, allow_shape_only=True)
