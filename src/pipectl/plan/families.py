"""The points of one search, family by family: a pipeline shape and a schedule (`FamilyKey`: t, b,
recompute, p, schedule) whose points differ in d and the ZeRO stage.

A family's points share their cuts and what is known about their memory demands: which cut each
point gets, or why none, is `plan.family_cuts`. Families come in (t, b) units (`UnitContext`)
that share nothing but read-only inputs, so `plan.space.enumerate_specs` can spread them over
processes (`pipectl.plan.workers`); what a (t, b, p, schedule) shares across recomputation
granularities (the degrees tried, the points and their demands) is found once per unit. A unit's
result travels as arrays (`PortableUnit`), each shape rebuilt from its cut with the same
arithmetic when a spec on it is read (`plan.space`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

import numpy as np

from pipectl.artifacts.plan import RUNTIME_ZERO_STAGES, Recompute
from pipectl.artifacts.profile import ModelProfile
from pipectl.plan.candidates import Rejection, Rejections, ScheduleVariant, SearchSpace, Shape, ShapeBuilder, divisors
from pipectl.plan.family_cuts import Demands, Family, FamilyKey, fitting_shape
from pipectl.plan.spec_costs import state_bytes, step_bytes, transient_bytes
from pipectl.plan.costs import Hardware
from pipectl.plan.frameworks import zero_stages_run
from pipectl.plan.layer_table import layer_table
from pipectl.plan.memory import format_gib, in_flight_units, state_dtype
from pipectl.schedule import ScheduleKind
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
        points: dict[tuple[int, ScheduleVariant], Demands] = {}
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
                    if builder.uniform_stages and (builder.blocks < p * v or (v > 1 and builder.blocks % (p * v))):
                        # `ShapeBuilder.uniform_shape` has no cut: not a matter of memory.
                        rejections.add(Rejection.BLOCKS_NOT_EVEN, f"{count(builder.blocks, 'block')} over p={p} x v={v} "
                                       "stages", len(ds.value))  # fmt: skip
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

    def _demands(self, key: FamilyKey, ds: list[int]) -> Demands:
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
        return Demands(per_d, gradients_sharded, rejections, step_of)

    def enumerate_family(self, builder: ShapeBuilder, key: FamilyKey, demands: Demands, out: UnitResult) -> None:
        """The points of one family (`demands`, on a pipeline its layers can fill): each (shape,
        schedule, point) that fits is appended to `out.accepted`, the others counted in `out.rejections`."""
        out.rejections.merge(demands.rejections)
        per_d, gradients_sharded, step_of = demands.per_d, demands.gradients_sharded, demands.step_of
        family = Family(builder, key, self.capacity, demands)
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
        self, family: Family, key: FamilyKey, per_d: list[tuple], step_of: dict[float, float], out: UnitResult
    ) -> None:
        """Each ZeRO-0/1 point of the family on a cut that fits (accepted), or rejected for memory
        with the first example's figures."""
        t, b, p, variant = key.tensor_parallel, key.micro_batch_size, key.pipeline_parallel, key.variant
        rejections, accepted = out.rejections, out.accepted
        index = 0  # of the point among the family's (d, ZeRO) points with whole interleaved rounds
        # Once the balanced cut is built and checked against every point, a point it fits takes it
        # without the rest of `fitting_shape` (what that answers after the same no-cut check);
        # most accepted points of a large search.
        balanced_fits = None
        uniform = family.builder.uniform_stages
        for d, m, zeros, units, per_device in per_d:
            if units is None:
                example = f"m={m} is not a multiple of p={p}" if m % p else f"uneven replicas run {m} or {m - 1}"
                rejections.add(Rejection.INTERLEAVED_MICRO_BATCHES, example, len(zeros))
                continue
            if family.without_cut and Rejection.MEMORY in rejections.examples:
                # Every ZeRO stage of this d at once when even its lightest demand has no cut (what
                # `fitting_shape` would answer for each): most points of a large search end here.
                if family.without_cut_below(min(per_device), units):
                    rejections.add(Rejection.MEMORY, count=len(zeros))
                    index += len(zeros)
                    continue
            for zero, state in zip(zeros, per_device):
                if balanced_fits is None and not uniform:
                    balanced_fits = family.balanced_fits()
                if balanced_fits is not None and balanced_fits[index] and not family.without_cut_below(state, units):
                    accepted.append((family.shape, variant, (d, m, zero, state, units)))
                    index += 1
                    continue
                fitted = fitting_shape(family, index, state, units)
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
        self, family: Family, variant: ScheduleVariant, d: int, m: int, zero: int, out: UnitResult
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
