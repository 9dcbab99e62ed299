"""A DeepSpeed `PipelineModule` built from a `ModelLayers`, cut exactly where the plan says.

Two things DeepSpeed does not offer out of the box, and why we need them:

- **Explicit cuts.** `PipelineModule(partition_method=...)` accepts only `parameters`, `uniform`
  and `type:regex`; the planner's cut (PipeDream's dynamic program over profiled layer costs) is
  a list of half-open layer ranges. `PlannedPipelineModule` overrides the module's partitioning
  step to install those boundaries verbatim.
- **Initialisation independent of the layout.** Each layer is built under its own seed
  (`seed + layer index`) inside a forked RNG, so p=1, p=2 or any other cut start from the very
  same weights and the global RNG is left untouched. DeepSpeed's own `seed_layers=True` also
  re-seeds the global RNG before every layer of every forward pass, and its default seed function
  fails on numpy integer seeds under Python 3.11 (DEEPSPEED-ON-CPU.md), so we do not use it.
  A tied layer (the GPT head sharing the embedding table) is seeded with the index of the first
  layer holding that tie, so every stage builds the same table; DeepSpeed then broadcasts it from
  the lowest rank anyway.

Example: gpt-tiny has 9 layers (embed, block.0..5, final_norm, head); a plan cutting it after
block.1 gives DeepSpeed the boundaries

    >>> stage_boundaries([(0, 3), (3, 9)], num_layers=9)
    [0, 3, 9]
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as torch_dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.pipe.topology import ProcessTopology
from torch.overrides import TorchFunctionMode

from pipectl.errors import UserInputError
from pipectl.models.base import LayerDef, ModelLayers
from pipectl.models.tensor_parallel import TensorParallelBlock
from pipectl.models.transformer import TransformerBlock
from pipectl.plan.layer_table import NOT_CHECKPOINTED_KINDS


def stage_boundaries(stage_layers: Sequence[Sequence[int]], num_layers: int) -> list[int]:
    """Half-open `[start, end)` ranges per stage -> DeepSpeed's `parts` list (p + 1 boundaries).

    The ranges must be non-empty, contiguous, start at 0 and end at `num_layers`.

        >>> stage_boundaries([(0, 2), (2, 5), (5, 8)], num_layers=8)
        [0, 2, 5, 8]
    """
    ranges = [tuple(r) for r in stage_layers]
    if not ranges:
        raise UserInputError("stage_layers is empty: a pipeline needs at least one stage")
    for index, layer_range in enumerate(ranges):
        if len(layer_range) != 2:
            raise UserInputError(f"stage {index} range {list(layer_range)} is not a [start, end) pair")
        start, end = layer_range
        if start >= end:
            raise UserInputError(f"stage {index} range [{start}, {end}) holds no layer")
    if ranges[0][0] != 0:
        raise UserInputError(f"the first stage must start at layer 0, got {ranges[0][0]}")
    for index, ((_, end), (start, _)) in enumerate(zip(ranges, ranges[1:])):
        if end != start:
            raise UserInputError(
                f"stage {index} ends at layer {end} but stage {index + 1} starts at {start}: "
                f"ranges must be contiguous"
            )
    if ranges[-1][1] != num_layers:
        raise UserInputError(
            f"the last stage ends at layer {ranges[-1][1]} but the model has {num_layers} layers"
        )
    return [start for start, _ in ranges] + [num_layers]


class SkipRandomInit(TorchFunctionMode):
    """Random initialisers (`normal_`, `uniform_`: every `torch.nn.init` draw and the modules'
    `reset_parameters`) leave the tensor as allocated. For an engine whose every parameter is
    restored right after it is built (a live resize: `runtime.elastic.live_resize`), where drawing them
    is about half of the engine's build. Deterministic initialisers and buffers are
    computed as usual."""

    SKIPPED = frozenset(
        {
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            # torch.nn.init's functions reach the mode themselves; what they call inside is not seen.
            torch.nn.init.normal_,
            torch.nn.init.uniform_,
            torch.nn.init.trunc_normal_,
            torch.nn.init.kaiming_uniform_,
            torch.nn.init.kaiming_normal_,
            torch.nn.init.xavier_uniform_,
            torch.nn.init.xavier_normal_,
            torch.nn.init.orthogonal_,
            torch.nn.init.sparse_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]  # torch.nn.init passes it by name
        return func(*args, **(kwargs or {}))


class SeededLayerSpec(LayerSpec):
    """A `LayerSpec` that builds its module under a fixed seed, leaving the global RNG as it was
    (with `initialise=False`, its parameters are left undrawn: `SkipRandomInit`)."""

    def __init__(self, seed: int, typename: type[torch.nn.Module], *args: Any, initialise: bool = True, **kwargs: Any) -> None:
        super().__init__(typename, *args, **kwargs)
        self.seed = int(seed)
        self.initialise = initialise

    def build(self, log: bool = False) -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]), (nullcontext() if self.initialise else SkipRandomInit()):
            torch.manual_seed(self.seed)
            return super().build(log=log)


class SeededTiedLayerSpec(TiedLayerSpec):
    """A `TiedLayerSpec` seeded like `SeededLayerSpec` (same seed on every stage holding the tie)."""

    def __init__(
        self, seed: int, key: str, typename: type[torch.nn.Module], *args: Any, initialise: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(key, typename, *args, **kwargs)
        self.seed = int(seed)
        self.initialise = initialise

    def build(self, log: bool = False) -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]), (nullcontext() if self.initialise else SkipRandomInit()):
            torch.manual_seed(self.seed)
            return super().build(log=log)


def layer_specs(model: ModelLayers, seed: int, initialise: bool = True) -> list[LayerSpec]:
    """One (Tied)LayerSpec per `LayerDef`, seeded by `seed + layer index` (ties: first holder's index)."""
    first_holder: dict[str, int] = {}
    specs: list[LayerSpec] = []
    for index, layer in enumerate(model.layers):
        specs.append(_spec(layer, index, seed, first_holder, initialise))
    return specs


def _spec(layer: LayerDef, index: int, seed: int, first_holder: dict[str, int], initialise: bool) -> LayerSpec:
    if layer.tie_key is None:
        return SeededLayerSpec(seed + index, layer.module_cls, *layer.args, initialise=initialise, **layer.kwargs)
    owner = first_holder.setdefault(layer.tie_key, index)
    return SeededTiedLayerSpec(
        seed + owner,
        layer.tie_key,
        layer.module_cls,
        *layer.args,
        forward_fn=layer.tied_forward,
        tied_weight_attr=layer.tied_weight_attr,
        initialise=initialise,
        **layer.kwargs,
    )


class PlannedPipelineModule(PipelineModule):
    """A `PipelineModule` whose stage boundaries are given, not computed.

    `boundaries` is DeepSpeed's `parts` list: stage s holds layers [boundaries[s], boundaries[s+1]).
    """

    def __init__(
        self, layers: Sequence[LayerSpec], boundaries: Sequence[int], *, not_checkpointed: frozenset[int] = frozenset(),
        **kwargs: Any,
    ) -> None:
        # Set before PipelineModule.__init__, which calls _partition_layers() from inside itself.
        object.__setattr__(self, "planned_boundaries", [int(b) for b in boundaries])
        object.__setattr__(self, "not_checkpointed", not_checkpointed)  # model layer indices
        super().__init__(layers=layers, **kwargs)

    def _precompute_checkpointable_values(self) -> None:
        """DeepSpeed's choice of checkpointed layers (every layer with parameters, at interval 1),
        less the layers the planner prices as kept whole (`not_checkpointed`: the LM head,
        `plan.layer_table.NOT_CHECKPOINTED_KINDS`)."""
        super()._precompute_checkpointable_values()
        if self.activation_checkpoint_interval == 1 and self.not_checkpointed:
            self.is_checkpointable_results = [
                checkpointable and self._local_start + index not in self.not_checkpointed
                for index, checkpointable in enumerate(self.is_checkpointable_results)
            ]

    def _partition_layers(self, method: str = "uniform") -> None:
        stages = self.num_stages
        if len(self.planned_boundaries) != stages + 1:
            raise UserInputError(
                f"the plan cuts the model into {len(self.planned_boundaries) - 1} stages but the "
                f"topology has {stages} pipeline stages"
            )
        # Plain ints: DeepSpeed's own partitioners leave numpy integers here, which JSON rejects.
        self.parts = list(self.planned_boundaries)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


    def _synchronize_tied_weights(self) -> None:
        # DeepSpeed broadcasts the tied parameters in place with autograd on, which records the
        # broadcast in their history (torch warns at every backward that c10d::broadcast_ has no
        # autograd kernel). Copying weights is not part of the model: do it without autograd.
        with torch.no_grad():
            super()._synchronize_tied_weights()


def planned_topology(pipeline_parallel: int, data_parallel: int, tensor_parallel: int = 1) -> ProcessTopology:
    """Ranks laid out as the planner prices them (`plan/placement.py`):

        rank = (replica * p + stage) * t + tensor_rank

    A replica's ranks are consecutive, so a launcher that numbers ranks node by node puts a
    tensor-parallel group inside a node, a pipeline's neighbouring stages on the same or the next
    node, and each replica on nodes of its own (what a split over device kinds needs: its node
    groups listed in replica order). DeepSpeed's `PipeDataParallelTopology` numbers stage-major
    instead (the replicas of a stage consecutive), which puts the pipeline's sends, not the
    all-reduce, on the links between nodes.

        >>> topology = planned_topology(pipeline_parallel=2, data_parallel=2)
        >>> [(c.data, c.pipe) for c in map(topology.get_coord, range(4))]
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    """
    if tensor_parallel > 1:
        return ProcessTopology(axes=["data", "pipe", "model"], dims=[data_parallel, pipeline_parallel, tensor_parallel])
    return ProcessTopology(axes=["data", "pipe"], dims=[data_parallel, pipeline_parallel])


def _recomputes_selectively(module_cls: type) -> bool:
    """Whether a block class runs its attention core through `run_attention_core` (pipectl's own
    blocks, whole or split over a tensor group)."""
    return issubclass(module_cls, (TransformerBlock, TensorParallelBlock))


def build_pipeline_module(
    model: ModelLayers,
    stage_layers: Sequence[Sequence[int]],
    *,
    topology: ProcessTopology | None = None,
    num_stages: int | None = None,
    seed: int = 0,
    chunks: int = 1,
    initialise: bool = True,
    checkpoint_layers: bool = False,
    selective_recompute: bool = False,
) -> PlannedPipelineModule:
    """The model as a DeepSpeed `PipelineModule`, cut at the plan's half-open `stage_layers`.

    Give either `topology` (`planned_topology`) or `num_stages` (data parallelism then fills the
    rest of the world). torch.distributed must be initialised.
    `initialise=False` leaves the parameters undrawn, for a caller that restores all of them
    (`SkipRandomInit`).
    `chunks` > 1 (interleaved schedules: several model chunks per rank) cannot run in DeepSpeed's
    pipeline engine, which holds one contiguous range of layers per rank; it is refused here.
    `checkpoint_layers`: per-layer activation checkpointing, DeepSpeed's own
    (`activation_checkpoint_interval=1`: every layer with parameters runs under a checkpoint and
    keeps only its input; its forward runs again just before its backward), except the LM head, as
    the planner prices it (`plan.layer_table.NOT_CHECKPOINTED_KINDS`). Non-reentrant
    (`deepspeed.checkpointing.non_reentrant_checkpoint`, torch's saved-tensor hooks): the reentrant
    one detaches a first layer whose input (token ids) needs no gradient, so the embedding would
    get none. Set on the module, not only in the config, so that the ordinary engine of a
    one-stage ZeRO-2 plan (`plain.py`) runs it too.
    `selective_recompute`: every transformer block of the stage recomputes its attention core
    inside its backward (`models.transformer.run_attention_core`), as the planner prices it; a
    model whose blocks cannot (Hugging Face decoder layers) is refused.

    Example: gpt-tiny (9 layers) on two stages, the first holding the embedding and 3 blocks:

        module = build_pipeline_module(build_model("gpt-tiny"), [(0, 4), (4, 9)], num_stages=2)
    """
    if chunks != 1:
        raise UserInputError(
            f"the plan uses {chunks} model chunks per device (interleaved schedule); DeepSpeed's "
            f"pipeline engine holds one contiguous layer range per rank and cannot run it",
            hint="re-plan for a DeepSpeed launch, which excludes interleaved schedules with v > 1",
        )
    if selective_recompute:
        unable = sorted({layer.module_cls.__name__ for layer in model.layers
                         if layer.kind == "transformer_block" and not _recomputes_selectively(layer.module_cls)})
        if unable:
            raise UserInputError(
                f"{', '.join(unable)} cannot recompute its attention core alone (selective recomputation)",
                hint="re-plan with --recompute layer, stage or never",
            )
    if topology is None and num_stages is None:
        raise UserInputError("give the pipeline topology or the number of stages")
    stages = topology.get_dim("pipe") if topology is not None else int(num_stages)
    if len(stage_layers) != stages:
        raise UserInputError(
            f"the plan has {len(stage_layers)} stage ranges {list(map(list, stage_layers))} for "
            f"{stages} pipeline stages",
            hint="with several ranges per rank the plan is interleaved (v > 1): not runnable in DeepSpeed",
        )
    boundaries = stage_boundaries(stage_layers, len(model.layers))
    if topology is None:
        world = torch_dist.get_world_size()
        if world % stages:
            raise UserInputError(f"{stages} pipeline stages do not divide the world size {world}")
        topology = planned_topology(stages, world // stages)
    checkpointing = (
        {
            "activation_checkpoint_interval": 1,
            "activation_checkpoint_func": ds_checkpointing.non_reentrant_checkpoint,
            "not_checkpointed": frozenset(
                index for index, layer in enumerate(model.layers) if layer.kind in NOT_CHECKPOINTED_KINDS
            ),
        }
        if checkpoint_layers
        else {}
    )
    module = PlannedPipelineModule(
        layer_specs(model, seed, initialise),
        boundaries,
        topology=topology,
        loss_fn=model.loss_fn,
        partition_method="uniform",  # ignored: _partition_layers installs the planned cut
        **checkpointing,
    )
    if selective_recompute:
        for block in module.modules():
            if hasattr(block, "selective_recompute"):
                block.selective_recompute = True
    if checkpoint_layers:
        # Which layers run under a checkpoint: DeepSpeed's pipeline engine works this out when it
        # is built, its ordinary engine never does (and the module's forward would then run no layer).
        module._precompute_checkpointable_values()
    return module
