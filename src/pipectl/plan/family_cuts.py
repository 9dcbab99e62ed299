"""The cut of one family of points (a pipeline shape and a schedule, `FamilyKey`) for each memory
demand of its points.

The balanced cut is tried first, then the cut that fills later stages first, then the
memory-constrained partition; a demand no laxer than one no cut satisfied is refused without
partitioning again, and a stricter demand takes a laxer demand's cut when that cut fits it
(`fitting_shape`). A demand is (state bytes per parameter, in-flight units per rank); what a family
knows about its demands is kept in `Family`, for that family only. `plan.families` visits the
families and their points.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from pipectl.artifacts.plan import Recompute
from pipectl.plan.candidates import Rejections, ScheduleVariant, Shape, ShapeBuilder
from pipectl.plan.partition import balanced_partition
from pipectl.plan.spec_costs import rows_array
from pipectl.schedule import ScheduleKind, stage_ranks


@dataclass(frozen=True)
class FamilyKey:
    """One family of points: a pipeline shape and a schedule, (t, b, recompute, p, schedule).

    Its points differ in d and the ZeRO stage; they share their cuts and what is known about
    their memory demands (`Family`).
    """

    tensor_parallel: int
    micro_batch_size: int
    recompute: Recompute
    pipeline_parallel: int
    variant: ScheduleVariant


@dataclass
class Demands:
    """The points of the families of one (t, b, p, schedule) and their memory demands
    (`plan.families.UnitContext`)."""

    per_d: list[tuple]  # (d, m, ZeRO stages, units or None, state bytes per ZeRO stage), largest d first
    gradients_sharded: list[tuple[int, int, int]]  # ZeRO-2/3 points (d, m, stage)
    rejections: Rejections  # what finding them rejected
    step_of: dict[float, float]  # training bytes per parameter -> the optimizer step's

    @cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(state bytes, step bytes) as columns and in-flight units (a row per rank's), one row per
        ZeRO-0/1 point with whole interleaved rounds, in the order `UnitContext` visits them: what
        `StageMemory.per_rank_bytes` reads for all of them at once (most families are rejected
        before it is needed)."""
        per_d = self.per_d
        states = [state for _, _, _, units, per_device in per_d if units is not None for state in per_device]
        units = [units for _, _, zeros, units, _ in per_d if units is not None for _ in zeros]
        steps = [self.step_of[state] for state in states]
        return np.array(states)[:, None], np.array(steps)[:, None], rows_array(units)


@lru_cache(maxsize=1024)
def _keeps_input_only(stages: int, recompute: Recompute) -> tuple[Recompute, ...]:
    """Per virtual stage: what it keeps per micro-batch, as `FurthestFittingEnds` reads it: only its
    input (STAGE: all but the last, when recomputing whole stages), its layers' inputs (LAYER:
    every stage), its saved activations less its attention cores' (SELECTIVE: every stage), or its
    saved activations (NONE)."""
    if recompute is Recompute.LAYER or recompute is Recompute.SELECTIVE:
        return (recompute,) * stages
    stage = recompute is Recompute.STAGE
    return tuple(Recompute.STAGE if stage and i != stages - 1 else Recompute.NONE for i in range(stages))


