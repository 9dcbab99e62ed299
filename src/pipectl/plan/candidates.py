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
from enum import Enum
from functools import cache
import itertools
from typing import Callable, Sequence

import numpy as np

from pipectl.artifacts.plan import Engine, Framework, Recompute, runtime_runs_zero
from pipectl.artifacts.profile import ModelProfile
from pipectl.plan.costs import TRANSFORMER_BLOCK, Hardware, LayerSeconds, layer_seconds
from pipectl.plan.frameworks import joined_cuts
from pipectl.plan.fast.bounds import chain_bound_seconds, two_bw_bound_seconds, zero_bubble_bound_seconds
from pipectl.plan.layer_table import LayerTable, layer_table
from pipectl.plan.memory_ranges import FurthestFittingEnds, RangeMemory
from pipectl.plan.memory import StageMemory, by_rank
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
    BLOCKS_NOT_EVEN = "the engine splits its blocks evenly: fewer blocks than (virtual) stages, or not a multiple"
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
    """Per-rank figures of a batch of specs, row by row: (peak bytes, all-reduce seconds, optimizer
    seconds), computed by `compute(row)` on first read and kept: a search reads them for the few
    hundred specs it simulates or records."""

    __slots__ = ("_compute", "_rows")

    def __init__(self, compute: Callable[[int], tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]]) -> None:
        self._compute = compute
        self._rows: dict[int, tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]] = {}

    def row(self, index: int) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
        figures = self._rows.get(index)
        if figures is None:
            figures = self._rows[index] = self._compute(index)
        return figures

    @classmethod
    def single(cls, peak: Sequence[int], allreduce: Sequence[float], optimizer: Sequence[float]) -> "SpecFigures":
        """The figures of one spec (row 0)."""
        figures = (
            tuple(np.array(peak, dtype=np.int64).tolist()),
            tuple(np.array(allreduce, dtype=float).tolist()),
            tuple(np.array(optimizer, dtype=float).tolist()),
        )
        return cls(lambda _: figures)


# Which engine runs a spec depends on a few of its figures only: answered once per combination
# (the search asks it of every point it accepts, ~3 x 10^5 at scale: `plan.space._columns`).
@cache
def _deepspeed_runs(variant: ScheduleVariant, zero_stage: int, p: int, t: int, recompute: Recompute) -> bool:
    return deepspeed_runnable(variant.kind, variant.chunks) and runtime_runs_zero(
        zero_stage, p, t, checkpoint_layers=recompute is Recompute.LAYER
    )


@cache
def _torch_runs(variant: ScheduleVariant, zero_stage: int, t: int, recompute: Recompute, one_replica: bool) -> bool:
    recomputes = recompute is not Recompute.NONE or variant.kind is ScheduleKind.VARUNA
    return torch_runnable(variant.kind, recomputes) and t == 1 and one_replica and zero_stage <= 1


def engines_running(shape: Shape, variant: ScheduleVariant, zero_stage: int, data_parallel: int) -> tuple[bool, bool]:
    """(whether DeepSpeed's pipeline engine runs it, whether torch's pipelining runtime does): a
    spec's `deepspeed_runnable` and `torch_runnable` from its figures."""
    t, recompute = shape.tensor_parallel, shape.recompute
    return (
        _deepspeed_runs(variant, zero_stage, shape.pipeline_parallel, t, recompute),
        _torch_runs(variant, zero_stage, t, recompute, data_parallel == 1),
    )


def tied(seconds: float) -> float:
    """A figure (a step, a cost) as ranking compares it: to 12 significant digits, so that two
    timelines of one step summed in another order (differing in the last bits) tie, and a tie goes
    to `Spec.preference`. The ranking and the morph table both compare so."""
    return float(f"{seconds:.12g}")


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
        return self.figures.row(self.row)[0]

    @property
    def allreduce_seconds(self) -> tuple[float, ...]:
        return self.figures.row(self.row)[1]

    @property
    def optimizer_seconds(self) -> tuple[float, ...]:
        return self.figures.row(self.row)[2]

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
        s = self.shape
        return _deepspeed_runs(self.variant, self.zero_stage, s.pipeline_parallel, s.tensor_parallel, s.recompute)

    @property
    def torch_runnable(self) -> bool:
        """Whether PyTorch's pipelining runtime (`pipectl.runtime.engines.torch_pipeline`) runs it: its
        schedule without recomputation of either kind, one tensor rank, one replica (that path has
        no data or tensor parallelism yet)."""
        s = self.shape
        return _torch_runs(self.variant, self.zero_stage, s.tensor_parallel, s.recompute, self.data_parallel == 1)

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

    @property
    def preference(self) -> tuple:  # (the ties it breaks: `tied`)
        """Among specs of equal rank (the same step, or cost): fewer devices, then no recomputation
        (the same step for fewer FLOPs, and a layout more engines run), then less memory; the key
        last, so that the order never rests on which was found first. The ranking and the morph
        table both break ties by it, so that they name one layout for one device count."""
        recomputes = self.recompute or self.checkpoint_layers or self.selective_recompute
        return (self.devices, recomputes, max(self.peak_memory_bytes, default=0), self.key)

    def describe(self, global_batch: int | None = None) -> str:
        """e.g. 't=4 p=14 d=18 b=1 m=86/85 1f1b zero=1': with `global_batch`, replicas that run
        uneven shares show both counts, as the plan table does."""
        s = self.shape
        m = str(self.micro_batches)
        if global_batch is not None and s.micro_batch_size * self.micro_batches * self.data_parallel != global_batch:
            m = f"{self.micro_batches}/{self.micro_batches - 1}"  # ⌈B/(d·b)⌉ and ⌊B/(d·b)⌋
        return (
            f"t={s.tensor_parallel} p={s.pipeline_parallel} d={self.data_parallel} "
            f"b={s.micro_batch_size} m={m} {self.variant.label}"
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
        self.blocks = sum(1 for layer in profile.layers if layer.kind == TRANSFORMER_BLOCK)
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
            cuts = None if v > 1 and self.blocks % (p * v) else uniform_cuts(kinds, p * v)
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
        cached = shape._derived["chains"] = read_only(*_chains(shape))
    return cached


def read_only(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
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
