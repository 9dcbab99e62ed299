"""The points of one search, family by family: a pipeline shape and a schedule (`FamilyKey`: t, b,
recompute, p, schedule) whose points differ in d and the ZeRO stage.

A family's points share their cuts and what is known about their memory demands. The cut of each
(t, b, recompute, p*v) is the balanced partition; a point that does not fit in memory tries the cut
that fills later stages first and then the memory-constrained partition before it is rejected with
its reason (`_fitting_shape`). A point whose demands are no laxer than one already refused is
refused without partitioning again (`_Family`). Families come in (t, b) units (`UnitContext`) that
share nothing but read-only inputs, so `plan.space.enumerate_specs` can spread them over processes
(`pipectl.plan.workers`); a unit's result travels as cuts (`PortableUnit`), each shape rebuilt with
the same arithmetic when a spec on it is read (`plan.space`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Iterable

import numpy as np

from pipectl.artifacts.plan import RUNTIME_ZERO_STAGES, Recompute
from pipectl.artifacts.profile import ModelProfile
from pipectl.plan.candidates import Rejection, Rejections, ScheduleVariant, SearchSpace, Shape, ShapeBuilder, divisors
from pipectl.plan.spec_costs import rows_array, state_bytes, step_bytes, transient_bytes
from pipectl.plan.costs import Hardware
from pipectl.plan.frameworks import zero_stages_run
from pipectl.plan.layer_table import layer_table
from pipectl.plan.memory import format_gib, in_flight_units, state_dtype
from pipectl.plan.partition import balanced_partition
from pipectl.schedule import ScheduleKind, stage_ranks
from pipectl.words import count


@dataclass
class UnitResult:
    """One (t, b) unit's accepted points (shape, schedule, (d, m, ZeRO, state bytes, units)) and rejections."""

    accepted: list[tuple[Shape, ScheduleVariant, tuple[int, int, int, float, tuple[int, ...]]]]
    rejections: Rejections

    def portable(self) -> "PortableUnit":
        """What another process needs to rebuild it: each point's shape named by its cut, with its
        schedule (one pair per distinct shape and schedule), its d and its ZeRO stage; the rest
        of the point follows from those (`UnitContext.point`). Sent as arrays, not as ~10^5 tuples."""
        pairs: dict[tuple[int, int], int] = {}
        portable_pairs: list[tuple[tuple, ScheduleVariant]] = []
        pair_of, degrees = [], []
        for shape, variant, point in self.accepted:
            pair = pairs.get((id(shape), id(variant)))
            if pair is None:
                pair = pairs[(id(shape), id(variant))] = len(portable_pairs)
                portable_pairs.append((_cut_of(shape), variant))
            pair_of.append(pair)
            degrees.append(point[0])
        return PortableUnit(
            portable_pairs, np.array(pair_of, dtype=np.int32), np.array(degrees, dtype=np.int32),
            np.array([point[2] for _, _, point in self.accepted], dtype=np.int8), self.rejections,
        )


@dataclass
class PortableUnit:
    """A unit's accepted points as another process sends them (`UnitResult.portable`): point i is
    on the cut and schedule `pairs[pair_of[i]]` at d = `data_parallel[i]`, ZeRO `zero_stages[i]`."""

    pairs: list[tuple[tuple, ScheduleVariant]]
    pair_of: np.ndarray
    data_parallel: np.ndarray
    zero_stages: np.ndarray
    rejections: Rejections

    def __len__(self) -> int:
        return len(self.pair_of)


def _cut_of(shape: Shape) -> tuple:
    return (shape.tensor_parallel, shape.micro_batch_size, shape.recompute, shape.pipeline_parallel,
            shape.chunks, shape.stage_layers, shape.v_placement)


@dataclass
class _Recorded:
    """A value found once and the rejections found with it, replayed each time it is reused."""

    value: list[int]
    rejections: Rejections