class Family:
    """One (t, b, recompute, p, schedule variant): its memory demands (bytes per parameter,
    in-flight units per rank; one per (d, ZeRO) point), its balanced cut, built on first need,
    and what is known about the demands (each remembered for this family only).

    A demand is named by its training bytes per parameter: in one family (one dtype and
    schedule) those fix the ZeRO sharding, hence the optimizer step's bytes (`step_of`), which
    grow with them. So a demand at least another's in bytes and units is at least as strict in
    both phases, which is what the remembered answers below rely on.
    """

    def __init__(self, builder: ShapeBuilder, key: FamilyKey, capacity: float, demands: Demands) -> None:
        t, b, recompute, p, variant = key.tensor_parallel, key.micro_batch_size, key.recompute, key.pipeline_parallel, key.variant
        self.builder = builder
        self.t, self.b, self.recompute, self.p, self.v = t, b, recompute, p, variant.chunks
        self.kind = variant.kind
        self.v_placement = variant.kind.v_placement
        # The rank of each virtual stage: s % p in a loop, zbv's V otherwise (`stage_ranks`).
        self.ranks = stage_ranks(p * variant.chunks, p, self.v_placement)
        self.capacity = capacity
        self.stages = p * variant.chunks
        self.demands = demands
        self.step_of: dict[float, float] = demands.step_of  # training bytes per parameter -> the step's
        self._shape: Shape | None = None
        self._fits: dict[bool, list[bool]] = {}  # from_right -> whether that cut fits each point
        # Demands without any cut whose every virtual stage fits: a demand at least as large in
        # every part has none either, whatever cut is tried (the balanced one included).
        self.without_cut: list[tuple[float, tuple[int, ...]]] = []
        # Demands no cut satisfied (none fits, or the partitioner's cut did not fit its ranks).
        self.hopeless: list[tuple[float, tuple[int, ...]]] = []
        # Demands partitioned, with the optimum bottleneck and the cut found: a stricter demand
        # cannot do better (its feasible cuts are a subset), and gets the same cut when that cut
        # fits it (`_laxer_optimum`).
        self.partitioned: list[tuple[float, tuple[int, ...], float, Shape]] = []
        # Memory-constrained cuts by (rounded state bytes, units).
        self.fitted: dict[tuple[float, tuple[int, ...]], Shape | None] = {}
        # What each virtual stage keeps per in-flight micro-batch (`recomputing_stages`: all but
        # the last keep only their input when the schedule recomputes whole stages).
        whole = Recompute.STAGE if variant.kind is ScheduleKind.VARUNA else Recompute(recompute)
        self.keeps_input_only = _keeps_input_only(self.stages, whole)
        self.ends = builder.furthest_fitting_ends(t, b, capacity)

    @property
    def shape(self) -> Shape:
        if self._shape is None:
            self._shape = self.builder.shape(self.t, self.b, self.recompute, self.p, self.v, v_placement=self.v_placement)
        return self._shape

    @property
    def shape_built(self) -> bool:
        return self._shape is not None

    def balanced_cut_known(self) -> bool:
        """Whether the builder holds this pipeline's balanced cut already (built for another schedule)."""
        return self.builder.has_shape(self.t, self.b, self.recompute, self.p, self.v, v_placement=self.v_placement)

    def cut_fits(self, index: int, from_right: bool) -> bool:
        """Whether the balanced (or right-filled) cut fits point `index`: `StageMemory.fits` for
        every point of the family at once on first asking (the same arithmetic per element)."""
        fits = self._fits.get(from_right)
        if fits is None:
            shape = self.builder.shape(
                self.t, self.b, self.recompute, self.p, self.v, from_right=from_right, v_placement=self.v_placement
            )
            per_rank = shape.memory.per_rank_bytes(*self.demands.arrays)
            fits = self._fits[from_right] = (per_rank <= self.capacity).all(axis=1).tolist()
        return fits[index]

    def balanced_fits(self) -> list[bool] | None:
        """Whether the balanced cut fits each point (`cut_fits`), once that cut is built and checked."""
        return self._fits.get(False) if self._shape is not None else None

    def has_memory_fitting_cut(self, per_device: float, units: tuple[int, ...]) -> bool:
        """Whether `balanced_partition(..., fits=...)` finds any cut for this demand.

        Its first attempt is the greedy pass at the largest limit, where time never binds: each
        stage ends at the furthest end that fits, leaving a layer for every later stage. It
        succeeds exactly when that pass reaches the last layer, so the same pass over memoised
        furthest ends gives the same answer.
        """
        ends, stages = self.ends, self.stages
        layers = ends.layers
        step = self.step_of[per_device]
        # `ends.end`'s memo rows, read here first: this loop runs ~10^6 times.
        rows_of = {keeps: ends.by_units(per_device, step, keeps) for keeps in set(self.keeps_input_only)}
        start = 0
        room = layers - stages  # the last end that leaves a layer for every later stage, before this one
        for stage_units, keeps in zip(self.stage_units(units), self.keeps_input_only):
            room += 1
            row = rows_of[keeps].get(stage_units)
            if row is None:
                row = ends.row(per_device, step, stage_units, keeps)
            end = row[start]
            if end < 0:
                end = row[start] = ends.search(start, per_device, step, stage_units, keeps)
            if end > room:
                end = room
            if end <= start:
                return False
            start = end
        return start == layers

    def furthest_fitting_end(self, per_device: float, units: tuple[int, ...]):
        """`furthest(stage, start)` for the partitioner: `RangeMemory.stage_bytes`'s test on the
        precomputed per-range rows, each answer memoised across the pipelines of this (t, b)."""
        ends, keeps = self.ends, self.keeps_input_only
        step = self.step_of[per_device]
        units_of = self.stage_units(units)
        # Each stage's memo row, looked up once: the partitioner asks every stage several times.
        rows = [ends.row(per_device, step, stage_units, keep) for stage_units, keep in zip(units_of, keeps)]

        def furthest(stage: int, start: int) -> int:
            end = rows[stage][start]
            if end < 0:
                end = rows[stage][start] = ends.search(start, per_device, step, units_of[stage], keeps[stage])
            return end

        return furthest

    def stage_units(self, units: tuple[int, ...]) -> tuple[int, ...]:
        """Per virtual stage: its rank's in-flight units (stage s on rank s % p in a loop: `units * v`)."""
        if self.v_placement:
            return tuple(units[rank] for rank in self.ranks)
        return units * self.v

    def without_cut_below(self, per_device: float, units: tuple[int, ...]) -> bool:
        return _dominates_one_of(per_device, units, self.without_cut)


def _dominates_one_of(per_device: float, units: tuple[int, ...], demands) -> bool:
    """Whether this demand is at least one of `demands` in every part."""
    # (`map(operator.ge, ...)` is the element-wise `u >= w` without a generator frame: this runs ~10^5 times.)
    for bytes_, units_ in demands:
        if per_device >= bytes_ and all(map(operator.ge, units, units_)):
            return True
    return False


