"""The search space and its enumeration: every feasible (t, p, d, b, v, schedule, recompute, ZeRO).

`search_space` turns a request into the degrees, sizes and schedules to try: t divides the node
size or spans whole nodes (`tensor_parallel_degrees`; the model must split t ways), p ≤ layers,
d with t*p*d ≤ devices, b from the profile and dividing B.
The B/b micro-batches of a step are dealt out over the d replicas: B/(d*b) each when d divides
B/b, else ⌈·⌉ or ⌊·⌋ (`balanced_shares`, VirtualFlow's uneven virtual nodes; the slowest replica,
with ⌈·⌉, sets the step and the memory), so B is never rounded and every device count has
candidates. Schedules 1f1b, gpipe, interleaved (v ∈ {2, 4} when p*v ≤ layers and p | m on every
replica) and Varuna; PipeDream-2BW only when asked for (always flagged; m ≥ p − 1 on every replica,
else rejected: two weight versions need it). For PyTorch's pipelining runtime (engine torch) also
zb-h1 and zbv (v = 2, its stages placed as a V: `Shape.v_placement`, which the per-rank memory,
parameters and costs read; m ≥ 2p − 1 on every replica, else rejected). ZeRO stages as asked, 2
and 3 at p = 1 only (DeepSpeed's pipeline engine refuses them with p > 1, so deeper pipelines
never get those points: they are outside the space, not rejected), flagged with a tensor split
(pipectl's runtime trains them in DeepSpeed's ordinary engine with one stage and t = 1).

Recomputation as asked (`PlanRequest.recompute_granularities`): none, whole stages (R actions on
every stage but the last; never at p = 1, where the one stage is the last) and per-layer
checkpointing (every stage, p = 1 included; its recomputed forwards are part of the backward's
cost, its families are families like the others), and selective recomputation of the attention
core (the same, where the profile records the core: `layer_table.offered_granularities`).

`enumerate_specs` visits them, family by family (`plan.families`), in (t, b) units that can be
spread over processes (`pipectl.plan.workers`).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from pipectl.artifacts.plan import Engine, PlanRequest
from pipectl.artifacts.profile import ModelProfile
from pipectl.plan.candidates import (
    Rejection, Rejections, ScheduleVariant, SearchSpace, Shape, ShapeBuilder, Spec, divisors, engines_running,
)
from pipectl.plan.spec_costs import point_bounds, spec_figures
from pipectl.plan.costs import TRANSFORMER_BLOCK, Hardware
from pipectl.plan.frameworks import kept_together, recompute_offered, space_of
from pipectl.plan.layer_table import offered_granularities
from pipectl.plan.spec_pool import SpecPool
from pipectl.plan.workers import share
from pipectl.schedule import ScheduleKind
from pipectl.plan.families import PortableUnit, UnitContext, UnitResult

DEFAULT_SCHEDULES = (ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE, ScheduleKind.INTERLEAVED, ScheduleKind.VARUNA)
# Searched by default too when the plan is for PyTorch's pipelining runtime (engine torch): zero
# bubble. Not for engine any (--any-engine), whose search spans every layout: zb-h1 is timed by a
# direct walk (`pipectl.plan.fast.zero_bubble`), not in waves, so a search at scale with it is
# markedly slower; list it in --schedules to price it.
DEEPSPEED_FREE_SCHEDULES = (ScheduleKind.ZB_H1, ScheduleKind.ZBV)
ZBV_CHUNKS = 2  # zbv's stages per rank


def tensor_parallel_possible(profile: ModelProfile, t: int) -> bool:
    """Whether the search tries degree t > 1: the model has blocks to split, and a profile with
    shard costs has them for t (profiling writes shards for every t whose heads divide, so a
    degree without any would not build); without shards, t must divide the hidden size."""
    has_blocks = _has_blocks(profile)
    if profile.has_shards:
        return has_blocks and t in profile.shard_degrees()
    return has_blocks and (profile.hidden is None or profile.hidden % t == 0)


# Tensor groups spanning nodes searched by default: up to this many whole nodes (t = 2n on 8-device
# nodes: 16). See `tensor_parallel_degrees`.
DEFAULT_MAX_TENSOR_PARALLEL_NODES = 2


def tensor_parallel_degrees(
    request: PlanRequest, profile: ModelProfile, hardware: Hardware
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the degrees t to search, the degrees spanning nodes left out because the profile has no
    shard costs for them), without a pinned --tensor-parallel.

    Inside a node: every t that divides its n devices. Across nodes: t = k n for k >= 2, t dividing
    the cluster's devices, so that tensor groups tile whole nodes (`placement.tensor_parallel_placeable`;
    their all-reduces are priced on the inter-node link, `placement.tensor_parallel_link`). Both up to
    --max-tensor-parallel when given, and the model must split at t (`tensor_parallel_possible`).

    Without --max-tensor-parallel the degrees spanning nodes stop at
    `DEFAULT_MAX_TENSOR_PARALLEL_NODES` nodes (t = 2n). Each degree is a (t, b) unit of the search,
    as much work as an in-node degree (t = 16 adds about a tenth to GPT 1T on 384 x 8 A100s,
    `benchmarks/plan_scale.py`), and every further node buys less: a spanning ring's bandwidth term
    stays about 2M / (n B_inter) per all-reduce whatever t is (`placement.tensor_parallel_link`) while
    its latency term grows with t and each device's GEMMs get narrower and less efficient. Measured
    runs say the same (Narayanan et al. 2021, §5.4.1, takeaway 1: tensor parallelism up to the g
    GPUs of a server, pipeline parallelism beyond). One spanning degree lets the costs decide between a tensor group in a
    node and one across nodes; --max-tensor-parallel opens the rest (every multiple of n up to it).
    """
    n = hardware.devices_per_node
    limit = request.max_tensor_parallel or DEFAULT_MAX_TENSOR_PARALLEL_NODES * n
    inside = [t for t in divisors(n) if t <= limit]
    across = [k * n for k in range(2, limit // n + 1) if hardware.devices % (k * n) == 0]
    searched = [t for t in inside + across if t == 1 or tensor_parallel_possible(profile, t)]
    unprofiled = tuple(t for t in across if t not in searched and _has_blocks(profile) and profile.has_shards)
    return tuple(searched), unprofiled


def _has_blocks(profile: ModelProfile) -> bool:
    return any(layer.kind == TRANSFORMER_BLOCK for layer in profile.layers)


def search_space(request: PlanRequest, profile: ModelProfile, hardware: Hardware) -> SearchSpace:
    unprofiled: tuple[int, ...] = ()
    if request.tensor_parallel is not None:
        ts: tuple[int, ...] = (request.tensor_parallel,)
    else:
        ts, unprofiled = tensor_parallel_degrees(request, profile, hardware)
    bs = (request.micro_batch_size,) if request.micro_batch_size else tuple(profile.micro_batch_sizes)
    defaults = DEFAULT_SCHEDULES + DEEPSPEED_FREE_SCHEDULES if request.target_engine is Engine.TORCH else DEFAULT_SCHEDULES
    kinds = [request.schedule] if request.schedule else list(request.schedules or defaults)
    if request.framework is not None:  # only what that framework runs (`plan.frameworks`)
        kinds = [kind for kind in kinds if kind in space_of(request.framework).schedules]
    variants: list[ScheduleVariant] = []
    for kind in kinds:
        if kind is ScheduleKind.INTERLEAVED:
            variants += [ScheduleVariant(kind, v) for v in sorted(set(request.chunks))]
        elif kind is ScheduleKind.ZBV:
            variants.append(ScheduleVariant(kind, ZBV_CHUNKS))  # two stages per rank, placed as a V
        else:
            variants.append(ScheduleVariant(kind))
    return SearchSpace(
        global_batch=request.global_batch,
        tensor_parallel=ts,
        micro_batch_sizes=bs,
        recompute=offered_granularities(recompute_offered(request.framework, request.recompute_granularities), profile),
        variants=tuple(variants),
        zero_stages=tuple(sorted(
            zero for zero in set(request.zero_stages)
            if request.framework is None or zero in space_of(request.framework).zero_stages
        )),
        pipeline_parallel=request.pipeline_parallel,
        data_parallel=request.data_parallel,
        uneven_replicas=request.uneven_replicas,
        unprofiled_tensor_parallel=unprofiled,
        kept_together=kept_together(request.framework, profile),
        framework=request.framework,
    )


# --- enumeration ---------------------------------------------------------------------------------


@dataclass
class Enumeration:
    specs: SpecPool = field(default_factory=lambda: SpecPool.of([]))
    rejections: Rejections = field(default_factory=Rejections)
    shapes: int = 0


def enumerate_specs(
    profile: ModelProfile, hardware: Hardware, space: SearchSpace, max_devices: int, *, workers: int = 1
) -> Enumeration:
    """Every feasible spec with at most `max_devices` devices, and counted rejections.

    The work comes in (t, b) units that share nothing but read-only inputs: each has its own
    partitions, memory look-ups and rejections. With `workers` > 1 they are spread over that many
    processes (`pipectl.plan.workers`) and merged back in the order a single process visits them,
    so the result is the same whatever the number of workers.
    """
    units = [(t, b) for t in space.tensor_parallel for b in space.micro_batch_sizes]
    unprofiled = Rejections()
    for t in space.unprofiled_tensor_parallel:
        unprofiled.add(
            Rejection.TENSOR_PARALLEL_NOT_PROFILED,
            f"t={t}: the profile has shard costs for t = {', '.join(map(str, profile.shard_degrees()))} only",
        )
    builder = ShapeBuilder(profile, hardware, kept_together=space.kept_together)
    context = UnitContext(profile, hardware, space, max_devices)
    if sum(context.estimated_families(t) for t, _ in units) < PARALLEL_MIN_FAMILIES:
        workers = 1
    weights = [context.estimated_points(t, b) for t, b in units]  # the heaviest taken first
    shapes_elsewhere = 0
    tied_rows: dict[tuple, np.ndarray] = {}  # `point_bounds`' look-ups, kept across the units of a process

    def here(unit: tuple[int, int]) -> tuple[UnitResult, tuple[np.ndarray, ...]]:
        # Each unit's points get their columns where they were found (the bounds by numpy over
        # the points of one depth and bound at once): only those travel, not per-rank figures.
        result = context.enumerate_unit(builder, *unit)
        return result, _columns(result.accepted, hardware, profile.dtype, tied_rows)

    def elsewhere(unit: tuple[int, int]) -> tuple[PortableUnit, int, tuple[np.ndarray, ...]]:
        before = builder.shapes_built
        result, columns = here(unit)
        return result.portable(), builder.shapes_built - before, columns

    outcomes = share(units, weights, here, elsewhere, workers=workers)
    out = Enumeration()
    out.rejections.merge(unprofiled)
    # (shape, schedule, point); None for a point another process found until it is read.
    entries: list[tuple[Shape, ScheduleVariant, tuple[int, int, int, float, tuple[int, ...]]] | None] = []
    elsewhere_starts: list[int] = []  # where each unit found elsewhere starts among the entries
    found_elsewhere: list[PortableUnit] = []
    columns: list[tuple[np.ndarray, ...]] = []
    for outcome in outcomes:  # in the units' order, as one process visits them: the same first examples
        if outcome.local is not None:
            result, found = outcome.local
            entries += result.accepted
        else:
            result, built, found = outcome.remote
            shapes_elsewhere += built
            elsewhere_starts.append(len(entries))
            found_elsewhere.append(result)
            entries += [None] * len(result)
        out.rejections.merge(result.rejections)
        columns.append(found)
    bounds, devices, depths, zeros, deepspeed, torch = (
        [np.concatenate(column) for column in zip(*columns)] if columns else [np.zeros(0)] * 6
    )
    rebuilt: dict[tuple, Shape] = {}  # one shape per distinct cut, as the process that found them shared them

    def point_of(index: int) -> tuple[Shape, ScheduleVariant, tuple[int, int, int, float, tuple[int, ...]]]:
        entry = entries[index]
        if entry is None:  # found elsewhere: `shape_from_cuts` is the same arithmetic, so the same figures
            which = bisect_right(elsewhere_starts, index) - 1
            unit, row = found_elsewhere[which], index - elsewhere_starts[which]
            cut, variant = unit.pairs[unit.pair_of[row]]
            shape = rebuilt.get(cut)
            if shape is None:
                shape = rebuilt[cut] = builder.shape_from_cuts(*cut)
            point = context.point(shape, variant, int(unit.data_parallel[row]), int(unit.zero_stages[row]))
            entry = entries[index] = (shape, variant, point)
        return entry

    figures = spec_figures(point_of, hardware, profile.dtype)

    def spec(index: int) -> Spec:
        shape, variant, (d, m, zero, _, _) = point_of(index)
        return Spec(shape, d, m, variant, zero, float(bounds[index]), figures, index)

    out.specs = SpecPool.build(
        len(entries), spec, bounds=bounds, devices=devices, pipeline_parallel=depths, zero_stages=zeros,
        deepspeed=deepspeed, torch=torch,
    )
    out.shapes = builder.shapes_built + shapes_elsewhere
    return out


def _columns(
    accepted: list[tuple[Shape, ScheduleVariant, tuple[int, int, int, float, tuple[int, ...]]]],
    hardware: Hardware, dtype: str, tied_rows: dict[tuple, np.ndarray],
) -> tuple[np.ndarray, ...]:
    """What `SpecPool` reads of each accepted point: (lower bound, devices, p, ZeRO stage, whether
    DeepSpeed runs it, whether torch's pipelining runs it)."""
    # Which engines run a point depends on its shape, schedule, ZeRO stage and whether d = 1.
    known: dict[tuple[int, int, int, bool], tuple[bool, bool]] = {}
    runs = []
    for shape, variant, (d, _, zero, _, _) in accepted:
        key = (id(shape), id(variant), zero, d == 1)
        answer = known.get(key)
        if answer is None:
            answer = known[key] = engines_running(shape, variant, zero, d)
        runs.append(answer)
    return (
        point_bounds(accepted, hardware, dtype, tied_rows),
        np.array([shape.tensor_parallel * shape.pipeline_parallel * point[0] for shape, _, point in accepted], dtype=np.int64),
        np.array([shape.pipeline_parallel for shape, _, _ in accepted], dtype=np.int64),
        np.array([point[2] for _, _, point in accepted], dtype=np.int64),
        np.array([deepspeed for deepspeed, _ in runs], dtype=bool),
        np.array([torch for _, torch in runs], dtype=bool),
    )


# Below this many (t, b, recompute, p, schedule) families a search takes tens of milliseconds:
# not worth a process (starting one and sending its results back costs ~10 ms).
PARALLEL_MIN_FAMILIES = 3000