@dataclass
class _Demands:
    """The points of the families of one (t, b, p, schedule) and their memory demands
    (`UnitContext._demands`)."""

    per_d: list[tuple]  # (d, m, ZeRO stages, units or None, state bytes per ZeRO stage), largest d first
    gradients_sharded: list[tuple[int, int, int]]  # ZeRO-2/3 points (d, m, stage)
    rejections: Rejections  # what finding them rejected
    step_of: dict[float, float]  # training bytes per parameter -> the optimizer step's

    @cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(state bytes, step bytes) as columns and in-flight units (a row per rank's), one row per
        ZeRO-0/1 point with whole interleaved rounds, in `_fit_points`' order: what
        `StageMemory.fitting_rows` reads for all of them at once (most families are rejected
        before it is needed)."""
        per_d = self.per_d
        states = [state for _, _, _, units, per_device in per_d if units is not None for state in per_device]
        units = [units for _, _, zeros, units, _ in per_d if units is not None for _ in zeros]
        steps = [self.step_of[state] for state in states]
        return np.array(states)[:, None], np.array(steps)[:, None], rows_array(units)


@dataclass(frozen=True)
class FamilyKey:
    """One family of points: a pipeline shape and a schedule, (t, b, recompute, p, schedule).

    Its points differ in d and the ZeRO stage; they share their cuts and what is known about
    their memory demands (`_Family`).
    """

    tensor_parallel: int
    micro_batch_size: int
    recompute: Recompute
    pipeline_parallel: int
    variant: ScheduleVariant


class UnitContext:
    """What every (t, b) unit of one search reads: the profile, the hardware, the space."""

    def __init__(self, profile: ModelProfile, hardware: Hardware, space: SearchSpace, max_devices: int) -> None:
        self.profile, self.hardware, self.space, self.max_devices = profile, hardware, space, max_devices
        self.layers = len(profile.layers)
        self.capacity = hardware.memory_bytes
        self.budget = hardware.memory_budget
        self.state_dtype = state_dtype(profile.dtype, hardware.features)  # what the state bytes read
        # The least model state a device can hold: every parameter once, the most sharding asked
        # for over the largest d, at the optimizer step (its bytes per parameter are the training
        # ones and more); per depth kind (one stage or more), as ZeRO-2/3 only shard at p = 1.
        self.model_parameters = layer_table(profile, space.micro_batch_sizes[0]).parameters(0, self.layers)
        self.lightest_state = {
            one_stage: min(
                (step_bytes(self.state_dtype, zero, max(divisors(space.global_batch)), variant.kind)
                 for zero in zero_stages_at(space.zero_stages, one_stage) for variant in space.variants),
                default=math.inf,
            )
            for one_stage in (True, False)
        }

    def _depths(self) -> Iterable[int]:
        return [self.space.pipeline_parallel] if self.space.pipeline_parallel else range(1, self.layers + 1)

    def _least_state_bytes(self, t: int, p: int) -> float:
        """The least model state a device of a (t, p) pipeline can hold (infinite where no ZeRO
        stage asked for applies at p)."""
        return self.model_parameters / (t * p) * self.lightest_state[p == 1]

    def point(self, shape: Shape, variant: ScheduleVariant, d: int, zero: int) -> tuple[int, int, int, float, tuple[int, ...]]:
        """(d, m, ZeRO stage, state bytes per parameter, in-flight units per rank) of a point of
        this search, as `_points_by_d` makes it (the same cached functions, so the same values)."""
        kind, p = variant.kind, shape.pipeline_parallel
        m = -(-self.space.global_batch // (d * shape.micro_batch_size))
        return d, m, zero, state_bytes(self.state_dtype, zero, d, kind), in_flight_units(kind, p, m, variant.chunks)

    def estimated_families(self, t: int) -> int:
        """Families of one (t, b) unit that get past the model-state test."""
        return len(self._fitting_depths(t)) * len(self.space.variants) * len(self.space.recompute)

    def estimated_points(self, t: int, b: int) -> int:
        """The (p, d) points of one (t, b) unit's families that get past the model-state test: the
        unit's share of the work (each d up to the devices and the micro-batches; the fewer tensor
        ranks, the more replicas)."""
        micro_batches = self.space.global_batch // b
        return sum(min(self.max_devices // (t * p), micro_batches) for p in self._fitting_depths(t)) * (
            len(self.space.variants) * len(self.space.recompute)
        )

    def _fitting_depths(self, t: int) -> list[int]:
        return [p for p in self._depths() if t * p <= self.max_devices and self._least_state_bytes(t, p) <= self.capacity]

    def enumerate_unit(self, builder: ShapeBuilder, t: int, b: int) -> UnitResult:
        space = self.space
        out = UnitResult([], Rejections())
        rejections = out.rejections
        max_devices, capacity = self.max_devices, self.capacity
        # What does not depend on recomputation, found once per depth (and schedule) and replayed
        # for each granularity: the degrees tried, the points and their memory demands.
        degrees: dict[int, _Recorded] = {}
        points: dict[tuple[int, ScheduleVariant], _Demands] = {}
        for granularity in space.recompute:
            for p in self._depths():
                if t * p > max_devices:
                    break
                recompute = Recompute(granularity)
                if recompute is Recompute.STAGE and p == 1:
                    continue  # one stage is the last stage: it never recomputes whole
                if not zero_stages_at(space.zero_stages, p == 1):
                    continue  # only ZeRO-2/3 asked for: one stage only
                least = self._least_state_bytes(t, p)
                if least > capacity:
                    rejections.add(
                        Rejection.MEMORY,
                        f"t={t} p={p}: model state alone needs {format_gib(self.budget.reserved(least))} > "
                        f"{format_gib(self.budget.usable_bytes)} per device",
                    )
                    continue
                ds = degrees.get(p)
                if ds is None:
                    ds = degrees[p] = _Recorded(self._data_parallel_degrees(t * p, b, found := Rejections()), found)
                rejections.merge(ds.rejections)
                if not ds.value:
                    continue
                for variant in _variants_for(space.variants, p, recompute):
                    key, v = FamilyKey(t, b, recompute, p, variant), variant.chunks
                    if p * v > builder.cuttable_layers:
                        rejections.add(
                            Rejection.TOO_FEW_LAYERS,
                            f"p={p} x v={v} stages > {count(builder.cuttable_layers, 'layer')}", len(ds.value),
                        )
                        continue
                    demands = points.get((p, variant))
                    if demands is None:
                        demands = points[(p, variant)] = self._demands(key, ds.value)
                    self.enumerate_family(builder, key, demands, out)
        return out

    def _data_parallel_degrees(self, devices_per_replica: int, b: int, rejections: Rejections) -> list[int]:
        """The d to try for replicas of `devices_per_replica` devices at micro-batch size b.

        Every d up to the devices and the B / b micro-batches when uneven replicas are allowed
        (`balanced_shares`), else the divisors of B / b; the others are counted as rejections.
        """
        space = self.space
        B = space.global_batch
        limit = self.max_devices // devices_per_replica
        if space.data_parallel:
            tried = [space.data_parallel] if space.data_parallel <= limit else []
        elif space.uneven_replicas:
            tried = list(range(1, limit + 1))
        else:
            tried = [d for d in divisors(B) if d <= limit]
        if B % b:
            if tried:
                rejections.add(Rejection.BATCH_NOT_DIVISIBLE, f"B={B} is not divisible by b={b}", len(tried))
            return []
        micro_batches = B // b
        ds = []
        for d in tried:
            if d > micro_batches:
                rejections.add(Rejection.FEWER_MICRO_BATCHES_THAN_REPLICAS,
                               f"B={B} makes {count(micro_batches, 'micro-batch')} of b={b}, fewer than d={d}")
            elif micro_batches % d and not space.uneven_replicas:
                rejections.add(Rejection.BATCH_NOT_DIVISIBLE, f"B={B} is not divisible by d={d} x b={b}")
            else:
                ds.append(d)
        return ds

    def _demands(self, key: FamilyKey, ds: list[int]) -> "_Demands":
        """The points at the data-parallel degrees `ds` of every family of this (t, b, p, schedule)
        and their memory demands: the same whatever the recomputation."""
        rejections = Rejections()
        per_d, gradients_sharded = self._points_by_d(key, ds, rejections)
        dtype, kind = self.state_dtype, key.variant.kind
        step_of = {
            state: step_bytes(dtype, zero, d, kind)
            for d, _, zeros, units, per_device in per_d if units is not None
            for zero, state in zip(zeros, per_device)
        }
        return _Demands(per_d, gradients_sharded, rejections, step_of)

    def enumerate_family(self, builder: ShapeBuilder, key: FamilyKey, demands: _Demands, out: UnitResult) -> None:
        """The points of one family (`demands`, on a pipeline its layers can fill): each (shape,
        schedule, point) that fits is appended to `out.accepted`, the others counted in `out.rejections`."""
        out.rejections.merge(demands.rejections)
        per_d, gradients_sharded, step_of = demands.per_d, demands.gradients_sharded, demands.step_of
        family = _Family(builder, key, self.capacity, demands)
        self._fit_points(family, key, per_d, step_of, out)
        # Largest d first: a stage that does not fit at some d fits at no smaller one (its state
        # per parameter only grows as d shrinks, its in-flight micro-batches too, and d = 1 drops
        # a transient smaller than what d = 2 shards: at most w + g bytes per parameter of w + g + o).
        too_big: set[int] = set()
        for d, m, zero in gradients_sharded:
            if zero in too_big:
                out.rejections.add(Rejection.MEMORY)
            elif not self._sharded_point(family, key.variant, d, m, zero, out):
                too_big.add(zero)

    def _points_by_d(self, key: FamilyKey, ds: list[int], rejections: Rejections) -> tuple[list[tuple], list[tuple]]:
        """The family's points by d, largest first: (d, m, ZeRO stages, in-flight units, state bytes
        per parameter of each stage) with units None where interleaving needs whole rounds it does
        not have; and the ZeRO-2/3 points (d, m, stage), checked apart. Points the schedule cannot
        run at some d are counted in `rejections`."""
        t, b, p, variant = key.tensor_parallel, key.micro_batch_size, key.pipeline_parallel, key.variant
        space, dtype = self.space, self.state_dtype
        B, v, kind = space.global_batch, variant.chunks, variant.kind
        # Largest d first: the least memory per device (smaller m, more ZeRO sharding), so a demand
        # that does not fit rules out every stricter one without partitioning again.
        per_d = []
        # ZeRO-2/3 points (p = 1 only) are checked on their one cut below, not by the family's
        # remembered demands: their whole-tensor transients are not bytes per parameter.
        gradients_sharded: list[tuple[int, int, int]] = []
        # The stages tried depend on d only through d = 1 (`_zeros_descending`); the in-flight
        # units on m, which runs of d share. Looked up here by int: the loop runs ~10^6 times.
        split = {one: _zeros_split(1 if one else 2, space.zero_stages, p == 1) for one in (True, False)}
        units_of: dict[int, tuple[int, ...]] = {}
        for d in sorted(ds, reverse=True):
            m = -(-B // (d * b))  # the most micro-batches a replica runs (`balanced_shares`)
            zeros, sharded = split[d == 1]
            if space.framework is not None:  # a framework may run a stage at some degrees only
                zeros = zero_stages_run(space.framework, t, p, d, zeros, self.profile.dtype)
                sharded = zero_stages_run(space.framework, t, p, d, sharded, self.profile.dtype)
            if kind is ScheduleKind.ZBV and B // b // d < 2 * p - 1:
                # Rank 0's warm-up runs 2p - 1 forwards before its first backward (`schedule.zbv`).
                rejections.add(
                    Rejection.ZBV_MICRO_BATCHES,
                    f"t={t} p={p} d={d} b={b} zbv: {count(B // b // d, 'micro-batch')} < 2p - 1 = {2 * p - 1}",
                    len(zeros) + len(sharded),
                )
                continue
            if kind is ScheduleKind.PIPEDREAM_2BW and B // b // d < p - 1:
                # Two weight versions need m >= p - 1 on every replica (`pipectl.schedule.twobw`).
                rejections.add(
                    Rejection.TWO_BW_MICRO_BATCHES,
                    f"t={t} p={p} d={d} b={b} 2bw: {count(B // b // d, 'micro-batch')} per update < p - 1 = {p - 1}",
                    len(zeros) + len(sharded),
                )
                continue
            if sharded:
                if B % (d * b):
                    # ZeRO-2/3 reduce-scatter after every micro-batch: uneven replicas would wait on
                    # collectives the others never start (the runtime refuses them too).
                    rejections.add(
                        Rejection.SHARDED_GRADIENTS_UNEVEN,
                        f"t={t} p={p} d={d} b={b} zero={sharded[0]}: B={B} gives uneven replicas",
                        len(sharded),
                    )
                else:
                    gradients_sharded.extend((d, m, zero) for zero in sharded)
            if not zeros:
                continue
            if kind is ScheduleKind.INTERLEAVED and v > 1 and (m % p or B % (d * b)):
                per_d.append((d, m, zeros, None, ()))
                continue
            units = units_of.get(m)
            if units is None:
                units = units_of[m] = in_flight_units(kind, p, m, v)
            per_d.append((d, m, zeros, units, _state_bytes_of(dtype, zeros, d, kind)))
        return per_d, gradients_sharded

    def _fit_points(
        self, family: _Family, key: FamilyKey, per_d: list[tuple], step_of: dict[float, float], out: UnitResult
    ) -> None:
        """Each ZeRO-0/1 point of the family on a cut that fits (accepted), or rejected for memory
        with the first example's figures."""
        t, b, p, variant = key.tensor_parallel, key.micro_batch_size, key.pipeline_parallel, key.variant
        rejections, accepted = out.rejections, out.accepted
        index = 0  # of the point among the family's (d, ZeRO) points with whole interleaved rounds
        # Once the balanced cut is built and checked against every point, a point it fits takes it
        # without `_fitting_shape` (what that would answer: a demand the balanced cut fits has a
        # cut, so no demand without one is below it); most accepted points of a large search.
        balanced_fits = None
        uniform = family.builder.uniform_stages
        for d, m, zeros, units, per_device in per_d:
            if units is None:
                example = f"m={m} is not a multiple of p={p}" if m % p else f"uneven replicas run {m} or {m - 1}"
                rejections.add(Rejection.INTERLEAVED_MICRO_BATCHES, example, len(zeros))
                continue
            if family.without_cut and Rejection.MEMORY in rejections.examples:
                # Every ZeRO stage of this d at once when even its lightest demand has no cut (what
                # `_fitting_shape` would answer for each): most points of a large search end here.
                if family.without_cut_below(min(per_device), units):
                    rejections.add(Rejection.MEMORY, count=len(zeros))
                    index += len(zeros)
                    continue
            for zero, state in zip(zeros, per_device):
                if balanced_fits is None and not uniform:
                    balanced_fits = family.balanced_fits()
                if balanced_fits is not None and balanced_fits[index]:
                    accepted.append((family.shape, variant, (d, m, zero, state, units)))
                    index += 1
                    continue
                fitted = _fitting_shape(family, index, state, units)
                index += 1
                if fitted is None:
                    if Rejection.MEMORY in rejections.examples:
                        # Only the first example is kept: skip building the message (most demands end here).
                        rejections.add(Rejection.MEMORY)
                        continue
                    worst = family.shape.memory.per_rank_bytes(state, step_of[state], units)
                    rank = int(worst.argmax())
                    rejections.add(
                        Rejection.MEMORY,
                        f"t={t} p={p} d={d} b={b} {variant.label}{_recompute_words(key.recompute)} zero={zero}: "
                        f"stage {rank} needs {format_gib(self.budget.reserved(worst[rank]))} > "
                        f"{format_gib(self.budget.usable_bytes)}",
                    )
                    continue
                accepted.append((fitted, variant, (d, m, zero, state, units)))

    def _sharded_point(
        self, family: "_Family", variant: ScheduleVariant, d: int, m: int, zero: int, out: UnitResult
    ) -> bool:
        """A ZeRO-2/3 point of a one-stage family: its one cut fits, with the stage's transient
        whole tensors (`transient_bytes`), or is rejected for memory. Whether it fits."""
        kind, dtype = family.kind, self.state_dtype
        shape = family.shape  # one stage: every layer
        units = in_flight_units(kind, 1, m)
        state, step = state_bytes(dtype, zero, d, kind), step_bytes(dtype, zero, d, kind)
        transient = transient_bytes(shape, dtype, zero, d)
        if shape.memory.fits(state, step, units, self.capacity, transient):
            out.accepted.append((shape, variant, (d, m, zero, state, units)))
            return True
        rejections = out.rejections
        if Rejection.MEMORY in rejections.examples:
            rejections.add(Rejection.MEMORY)
            return False
        needs = shape.memory.per_rank_bytes(state, step, units, transient)[0]
        rejections.add(
            Rejection.MEMORY,
            f"t={family.t} p=1 d={d} b={family.b} {variant.label} zero={zero}: stage 0 needs "
            f"{format_gib(self.budget.reserved(needs))} > {format_gib(self.budget.usable_bytes)}",
        )
        return False