def _laxer_optimum(family: Family, per_device: float, units: tuple[int, ...]) -> tuple[float, Shape | None]:
    """(the best bottleneck this demand can hope for, the cut that reaches it if already known).

    The bound is the largest optimum of the laxer demands partitioned before (each at most this
    one in every part), else the balanced cut's. The cut: a laxer demand's cut whose every rank
    also fits this demand. It is exactly what `balanced_partition` would answer. Its bottleneck
    is the bound (no laxer optimum is above a cut this demand can have), and the partition is the
    greedy pass at the least feasible limit, each stage ending at min(time reach, room for later
    stages, furthest fitting end); this demand's furthest end lies between that cut's end (the
    stage fits: a rank's bytes are at least each of its stages') and the laxer demand's, so every
    stage ends where that cut's does. Most memory-constrained cuts of a large search are found
    this way (the d that follow one another share a cut), without partitioning again.
    """
    builder = family.builder
    at_least = builder.bottleneck(family.t, family.b, family.recompute, family.stages)
    step = family.step_of[per_device]
    tried: set[int] = set()
    for bytes_, units_, seconds, shape in reversed(family.partitioned):  # the nearest demand first
        if bytes_ <= per_device and all(map(operator.ge, units, units_)):
            if id(shape) not in tried:
                if shape.memory.fits(per_device, step, units, family.capacity):
                    return seconds, shape
                tried.add(id(shape))
            at_least = max(at_least, seconds)
    return at_least, None


def fitting_shape(family: Family, index: int, per_device: float, units: tuple[int, ...]) -> Shape | None:
    """This cut if it fits; else the right-filled cut; else the memory-constrained cut; else None.

    A memory demand (bytes per parameter, in-flight units per rank) that no cut satisfies is
    remembered: any demand at least as large in every part cannot be satisfied either. An engine
    that splits its blocks evenly (`EngineFeatures.uniform_stages`) has that cut only.
    """
    builder = family.builder
    if builder.uniform_stages:
        uniform = builder.uniform_shape(
            family.t, family.b, family.recompute, family.p, family.v, v_placement=family.v_placement
        )
        if uniform is None or not uniform.memory.fits(per_device, family.step_of[per_device], units, family.capacity):
            return None
        return uniform
    if family.without_cut_below(per_device, units):
        return None
    if not family.shape_built and not (
        # Another schedule of this pipeline built the balanced cut already: if it fits, some cut
        # does, which is all the memory-only pass below would say.
        family.balanced_cut_known() and family.cut_fits(index, from_right=False)
    ) and not family.has_memory_fitting_cut(per_device, units):
        # Until some demand has a cut, test that first: most families of a large search have none,
        # and then neither the balanced cut nor the partitioner is needed to reject them.
        family.without_cut.append((per_device, units))
        family.hopeless.append((per_device, units))
        family.fitted[(round(per_device, 9), units)] = None
        return None
    shape = family.shape
    if family.cut_fits(index, from_right=False):
        return shape
    # No cut can help when the average rank's model state alone is too big.
    memory = shape.memory
    if memory.parameters.sum() / len(memory.parameters) * family.step_of[per_device] > family.capacity:
        return None
    if _dominates_one_of(per_device, units, family.hopeless):
        return None
    builder, t, b, rec, p, v = family.builder, family.t, family.b, family.recompute, family.p, family.v
    if family.cut_fits(index, from_right=True):
        return builder.shape(t, b, rec, p, v, from_right=True, v_placement=family.v_placement)
    key = (round(per_device, 9), units)
    if key in family.fitted:
        return family.fitted[key]
    fitted = None
    # No cut beats the optimum without a memory limit (the balanced cut's bottleneck, one of the
    # same candidates), nor that of a laxer demand.
    at_least, laxer = _laxer_optimum(family, per_device, units)
    if laxer is not None:
        family.partitioned.append((per_device, units, at_least, laxer))
        family.fitted[key] = laxer
        return laxer
    if family.has_memory_fitting_cut(per_device, units):
        partition = balanced_partition(
            builder.work(t, b, rec), p * v, furthest=family.furthest_fitting_end(per_device, units),
            candidates=builder.candidates(t, b, rec), at_least=at_least, known_feasible=True,
            prefix=builder.partition_prefix(t, b, rec),
        )
        if partition is not None:  # pragma: no branch - the memory-only pass above found a cut
            candidate = builder.shape_from_cuts(t, b, rec, p, v, partition.stage_layers, v_placement=family.v_placement)
            family.partitioned.append((per_device, units, partition.bottleneck_seconds, candidate))
            if candidate.memory.fits(per_device, family.step_of[per_device], units, family.capacity):
                fitted = candidate
                builder.memory_constrained_cuts += 1
    else:
        family.without_cut.append((per_device, units))
    if fitted is None:
        family.hopeless.append((per_device, units))
    family.fitted[key] = fitted
    return fitted
