"""The search space: pipeline shapes, the candidates built on them, and why others are rejected.

A *shape* fixes what the partition depends on: tensor-parallel degree t, micro-batch size b,
recomputation (`Recompute`: none, whole stages, or per-layer checkpointing, whose recomputed
forwards are part of each stage's backward), and the number of (virtual) stages p*v; it holds the
stage cut and per-stage costs.
A *spec* adds what only changes the step's arithmetic: data-parallel degree d (hence the micro-
batches m = B/(d*b), or ⌈B/(d*b)⌉ on the busiest of uneven replicas; B is never rounded), the schedule and the ZeRO stage. Every spec gets a memory
check and a closed-form lower bound on its step time before anything is timed (the chains of
`pipectl.plan.fast.bounds`; for PipeDream-2BW, priced per update in steady state, its stages' work
per update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from enum import Enum
import itertools
from typing import Sequence

import numpy as np

from pipectl.artifacts.plan import Engine, Framework, Recompute, runtime_runs_zero
from pipectl.artifacts.profile import ModelProfile
from pipectl.catalog import DTYPE_BYTES
from pipectl.plan.costs import (
    ADAM_BYTES_PER_PARAMETER,
    TRANSFORMER_BLOCK,
    Hardware,
    LayerSeconds,
    collective_handoff_seconds,
    data_parallel_seconds,
    gradient_bytes,
    host_compute_slowdown,
    sharded_data_parallel_seconds,
    layer_seconds,
    zero3_prefetch_shares,
    ranks_share_node,
    replicas_share_node,
)
from pipectl.plan.frameworks import joined_cuts
from pipectl.plan.fast.bounds import chain_bound_seconds, two_bw_bound_seconds, zero_bubble_bound_seconds
from pipectl.plan.layer_table import LayerTable, layer_table
from pipectl.plan.memory import (
    FurthestFittingEnds,
    RangeMemory,
    StageMemory,
    by_rank,
    in_flight_units,
    peak_bytes,
    sharded_transient_bytes,
    stage_holding,
    state_bytes_per_parameter,
    state_dtype,
    step_bytes_per_parameter,
    weight_versions,
)
from pipectl.plan.partition import (
    candidate_values,
    greedy_cuts,
    min_bottlenecks,
    prefix_sums,
    uniform_cuts,
    v_balanced_cuts,
)
from pipectl.schedule import ScheduleKind, deepspeed_runnable, stage_ranks, torch_runnable


class Rejection(str, Enum):
    """Why a point of the search space is not a candidate (counted in plan.json's `infeasible`)."""

    BATCH_NOT_DIVISIBLE = "global batch not divisible by data-parallel degree x micro-batch size"
    FEWER_MICRO_BATCHES_THAN_REPLICAS = "fewer micro-batches than data-parallel replicas"
    MEMORY = "a stage does not fit in device memory"
    INTERLEAVED_MICRO_BATCHES = "interleaved schedule needs micro-batches to be a multiple of p"
    TWO_BW_MICRO_BATCHES = "PipeDream-2BW with two weight versions needs at least p - 1 micro-batches per update"
    ZBV_MICRO_BATCHES = "zbv needs at least 2p - 1 micro-batches per replica"
    SHARDED_GRADIENTS_UNEVEN = "ZeRO-2/3 reduce after every micro-batch: replicas must run as many"
    TOO_FEW_LAYERS = "fewer layers than (virtual) stages"
    DEADLINE = "misses the deadline"
    TENSOR_PARALLEL_NOT_PROFILED = "tensor-parallel degree across nodes without shard costs in the profile"


@dataclass(frozen=True)
class ScheduleVariant:
    kind: ScheduleKind
    chunks: int = 1

    @property
    def label(self) -> str:
        return f"{self.kind.value}(v={self.chunks})" if self.chunks > 1 else self.kind.value


@dataclass
class Shape:
    """A partition of the layers into p*v virtual stages for one (t, b, recompute)."""

    tensor_parallel: int
    micro_batch_size: int
    recompute: Recompute
    pipeline_parallel: int
    chunks: int
    stage_layers: tuple[tuple[int, int], ...]
    seconds: LayerSeconds
    table: LayerTable
    memory: StageMemory
    # Per virtual stage, per micro-batch. With per-layer checkpointing the backward includes the
    # stage's layers' recomputed forwards.
    forward: np.ndarray
    backward: np.ndarray
    recompute_seconds: np.ndarray
    send_lower_bound: np.ndarray  # len p*v - 1: the cheaper link's transfer time
    parameters_per_rank: np.ndarray  # after the tensor split
    # Virtual stages placed as a V (zbv: rank k holds stages k and 2p - 1 - k), not in a loop.
    v_placement: bool = False
    # Figures derived from the cut alone (chains, work per rank, tied groups), computed on first
    # need: every spec of this shape reads the same ones.
    _derived: dict = field(default_factory=dict, repr=False)

    @property
    def virtual_stages(self) -> int:
        return self.pipeline_parallel * self.chunks

    def work_per_rank(self, recomputes: Sequence[bool]) -> np.ndarray:
        """Per rank: one micro-batch's F + B (+ R where the schedule recomputes that stage)."""
        per_stage = self.forward + self.backward + np.where(recomputes, self.recompute_seconds, 0.0)
        return by_rank(per_stage, self.pipeline_parallel, self.v_placement).sum(axis=0)

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The rank of each virtual stage (`pipectl.schedule.ir.stage_ranks`)."""
        return stage_ranks(self.virtual_stages, self.pipeline_parallel, self.v_placement)


class SpecFigures:
    """Per-rank figures of a batch of specs, one row each: peak bytes, all-reduce and optimizer
    seconds. Kept as arrays and read as tuples on demand: a search builds ~10^4 specs and reads
    these for the few hundred it simulates or records."""

    __slots__ = ("peaks", "allreduce", "optimizer")

    def __init__(self, peaks: np.ndarray, allreduce: np.ndarray, optimizer: np.ndarray) -> None:
        self.peaks, self.allreduce, self.optimizer = peaks, allreduce, optimizer

    @classmethod
    def single(cls, peak: Sequence[int], allreduce: Sequence[float], optimizer: Sequence[float]) -> "SpecFigures":
        """The figures of one spec (row 0)."""
        return cls(np.array([peak], dtype=np.int64), np.array([allreduce], dtype=float), np.array([optimizer], dtype=float))


@dataclass(frozen=True)
class Spec:
    """A candidate before simulation; its per-rank figures are row `row` of `figures`."""

    shape: Shape
    data_parallel: int
    micro_batches: int
    variant: ScheduleVariant
    zero_stage: int
    lower_bound_seconds: float
    figures: SpecFigures = field(repr=False, compare=False)
    row: int = 0

    @property
    def peak_memory_bytes(self) -> tuple[int, ...]:
        return tuple(self.figures.peaks[self.row].tolist())

    @property
    def allreduce_seconds(self) -> tuple[float, ...]:
        return tuple(self.figures.allreduce[self.row].tolist())

    @property
    def optimizer_seconds(self) -> tuple[float, ...]:
        return tuple(self.figures.optimizer[self.row].tolist())

    @property
    def devices(self) -> int:
        return self.shape.tensor_parallel * self.shape.pipeline_parallel * self.data_parallel

    @property
    def recompute(self) -> bool:
        """Whole-stage recomputation: the schedule's R actions (Varuna always)."""
        return self.shape.recompute is Recompute.STAGE or self.variant.kind is ScheduleKind.VARUNA

    @property
    def checkpoint_layers(self) -> bool:
        """Per-layer activation checkpointing (no R actions)."""
        return self.shape.recompute is Recompute.LAYER

    @property
    def selective_recompute(self) -> bool:
        """Selective recomputation of each block's attention core (no R actions)."""
        return self.shape.recompute is Recompute.SELECTIVE

    @property
    def deepspeed_runnable(self) -> bool:
        return deepspeed_runnable(self.variant.kind, self.variant.chunks) and runtime_runs_zero(
            self.zero_stage, self.shape.pipeline_parallel, self.shape.tensor_parallel,
            checkpoint_layers=self.checkpoint_layers,
        )

    @property
    def torch_runnable(self) -> bool:
        """Whether PyTorch's pipelining runtime (`pipectl.runtime.engines.torch_pipeline`) runs it: its
        schedule without recomputation of either kind, one tensor rank, one replica (that path has
        no data or tensor parallelism yet)."""
        s = self.shape
        return (
            torch_runnable(self.variant.kind, self.recompute or self.checkpoint_layers or self.selective_recompute)
            and s.tensor_parallel == 1
            and self.data_parallel == 1
            and self.zero_stage <= 1
        )

    def engine_for(self, requested: Engine) -> Engine | None:
        """What runs this spec under a request for `requested`: that engine when it can (any:
        DeepSpeed first, then torch), else None."""
        if requested is Engine.DEEPSPEED:
            return Engine.DEEPSPEED if self.deepspeed_runnable else None
        if requested is Engine.TORCH:
            return Engine.TORCH if self.torch_runnable else None
        if self.deepspeed_runnable:
            return Engine.DEEPSPEED
        return Engine.TORCH if self.torch_runnable else None

    def runs_on(self, requested: Engine) -> bool:
        """Whether the plan may choose it under a request for `requested` (any: always)."""
        return requested is Engine.ANY or self.engine_for(requested) is not None

    @property
    def key(self) -> tuple:
        s = self.shape
        return (
            s.tensor_parallel,
            s.pipeline_parallel,
            self.data_parallel,
            s.micro_batch_size,
            self.variant.kind.value,
            self.variant.chunks,
            self.recompute,
            self.zero_stage,
            self.checkpoint_layers,
            self.selective_recompute,
        )

    def describe(self) -> str:
        s = self.shape
        return (
            f"t={s.tensor_parallel} p={s.pipeline_parallel} d={self.data_parallel} "
            f"b={s.micro_batch_size} m={self.micro_batches} {self.variant.label}"
            f"{' recompute' if self.recompute else ' checkpoint-layers' if self.checkpoint_layers else ''}"
            f"{' selective-recompute' if self.selective_recompute else ''}"
            f" zero={self.zero_stage}"
        )


@dataclass
class Rejections:
    counts: dict[Rejection, int] = field(default_factory=dict)
    examples: dict[Rejection, str] = field(default_factory=dict)

    def add(self, reason: Rejection, example: str | None = None, count: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + count
        if example and reason not in self.examples:
            self.examples[reason] = example

    def merge(self, other: "Rejections") -> None:
        """Add another's counts; its examples only for reasons that have none yet (the first stays)."""
        for reason, count in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + count
        for reason, example in other.examples.items():
            self.examples.setdefault(reason, example)

    def summary(self) -> dict[str, int]:
        return {reason.value: count for reason, count in sorted(self.counts.items(), key=lambda kv: -kv[1])}


@dataclass(frozen=True)
class SearchSpace:
    """The degrees, sizes and schedules to enumerate (already checked against the request)."""

    global_batch: int
    tensor_parallel: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]
    recompute: tuple[Recompute, ...]
    variants: tuple[ScheduleVariant, ...]
    zero_stages: tuple[int, ...]
    pipeline_parallel: int | None = None
    data_parallel: int | None = None
    uneven_replicas: bool = True  # replicas may run ⌈B/(d*b)⌉ or ⌊B/(d*b)⌋ micro-batches
    # Degrees spanning nodes the search would try but the profile has no shard costs for (rejected, counted).
    unprofiled_tensor_parallel: tuple[int, ...] = ()
    # Layers that share a stage with the next one (`plan.frameworks.kept_together`: Megatron's final norm).
    kept_together: tuple[int, ...] = ()
    # Another framework the plan is for (`plan.frameworks`): the ZeRO stages it runs at each degree.
    framework: Framework | None = None


def divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


class ShapeBuilder:
    """Builds (and caches) shapes: partitions per (t, b, recompute, stage count)."""

    def __init__(self, profile: ModelProfile, hardware: Hardware, *, kept_together: tuple[int, ...] = ()) -> None:
        self.profile = profile
        self.hardware = hardware
        self.layers = len(profile.layers)
        # Layers no cut separates from the next (a framework's rule, `plan.frameworks.joined_cuts`):
        # every cut is moved to keep them together, so fewer stages fit.
        self.kept_together = kept_together
        self.cuttable_layers = self.layers - len(kept_together)
        self._bottlenecks: dict[tuple[int, int, bool], dict[int, float]] = {}
        self._shapes: dict[tuple[int, int, bool, int, int], Shape] = {}
        self._seconds: dict[tuple[int, int], LayerSeconds] = {}
        # Memory-constrained cuts built for some memory demand (the search counts them as shapes).
        self.memory_constrained_cuts = 0
        self._candidates: dict[tuple[int, int, bool], np.ndarray] = {}
        self._range_memory: dict[tuple[int, int], RangeMemory] = {}
        self._furthest_ends: dict[tuple[int, int, float], FurthestFittingEnds] = {}
        self._work: dict[tuple[int, int, bool], list[float]] = {}
        self._prefixes: dict[tuple[int, int, bool], tuple[float, ...]] = {}
        self._partition_prefixes: dict[tuple[int, int, bool], list[float]] = {}
        self._arrays: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        # Whether the engine priced splits the blocks evenly over the stages (`EngineFeatures.uniform_stages`):
        # then each pipeline has that cut only (`uniform_shape`).
        self.uniform_stages = hardware.features is not None and hardware.features.uniform_stages
        links = hardware.links
        # The cheaper link for an activation transfer (the bound's transfer time per cut).
        self._fastest_link = links.intra if links.intra.seconds(1e6) <= links.inter.seconds(1e6) else links.inter

    def range_memory(self, t: int, b: int) -> RangeMemory:
        """Per layer range: the stage memory terms at micro-batch size b and tensor split t."""
        key = (t, b)
        if key not in self._range_memory:
            self._range_memory[key] = RangeMemory.build(layer_table(self.profile, b, t), t)
        return self._range_memory[key]

    def furthest_fitting_ends(self, t: int, b: int, capacity_bytes: float) -> FurthestFittingEnds:
        """The memoised furthest fitting stage ends at (t, b), shared by every pipeline of that size."""
        key = (t, b, capacity_bytes)
        ends = self._furthest_ends.get(key)
        if ends is None:
            ends = self._furthest_ends[key] = FurthestFittingEnds(self.range_memory(t, b), capacity_bytes)
        return ends

    def candidates(self, t: int, b: int, recompute: bool) -> np.ndarray:
        """Sorted range sums of the per-layer work (the partitioner's candidate bottlenecks)."""
        key = (t, b, recompute)
        if key not in self._candidates:
            self._candidates[key] = candidate_values(self.seconds(b, t).work(recompute))
        return self._candidates[key]

    @property
    def shapes_built(self) -> int:
        return len(self._shapes) + self.memory_constrained_cuts

    def seconds(self, micro_batch_size: int, tensor_parallel: int) -> LayerSeconds:
        key = (micro_batch_size, tensor_parallel)
        if key not in self._seconds:
            table = layer_table(self.profile, micro_batch_size, tensor_parallel)
            self._seconds[key] = layer_seconds(table, self.hardware, tensor_parallel)
        return self._seconds[key]

    def bottleneck(self, t: int, b: int, recompute: bool, stages: int) -> float:
        key = (t, b, recompute)
        if key not in self._bottlenecks:
            work = self.seconds(b, t).work(recompute)
            self._bottlenecks[key] = min_bottlenecks(work, range(1, self.layers + 1))
        return self._bottlenecks[key][stages]

    def has_shape(
        self, t: int, b: int, recompute: bool, p: int, v: int, from_right: bool = False, v_placement: bool = False
    ) -> bool:
        """Whether `shape(...)` of these arguments is built already."""
        return (t, b, recompute, p, v, from_right, v_placement) in self._shapes

    def shape(
        self, t: int, b: int, recompute: bool, p: int, v: int, from_right: bool = False, v_placement: bool = False
    ) -> Shape:
        """The balanced cut into p*v stages: the slowest stage's optimum; with `v_placement`
        (zbv's V) the cut whose slowest rank, two stages paired, is lightest, when that differs."""
        key = (t, b, recompute, p, v, from_right, v_placement)
        shape = self._shapes.get(key)
        if shape is None:
            prefix = self._work_prefix(t, b, recompute)
            cuts = greedy_cuts(prefix, p * v, self.bottleneck(t, b, recompute, p * v), from_right=from_right)
            if cuts is None:  # pragma: no cover - min_bottlenecks guarantees a cut exists
                raise RuntimeError(f"no {p * v}-stage cut at the optimal bottleneck")
            if v_placement and not from_right:  # pair the stages per rank (`partition.v_balanced_cuts`)
                cuts = v_balanced_cuts(prefix, p, cuts, stage_ranks(p * v, p, True))
            shape = self.shape_from_cuts(t, b, recompute, p, v, cuts, v_placement=v_placement)
            self._shapes[key] = shape
        return shape

    def uniform_shape(self, t: int, b: int, recompute: bool, p: int, v: int, v_placement: bool = False) -> Shape | None:
        """The shape of the engine's even split of the blocks over p x v virtual stages
        (`partition.uniform_cuts`), or None where the model has fewer blocks than stages, or, for
        an interleaved pipeline (v > 1), where the blocks do not divide by p x v (Megatron asks
        the layers of a stage to divide into its chunks)."""
        key = (t, b, recompute, p, v, "uniform", v_placement)
        if key not in self._shapes:
            kinds = layer_table(self.profile, b, t).kinds
            blocks = sum(1 for kind in kinds if kind == TRANSFORMER_BLOCK)
            cuts = None if v > 1 and blocks % (p * v) else uniform_cuts(kinds, p * v)
            self._shapes[key] = (  # type: ignore[assignment]
                None if cuts is None else self.shape_from_cuts(t, b, recompute, p, v, cuts, v_placement=v_placement)
            )
        return self._shapes[key]

    def work(self, t: int, b: int, recompute: bool) -> list[float]:
        """Per-layer work (`LayerSeconds.work`), cached per (t, b, recompute); callers must not mutate it."""
        key = (t, b, recompute)
        work = self._work.get(key)
        if work is None:
            work = self._work[key] = self.seconds(b, t).work(recompute)
        return work

    def partition_prefix(self, t: int, b: int, recompute: bool) -> list[float]:
        """`partition.prefix_sums` of the per-layer work, cached per (t, b, recompute); do not mutate it."""
        key = (t, b, recompute)
        prefix = self._partition_prefixes.get(key)
        if prefix is None:
            prefix = self._partition_prefixes[key] = prefix_sums(self.work(t, b, recompute))
        return prefix

    def _work_prefix(self, t: int, b: int, recompute: bool) -> tuple[float, ...]:
        key = (t, b, recompute)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = (0.0, *np.cumsum(self.work(t, b, recompute)).tolist())
        return prefix

    def _stage_arrays(self, b: int, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Forward and backward prefix sums, per-layer output bytes and the prefix sums of what
        per-layer checkpointing recomputes (`LayerSeconds.checkpointed_prefix`) and selective
        recomputation (`LayerSeconds.attention_core_prefix`) as arrays, per (b, t)."""
        key = (b, t)
        arrays = self._arrays.get(key)
        if arrays is None:
            seconds = self.seconds(b, t)
            table = layer_table(self.profile, b, t)
            arrays = (
                np.asarray(seconds.forward_prefix, dtype=float),
                np.asarray(seconds.backward_prefix, dtype=float),
                np.asarray(table.output_activation_bytes, dtype=float),
                np.asarray(seconds.checkpointed_prefix or seconds.forward_prefix, dtype=float),
                np.asarray(seconds.attention_core_prefix or (0.0,) * len(seconds.forward_prefix), dtype=float),
            )
            self._arrays[key] = arrays
        return arrays

    def shape_from_cuts(
        self, t: int, b: int, recompute: Recompute | bool, p: int, v: int, cuts: Sequence[tuple[int, int]],
        v_placement: bool = False,
    ) -> Shape:
        recompute = Recompute(recompute)
        if self.kept_together:
            joined = joined_cuts(tuple(cuts), self.kept_together)
            if joined is None:  # pragma: no cover - the enumeration keeps p * v within cuttable_layers
                raise RuntimeError(f"no {len(cuts)}-stage cut keeps layers {self.kept_together} with the next")
            cuts = joined
        seconds = self.seconds(b, t)
        table = layer_table(self.profile, b, t)
        # `LayerSeconds.stage_forward/backward` and `LinkCost.seconds` over every stage at once:
        # the same float64 operations in the same order, so the same values.
        forward_prefix, backward_prefix, output_bytes, checkpointed_prefix, core_prefix = self._stage_arrays(b, t)
        bounds = np.fromiter(itertools.chain.from_iterable(cuts), dtype=np.intp, count=2 * len(cuts)).reshape(-1, 2)
        starts, ends = bounds[:, 0], bounds[:, 1]
        forward = forward_prefix[ends] - forward_prefix[starts] + seconds.forward_overhead
        backward = backward_prefix[ends] - backward_prefix[starts] + seconds.backward_overhead
        if recompute is Recompute.LAYER:
            # Each checkpointed layer's forward again, just before its backward (the layers' time,
            # not the engine's per-micro-batch overhead: the stage's backward is still one call);
            # `LayerSeconds.recomputed_forward`, the same operations.
            backward = backward + (checkpointed_prefix[ends] - checkpointed_prefix[starts])
        elif recompute is Recompute.SELECTIVE:
            # Each block's attention core's forward again, inside its backward
            # (`LayerSeconds.recomputed_attention`, the same operations).
            backward = backward + (core_prefix[ends] - core_prefix[starts])
        fastest = self._fastest_link
        sends = fastest.latency_seconds + output_bytes[ends[:-1] - 1] / fastest.bandwidth_bytes_per_second
        memory = StageMemory.build(
            table, cuts, tensor_parallel=t, recompute=recompute, pipeline_parallel=p,
            rows=self.range_memory(t, b), bounds=bounds, v_placement=v_placement,
        )
        return Shape(
            tensor_parallel=t,
            micro_batch_size=b,
            recompute=recompute,
            pipeline_parallel=p,
            chunks=v,
            stage_layers=tuple(cuts),
            seconds=seconds,
            table=table,
            memory=memory,
            forward=forward,
            backward=backward,
            recompute_seconds=forward.copy(),
            send_lower_bound=sends,
            parameters_per_rank=memory.parameters,
            v_placement=v_placement,
        )


def recomputing_stages(shape: Shape, kind: ScheduleKind) -> np.ndarray:
    """Which virtual stages run R actions: all but the last, with whole-stage recompute (Varuna
    always); none with per-layer checkpointing, whose recomputation is inside the backward."""
    stages = shape.virtual_stages
    flags = np.zeros(stages, dtype=bool)
    if shape.recompute is Recompute.STAGE or kind is ScheduleKind.VARUNA:
        flags[: stages - 1] = True
    return flags


def chains(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """Per rank k < p: forwards (+ transfers) before it, and backwards (+ transfers) after it
    (computed once per shape; callers must not modify them)."""
    cached = shape._derived.get("chains")
    if cached is None:
        cached = shape._derived["chains"] = _read_only(*_chains(shape))
    return cached


def _read_only(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays, made read-only: cached figures that every spec of a shape shares."""
    for array in arrays:
        array.setflags(write=False)
    return arrays


def _chains(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    p = shape.pipeline_parallel
    forward_chain = np.zeros(p)
    backward_chain = np.zeros(p)
    if p > 1:
        hop_forward = shape.forward[: p - 1] + shape.send_lower_bound[: p - 1]
        hop_backward = shape.backward[: p - 1] + shape.send_lower_bound[: p - 1]
        forward_chain[1:] = np.cumsum(hop_forward)
        backward_chain[1:] = np.cumsum(hop_backward)
    return forward_chain, backward_chain


def lower_bound_seconds(
    shape: Shape,
    kind: ScheduleKind,
    micro_batches: int,
    allreduce: np.ndarray,
    optimizer: np.ndarray,
) -> float:
    """The chains' lower bound on the spec's step time (`pipectl.plan.fast.bounds`); for
    PipeDream-2BW, on its time per update in steady state."""
    work = shape.work_per_rank(recomputing_stages(shape, kind))
    if kind is ScheduleKind.PIPEDREAM_2BW:
        return float(two_bw_bound_seconds(work, micro_batches, allreduce, optimizer))
    forward_chain, backward_chain = chains(shape)
    if kind.splits_backward:
        return float(zero_bubble_bound_seconds(forward_chain, work, micro_batches, allreduce, optimizer))
    return float(chain_bound_seconds(forward_chain, backward_chain, work, micro_batches, allreduce, optimizer))


def data_parallel_costs(
    shape: Shape, hardware: Hardware, data_parallel: int, zero_stage: int, dtype: str, micro_batches: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(all-reduce, optimizer) seconds per rank, as `costs.stage_costs` computes them.

    With measured engine terms (a profile calibrated on this device) it is `costs`' own
    `data_parallel_seconds`; without them, the same ring formula vectorised over ranks (the
    search at scale runs it for every candidate). ZeRO-2/3 (p = 1): `costs.sharded_data_parallel_seconds`,
    whose per-micro-batch collectives read `micro_batches`.
    """
    p, t, d = shape.pipeline_parallel, shape.tensor_parallel, data_parallel
    n = hardware.devices_per_node
    element = DTYPE_BYTES.get(dtype, 4)
    held = shape.parameters_per_rank
    links = hardware.links
    if zero_stage >= 2:
        return _sharded_costs(shape, hardware, d, zero_stage, micro_batches, element)
    features = hardware.features
    if hardware.runtime is not None or (features is not None and features.gradient_reduce_overlap):
        # Measured engine terms, or another engine's overlap: `costs`' own formula, rank by rank,
        # the overlap windows each rank's one micro-batch of backward and of forward.
        backward_window, forward_window = np.zeros(p), np.zeros(p)
        np.add.at(backward_window, np.array(shape.stage_ranks), shape.backward)
        np.add.at(forward_window, np.array(shape.stage_ranks), shape.forward)
        allreduce_list, optimizer_list = data_parallel_seconds(
            [float(x) for x in held], hardware, pipeline_parallel=p, tensor_parallel=t,
            data_parallel=d, zero_stage=zero_stage, element_bytes=element,
            backward_window=backward_window.tolist(), forward_window=forward_window.tolist(),
        )  # fmt: skip
        slowdown = host_compute_slowdown(hardware, t * p * d)
        allreduce_measured = np.array(allreduce_list) + _tied_seconds(shape, hardware, d, element)
        return allreduce_measured, np.array(optimizer_list) * slowdown
    allreduce = np.zeros(p)
    if d > 1:
        # LinkCost.ring_allreduce_seconds (Patarasuk & Yuan 2009) on every rank at once, the same
        # operations in the same order: 2(d-1) * (latency + bytes / d / bandwidth).
        inside = np.array(_replicas_inside(p, t, d, n))
        message = held * _ring_bytes(hardware, element, zero_stage >= 1)
        steps = 2 * (d - 1)
        for ring, where in ((links.allreduce_intra, inside), (links.allreduce_inter, ~inside)):
            seconds = steps * (ring.latency_seconds + message / d / ring.bandwidth_bytes_per_second)
            allreduce = np.where(where, seconds, allreduce)
    allreduce += _tied_seconds(shape, hardware, d, element)
    bandwidth = (hardware.device.memory_bandwidth_gbytes_per_second or 100.0) * 1e9
    updated = held / d if zero_stage >= 1 else held
    return allreduce, updated * ADAM_BYTES_PER_PARAMETER / bandwidth


def _sharded_costs(
    shape: Shape, hardware: Hardware, d: int, zero_stage: int, micro_batches: int, element: int
) -> tuple[np.ndarray, np.ndarray]:
    """ZeRO-2/3's (communication, optimizer) seconds of a one-stage shape, as `costs.stage_costs`
    computes them (`costs.sharded_data_parallel_seconds`, the optimizer x the host's slowdown)."""
    t = shape.tensor_parallel
    slowdown = host_compute_slowdown(hardware, t * shape.pipeline_parallel * d)
    communication, optimizer = sharded_data_parallel_seconds(
        shape.table, shape.seconds, hardware, pipeline_parallel=shape.pipeline_parallel, tensor_parallel=t,
        data_parallel=d, zero_stage=zero_stage, micro_batches=micro_batches, element_bytes=element, slowdown=slowdown,
    )  # fmt: skip
    return np.array(communication), np.array(optimizer) * slowdown


@lru_cache(maxsize=65536)
def _replicas_inside(p: int, t: int, d: int, devices_per_node: int) -> tuple[bool, ...]:
    """Per pipeline rank: whether its d replicas share a node (`costs.replicas_share_node`)."""
    return tuple(replicas_share_node(rank, p, t, d, devices_per_node) for rank in range(p))


def _ring_bytes(hardware: Hardware, element: int, sharded):
    """Bytes per parameter of the ring that `costs.data_parallel_seconds` times at the end of a
    step: the gradient's all-reduce (ZeRO-0), or its reduce-scatter and the parameters' all-gather,
    half a ring each (ZeRO-1, `sharded`: a bool or a column of them); `element` unless the engine
    reduces gradients in fp32 (`costs.gradient_bytes`)."""
    gradient = gradient_bytes(hardware, element)
    if gradient == element:
        return element
    return np.where(sharded, (gradient + element) / 2, gradient)


def _tied_seconds(shape: Shape, hardware: Hardware, d: int, element: int) -> np.ndarray:
    return _tied_seconds_of(
        _tied_groups(shape), shape.pipeline_parallel, shape.tensor_parallel, d, hardware, element,
        shape.table.divisor(shape.tensor_parallel),
    )


def _work_per_rank(shape: Shape, kind: ScheduleKind) -> np.ndarray:
    """`shape.work_per_rank(recomputing_stages(shape, kind))`, once per shape and recomputation."""
    key = ("work", shape.recompute is Recompute.STAGE or kind is ScheduleKind.VARUNA)  # what `recomputing_stages` reads
    work = shape._derived.get(key)
    if work is None:
        (work,) = _read_only(shape.work_per_rank(recomputing_stages(shape, kind)))
        shape._derived[key] = work
    return work


def _tied_groups(shape: Shape) -> tuple[tuple[tuple[int, ...], int], ...]:
    """Per shared group held by two or more ranks: (those ranks in order, its parameter count)."""
    groups = shape._derived.get("tied")
    if groups is None:
        groups = shape._derived["tied"] = _tied_groups_of(shape)
    return groups


def _tied_groups_of(shape: Shape) -> tuple[tuple[tuple[int, ...], int], ...]:
    table, p = shape.table, shape.pipeline_parallel
    if not table.shared_layer_indices or p == 1:
        return ()
    groups: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    # The stage holding each shared layer, visited in (stage, index) order as a scan over every
    # stage would visit them.
    stages = shape.stage_layers
    holders = sorted(
        (stage_holding(stages, index), position, index)
        for position, index in enumerate(table.shared_layer_indices)
        if 0 <= index < stages[-1][1]
    )
    ranks = shape.stage_ranks
    for stage, _, index in holders:
        groups.setdefault(table.shared_group[index], set()).add(ranks[stage])  # type: ignore[arg-type]
        sizes[table.shared_group[index]] = table.shared_parameter_count[index]  # type: ignore[index]
    return tuple((tuple(sorted(ranks)), sizes[group]) for group, ranks in groups.items() if len(ranks) >= 2)


def _tied_seconds_of(
    groups: tuple[tuple[tuple[int, ...], int], ...], p: int, t: int, d: int, hardware: Hardware, element: int,
    divisor: int,
) -> np.ndarray:
    """Per rank: the all-reduce of the shared groups it holds (`costs.stage_costs`' tied term);
    `divisor`: the shape's `LayerTable.divisor(t)`."""
    extra = np.zeros(p)
    for ordered, size in groups:
        inside = all(
            ranks_share_node(ordered[0], r, p, t, d, hardware.devices_per_node) for r in ordered[1:]
        )
        link = hardware.links.allreduce_intra if inside else hardware.links.allreduce_inter
        seconds = link.ring_allreduce_seconds(size / divisor * gradient_bytes(hardware, element), len(ordered))
        seconds += collective_handoff_seconds(hardware, len(ordered), inside)
        for rank in ordered:
            extra[rank] += seconds
    return extra


def in_flight(shape: Shape, variant: ScheduleVariant, micro_batches: int) -> tuple[int, ...]:
    """Peak in-flight chunk-micro-batches per rank for this schedule."""
    kind = variant.kind
    return in_flight_units(kind, shape.pipeline_parallel, micro_batches, variant.chunks)


@lru_cache(maxsize=4096)
def state_bytes(dtype: str, zero_stage: int, data_parallel: int, kind: ScheduleKind) -> float:
    """Bytes per parameter held while micro-batches run (`memory.state_bytes_per_parameter`)."""
    return state_bytes_per_parameter(dtype, zero_stage, data_parallel, weight_versions(kind))


@lru_cache(maxsize=4096)
def step_bytes(dtype: str, zero_stage: int, data_parallel: int, kind: ScheduleKind) -> float:
    """Bytes per parameter at the optimizer step (`memory.step_bytes_per_parameter`)."""
    return step_bytes_per_parameter(dtype, zero_stage, data_parallel, weight_versions(kind))


def transient_bytes(shape: Shape, dtype: str, zero_stage: int, data_parallel: int) -> float:
    """ZeRO-2/3's whole tensors on the rank of a one-stage shape (`memory.sharded_transient_bytes`
    of its layers' parameters after the tensor split; under ZeRO-3, of the units DeepSpeed gathers
    one at a time, `costs.zero3_prefetch_shares`: a large block's linears); 0 for stages 0 and 1."""
    if zero_stage < 2:
        return 0.0
    key = "gathered_units" if zero_stage == 3 else "layer_parameters"
    units = shape._derived.get(key)
    if units is None:
        table = shape.table
        divisor = table.divisor(shape.tensor_parallel)
        layers = [count / divisor for count in table.parameter_count]
        if zero_stage == 3:
            layers = [share * count for kind, count in zip(table.kinds, layers)
                      for share in zero3_prefetch_shares(kind, count)]  # fmt: skip
        units = shape._derived[key] = layers
    return sharded_transient_bytes(units, dtype, zero_stage, data_parallel)


def specs_from_points(
    points: Sequence[tuple[Shape, ScheduleVariant, tuple[int, int, int, float, tuple[int, ...]]]],
    hardware: Hardware,
    dtype: str,
) -> list[Spec]:
    """The specs of (shape, schedule, (d, m, ZeRO stage, state bytes per parameter, in-flight units)), in order.

    Each gets what `data_parallel_costs`, `lower_bound_seconds` and `StageMemory.per_rank_bytes`
    give it alone, computed for every point of the same pipeline depth and schedule at once: one
    row per point, the same float64 operations in the same order on every element (a row's
    maximum does not depend on the order), so the same values. The search at scale builds ~10^4
    specs; one call per point would spend most of its time in numpy's per-call overhead.

        >>> from pipectl.testing.profiles import synthetic_profile
        >>> from pipectl.cluster import local_cluster
        >>> from pipectl.plan.costs import hardware_for
        >>> profile = synthetic_profile(blocks=4, micro_batch_sizes=[1])
        >>> hardware = hardware_for(local_cluster(4), profile)
        >>> shape = ShapeBuilder(profile, hardware).shape(1, 1, False, 2, 1)
        >>> variant = ScheduleVariant(ScheduleKind.ONE_F_ONE_B)
        >>> one, two = specs_from_points(
        ...     [(shape, variant, (2, 4, 1, 7.0, (2, 1))), (shape, variant, (1, 8, 0, 16.0, (2, 1)))], hardware, profile.dtype
        ... )
        >>> (one.data_parallel, one.micro_batches, one.zero_stage), two.peak_memory_bytes[0] > one.peak_memory_bytes[0]
        ((2, 4, 1), True)
    """
    groups: dict[tuple[int, ScheduleVariant], list[int]] = {}
    for index, (shape, variant, _) in enumerate(points):
        groups.setdefault((shape.pipeline_parallel, variant), []).append(index)
    specs: list[Spec | None] = [None] * len(points)
    # The tied all-reduce only depends on these figures: (holding ranks and sizes, p, t, d) -> row.
    tied_rows: dict[tuple, np.ndarray] = {}
    for (_, variant), indices in groups.items():
        built = _specs_of_one_depth(
            [points[i][0] for i in indices], variant, [points[i][2] for i in indices], hardware, dtype, tied_rows
        )
        for index, spec in zip(indices, built):
            specs[index] = spec
    return specs  # type: ignore[return-value]


def _specs_of_one_depth(
    shapes: list[Shape], variant: ScheduleVariant, points: list[tuple[int, int, int, float, tuple[int, ...]]],
    hardware: Hardware, dtype: str, tied_rows: dict[tuple, np.ndarray],
) -> list[Spec]:
    """`specs_from_points` for points whose shapes all have the same p (rows of equal width)."""
    distinct: dict[int, int] = {}
    for shape in shapes:
        distinct.setdefault(id(shape), len(distinct))
    unique = list({id(shape): shape for shape in shapes}.values())
    row_of = np.array([distinct[id(shape)] for shape in shapes])
    kind = variant.kind
    # Per shape (one row each), then one row per point by look-up.
    parameters = np.array([shape.memory.parameters for shape in unique])[row_of]
    unit_bytes = np.array([shape.memory.unit_bytes for shape in unique])[row_of]
    buffer_bytes = np.array([shape.memory.recompute_buffer_bytes for shape in unique])[row_of]
    working_bytes = np.array([shape.memory.working_bytes for shape in unique])[row_of]
    work = np.array([_work_per_rank(shape, kind) for shape in unique])[row_of]
    shape_chains = [chains(shape) for shape in unique]
    forward_chain = np.array([forward for forward, _ in shape_chains])[row_of]
    backward_chain = np.array([backward for _, backward in shape_chains])[row_of]

    ds = np.array([point[0] for point in points], dtype=np.int64)[:, None]
    micro_batches = np.array([point[1] for point in points], dtype=np.int64)[:, None]
    sharded = np.array([point[2] >= 1 for point in points])[:, None]
    per_device = np.array([point[3] for point in points], dtype=float)[:, None]
    units = np.array([point[4] for point in points], dtype=np.int64)
    held = state_dtype(dtype, hardware.features)  # the model state's bytes; `dtype` the collectives'
    per_step = np.array([step_bytes(held, zero, d, kind) for d, _, zero, _, _ in points], dtype=float)[:, None]
    # ZeRO-2/3 points (p = 1 only): their whole tensors on top, and their own communication below.
    gradients_sharded = [i for i, point in enumerate(points) if point[2] >= 2]
    transient: np.ndarray | float = 0.0
    if gradients_sharded:
        transient = np.array(
            [transient_bytes(shape, held, zero, d) for shape, (d, _, zero, _, _) in zip(shapes, points)]
        )[:, None]
    # `StageMemory.per_rank_bytes`, one row per point; reported as the allocator's reserve.
    allocated = peak_bytes(parameters, unit_bytes, buffer_bytes, working_bytes, per_device, per_step, units, transient)
    peak = hardware.memory_budget.reserved(allocated)
    overlapped = hardware.features is not None and hardware.features.gradient_reduce_overlap
    if hardware.runtime is not None or overlapped:  # rank by rank (measured terms; another engine's overlap)
        costs = [
            data_parallel_costs(shape, hardware, d, zero, dtype, m) for shape, (d, m, zero, _, _) in zip(shapes, points)
        ]
        allreduce = np.array([row for row, _ in costs])
        optimizer = np.array([row for _, row in costs])
    else:
        allreduce, optimizer = _data_parallel_costs_over(
            shapes, parameters, ds, sharded, hardware, dtype, tied_rows
        )
        for i in gradients_sharded:
            d, m, zero, _, _ = points[i]
            allreduce[i], optimizer[i] = data_parallel_costs(shapes[i], hardware, d, zero, dtype, m)
    if kind is ScheduleKind.PIPEDREAM_2BW:  # priced per update in steady state
        bounds = two_bw_bound_seconds(work, micro_batches, allreduce, optimizer).tolist()
    elif kind.splits_backward:  # a rank's last W's have no B-chain after them
        bounds = zero_bubble_bound_seconds(forward_chain, work, micro_batches, allreduce, optimizer).tolist()
    else:
        bounds = chain_bound_seconds(forward_chain, backward_chain, work, micro_batches, allreduce, optimizer).tolist()
    figures = SpecFigures(peak.astype(np.int64), allreduce, optimizer)  # int64: truncation, as int() does
    return [
        Spec(shape, d, m, variant, zero, bounds[i], figures, i)
        for i, (shape, (d, m, zero, _, _)) in enumerate(zip(shapes, points))
    ]


def _data_parallel_costs_over(
    shapes: list[Shape], held: np.ndarray, ds: np.ndarray, sharded: np.ndarray, hardware: Hardware, dtype: str,
    tied_rows: dict[tuple, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """`data_parallel_costs` without measured engine terms, one row per point: its shape's
    parameters per rank `held`, its d in `ds`, whether ZeRO shards the optimizer in `sharded`."""
    p = held.shape[1]
    n = hardware.devices_per_node
    element = DTYPE_BYTES.get(dtype, 4)
    links = hardware.links
    degrees = ds[:, 0].tolist()
    # `costs.replicas_share_node` for every rank of every point: rank k's first replica sits on
    # device k*t, its last on ((d-1)*p + k)*t; integer arithmetic, so the same answers.
    ranks = np.arange(p)
    t = np.array([shape.tensor_parallel for shape in shapes], dtype=np.int64)[:, None]
    inside = (ranks * t) // n == (((ds - 1) * p + ranks) * t) // n
    message = held * _ring_bytes(hardware, element, sharded)
    steps = 2 * (ds - 1)  # d = 1 rows: 0 steps, so 0.0 on every rank, as the unreplicated case's zeros
    allreduce = np.zeros(held.shape)
    for ring, where in ((links.allreduce_intra, inside), (links.allreduce_inter, ~inside)):
        seconds = steps * (ring.latency_seconds + message / ds / ring.bandwidth_bytes_per_second)
        allreduce = np.where(where, seconds, allreduce)
    tied = []
    groups_of: dict[int, tuple] = {}
    for shape, d in zip(shapes, degrees):
        groups = groups_of.get(id(shape))
        if groups is None:
            groups = groups_of[id(shape)] = _tied_groups(shape)  # once per shape of this depth
        divisor = shape.table.divisor(shape.tensor_parallel)
        key = (groups, p, shape.tensor_parallel, d, divisor)
        row = tied_rows.get(key)
        if row is None:
            row = tied_rows[key] = _tied_seconds_of(groups, p, shape.tensor_parallel, d, hardware, element, divisor)
        tied.append(row)
    allreduce += np.array(tied)
    bandwidth = (hardware.device.memory_bandwidth_gbytes_per_second or 100.0) * 1e9
    updated = held / np.where(sharded, ds, 1)
    return allreduce, updated * ADAM_BYTES_PER_PARAMETER / bandwidth