def zero_stages_at(zero_stages: Iterable[int], one_stage: bool) -> tuple[int, ...]:
    """The ZeRO stages asked for that apply at a depth: all of them for one stage, 0 and 1 for a
    pipeline (DeepSpeed's pipeline engine refuses ZeRO-2/3)."""
    return tuple(zero for zero in zero_stages if one_stage or zero < 2)


def _recompute_words(recompute: Recompute) -> str:
    """' recompute', ' checkpoint-layers' or '': a rejection example's words (as `Spec.describe`'s)."""
    return {Recompute.STAGE: " recompute", Recompute.LAYER: " checkpoint-layers",
            Recompute.SELECTIVE: " selective-recompute"}.get(recompute, "")


def _variants_for(variants: Iterable[ScheduleVariant], p: int, recompute: Recompute) -> list[ScheduleVariant]:
    chosen = []
    for variant in variants:
        if variant.kind is ScheduleKind.VARUNA and recompute is not Recompute.STAGE:
            continue  # Varuna is defined with whole-stage recomputation
        if variant.kind.splits_backward and recompute is not Recompute.NONE:
            continue  # zb-h1 is defined without (its W holds the activations until the drain)
        if p == 1 and (variant.chunks > 1 or variant.kind is ScheduleKind.VARUNA):
            continue
        chosen.append(variant)
    if p == 1:
        # One stage: every flush schedule is the same gradient accumulation; keep the first.
        plain = [v for v in chosen if v.kind is not ScheduleKind.PIPEDREAM_2BW]
        return plain[:1] or chosen[:1]
    return chosen


@lru_cache(maxsize=4096)
def _state_bytes_of(dtype: str, zeros: tuple[int, ...], d: int, kind: ScheduleKind) -> tuple[float, ...]:
    """`state_bytes` for each ZeRO stage in `zeros` (the same few values for every p)."""
    return tuple(state_bytes(dtype, zero, d, kind) for zero in zeros)


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


@lru_cache(maxsize=1024)
def _zeros_descending(d: int, zero_stages: tuple[int, ...], one_stage: bool = False) -> tuple[int, ...]:
    """The ZeRO stages tried at d and a depth (`zero_stages_at`), largest (least memory) first."""
    stages = zero_stages_at(zero_stages, one_stage)
    if not stages:
        return ()
    if d == 1:
        # Without data parallelism no stage shards anything: one candidate, labelled with the
        # largest stage asked for that the runtime runs (ZeRO-1), else the smallest asked for
        # (0 when only 0 was asked; 2 when only 2 and 3 were, at p = 1).
        runnable = [zero for zero in stages if zero in RUNTIME_ZERO_STAGES]
        return (max(runnable),) if runnable else (min(stages),)
    return tuple(sorted(stages, reverse=True))


@lru_cache(maxsize=1024)
def _zeros_split(d: int, zero_stages: tuple[int, ...], one_stage: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`_zeros_descending` as (stages 0 and 1, stages 2 and 3): the latter are checked on their one
    cut, not by a family's remembered demands."""
    zeros = _zeros_descending(d, zero_stages, one_stage)
    return tuple(z for z in zeros if z < 2), tuple(z for z in zeros if z >= 2)


class _Family:
    """One (t, b, recompute, p, schedule variant): its memory demands (bytes per parameter,
    in-flight units per rank; one per (d, ZeRO) point), its balanced cut, built on first need,
    and what is known about the demands (each remembered for this family only).

    A demand is named by its training bytes per parameter: in one family (one dtype and
    schedule) those fix the ZeRO sharding, hence the optimizer step's bytes (`step_of`), which
    grow with them. So a demand at least another's in bytes and units is at least as strict in
    both phases, which is what the remembered answers below rely on.
    """

    def __init__(self, builder: ShapeBuilder, key: FamilyKey, capacity: float, demands: _Demands) -> None:
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
            fits = self._fits[from_right] = shape.memory.fitting_rows(*self.demands.arrays, self.capacity).tolist()
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


def _laxer_optimum(family: _Family, per_device: float, units: tuple[int, ...]) -> tuple[float, Shape | None]:
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


def _fitting_shape(family: _Family, index: int, per_device: float, units: tuple[int, ...]) -> Shape | None:
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
