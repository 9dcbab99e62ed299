"""A spec's figures without simulating it, computed for many specs at once (numpy over the points
of one shape): the data-parallel and optimizer seconds per rank (as `plan.cost_table` prices them
for one candidate), the tied embedding's all-reduce, the memory per parameter and ZeRO-2/3's
transient tensors (`plan.memory`'s arithmetic, cached per dtype, stage and schedule), the peak
micro-batches in flight, and the specs themselves with their lower bounds (`candidates.Spec`)."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence, TypeVar

import numpy as np

from pipectl.artifacts.plan import Recompute
from pipectl.catalog import DTYPE_BYTES
from pipectl.plan.cost_table import adam_seconds_per_parameter, data_parallel_seconds, gradient_bytes, sharded_data_parallel_seconds, zero3_prefetch_shares
from pipectl.plan.costs import Hardware, collective_handoff_seconds, host_compute_slowdown
from pipectl.plan.placement import ranks_share_node, replicas_share_node
from pipectl.plan.fast.bounds import chain_bound_seconds, two_bw_bound_seconds, zero_bubble_bound_seconds
from pipectl.plan.memory import in_flight_units, peak_bytes, sharded_transient_bytes, stage_holding, state_bytes_per_parameter, state_dtype, step_bytes_per_parameter, weight_versions
from pipectl.schedule import ScheduleKind
from pipectl.plan.candidates import ScheduleVariant, Shape, Spec, SpecFigures, read_only, chains, recomputing_stages

T = TypeVar("T")


def data_parallel_costs(
    shape: Shape, hardware: Hardware, data_parallel: int, zero_stage: int, dtype: str, micro_batches: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(all-reduce, optimizer) seconds per rank, as `cost_table.stage_costs` computes them.

    With measured engine terms (a profile calibrated on this device) it is `cost_table`'s own
    `data_parallel_seconds`; without them, the same ring formula vectorised over ranks (the
    search at scale runs it for every candidate). ZeRO-2/3 (p = 1): `cost_table.sharded_data_parallel_seconds`,
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
        # Measured engine terms, or another engine's overlap: `cost_table`'s own formula, rank by rank,
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
        allreduce_measured = np.array(allreduce_list) + tied_seconds(shape, hardware, d, element)
        return allreduce_measured, np.array(optimizer_list) * slowdown
    allreduce = np.zeros(p)
    if d > 1:
        # LinkCost.ring_allreduce_seconds (Patarasuk & Yuan 2009) on every rank at once, the same
        # operations in the same order: 2(d-1) * (latency + bytes / d / bandwidth).
        inside = np.array(_replicas_inside(p, t, d, n)) & (not hardware.replicas_span_nodes)
        message = held * _ring_bytes(hardware, element, zero_stage >= 1)
        steps = 2 * (d - 1)
        for ring, where in ((links.allreduce_intra, inside), (links.allreduce_inter, ~inside)):
            seconds = steps * (ring.latency_seconds + message / d / ring.bandwidth_bytes_per_second)
            allreduce = np.where(where, seconds, allreduce)
    allreduce += tied_seconds(shape, hardware, d, element)
    updated = held / d if zero_stage >= 1 else held
    return allreduce, updated * adam_seconds_per_parameter(hardware)


def _sharded_costs(
    shape: Shape, hardware: Hardware, d: int, zero_stage: int, micro_batches: int, element: int
) -> tuple[np.ndarray, np.ndarray]:
    """ZeRO-2/3's (communication, optimizer) seconds of a one-stage shape, as `cost_table.stage_costs`
    computes them (`cost_table.sharded_data_parallel_seconds`, the optimizer x the host's slowdown)."""
    t = shape.tensor_parallel
    slowdown = host_compute_slowdown(hardware, t * shape.pipeline_parallel * d)
    communication, optimizer = sharded_data_parallel_seconds(
        shape.table, shape.seconds, hardware, pipeline_parallel=shape.pipeline_parallel, tensor_parallel=t,
        data_parallel=d, zero_stage=zero_stage, micro_batches=micro_batches, element_bytes=element, slowdown=slowdown,
        checkpoint_layers=shape.recompute is Recompute.LAYER,
    )  # fmt: skip
    return np.array(communication), np.array(optimizer) * slowdown


@lru_cache(maxsize=65536)
def _replicas_inside(p: int, t: int, d: int, devices_per_node: int) -> tuple[bool, ...]:
    """Per pipeline rank: whether its d replicas share a node (`placement.replicas_share_node`)."""
    return tuple(replicas_share_node(rank, p, t, d, devices_per_node) for rank in range(p))


def _ring_bytes(hardware: Hardware, element: int, sharded):
    """Bytes per parameter of the ring that `cost_table.data_parallel_seconds` times at the end of a
    step: the gradient's all-reduce (ZeRO-0), or its reduce-scatter and the parameters' all-gather,
    half a ring each (ZeRO-1, `sharded`: a bool or a column of them); `element` unless the engine
    reduces gradients in fp32 (`cost_table.gradient_bytes`)."""
    gradient = gradient_bytes(hardware, element)
    if gradient == element:
        return element
    return np.where(sharded, (gradient + element) / 2, gradient)


def tied_seconds(shape: Shape, hardware: Hardware, d: int, element: int) -> np.ndarray:
    return _tied_seconds_of(
        _tied_groups(shape), shape.pipeline_parallel, shape.tensor_parallel, d, hardware, element,
        shape.table.divisor(shape.tensor_parallel),
    )


def _work_per_rank(shape: Shape, kind: ScheduleKind) -> np.ndarray:
    """`shape.work_per_rank(recomputing_stages(shape, kind))`, once per shape and recomputation."""
    key = ("work", shape.recompute is Recompute.STAGE or kind is ScheduleKind.VARUNA)  # what `recomputing_stages` reads
    work = shape._derived.get(key)
    if work is None:
        (work,) = read_only(shape.work_per_rank(recomputing_stages(shape, kind)))
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
    """Per rank: the all-reduce of the shared groups it holds (`cost_table.stage_costs`' tied term);
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
    one at a time, `cost_table.zero3_prefetch_shares`: a large block's linears); 0 for stages 0 and 1."""
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
    """The specs of (shape, schedule, (d, m, ZeRO stage, state bytes per parameter, in-flight units)), in order,
    as a list (the search itself keeps them as columns: `plan.space.enumerate_specs`).

    Each gets its lower bound (`point_bounds`) and the per-rank figures that `data_parallel_costs`
    and `StageMemory.per_rank_bytes` give it alone, computed on first read (`spec_figures`).

        >>> from pipectl.testing.profiles import synthetic_profile
        >>> from pipectl.cluster import local_cluster
        >>> from pipectl.plan.costs import hardware_for
        >>> from pipectl.plan.candidates import ShapeBuilder
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
    bounds = point_bounds(points, hardware, dtype).tolist()
    figures = spec_figures(points.__getitem__, hardware, dtype)
    return [
        Spec(shape, d, m, variant, zero, bound, figures, i)
        for i, ((shape, variant, (d, m, zero, _, _)), bound) in enumerate(zip(points, bounds))
    ]


def spec_figures(
    point_of: Callable[[int], tuple[Shape, ScheduleVariant, tuple[int, int, int, float, tuple[int, ...]]]],
    hardware: Hardware,
    dtype: str,
) -> SpecFigures:
    """The per-rank figures of the specs whose points `point_of(row)` gives, each row computed on
    first read by the same element-wise code as for many rows (`point_bounds`), so the same values."""
    tied_rows: dict[tuple, np.ndarray] = {}

    def row(index: int) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
        shape, variant, point = point_of(index)
        peak, allreduce, optimizer, _ = _figures_of_one_depth([shape], [variant], [point], hardware, dtype, tied_rows)
        return tuple(peak[0].tolist()), tuple(allreduce[0].tolist()), tuple(optimizer[0].tolist())

    return SpecFigures(row)


def point_bounds(
    points: Sequence[tuple[Shape, ScheduleVariant, tuple[int, int, int, float, tuple[int, ...]]]],
    hardware: Hardware,
    dtype: str,
    tied_rows: dict[tuple, np.ndarray] | None = None,
) -> np.ndarray:
    """The lower bound of each point (as `specs_from_points` takes them; an array), computed for
    every point of the same pipeline depth and bound (`_bound_family`) at once: one row per point,
    the same float64 operations in the same order on every element (a row's maximum does not
    depend on the order), so the same values however the points are grouped. One call per point
    would spend most of its time in numpy's per-call overhead."""
    groups: dict[tuple[int, str], list[tuple]] = {}
    positions: dict[tuple[int, str], list[int]] = {}
    family_of = {variant: _bound_family(variant.kind) for variant in {variant for _, variant, _ in points}}
    for index, entry in enumerate(points):
        key = (entry[0].pipeline_parallel, family_of[entry[1]])
        group = groups.get(key)
        if group is None:
            group = groups[key] = []
            positions[key] = []
        group.append(entry)
        positions[key].append(index)
    bounds = np.empty(len(points))
    # The tied all-reduce only depends on these figures: (holding ranks and sizes, p, t, d) -> row.
    tied_rows = {} if tied_rows is None else tied_rows
    for key, group in groups.items():
        shapes, variants, found = zip(*group)
        bounds[positions[key]] = _figures_of_one_depth(
            list(shapes), variants, list(found), hardware, dtype, tied_rows, peaks=False
        )[3]
    return bounds


def _bound_family(kind: ScheduleKind) -> str:
    """Which lower bound prices a schedule (`pipectl.plan.fast.bounds`): points of one family and
    depth are bounded together."""
    if kind is ScheduleKind.PIPEDREAM_2BW:
        return "2bw"
    return "zero-bubble" if kind.splits_backward else "chains"


def _figures_of_one_depth(
    shapes: list[Shape], variants: Sequence[ScheduleVariant], points: list[tuple[int, int, int, float, tuple[int, ...]]],
    hardware: Hardware, dtype: str, tied_rows: dict[tuple, np.ndarray], *, peaks: bool = True,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
    """(peak reserved bytes, all-reduce seconds, optimizer seconds) per rank, one row per point,
    and each point's lower bound, for points whose shapes all have the same p (rows of equal
    width) and whose schedules (`variants`, one per point) the same bound prices (`_bound_family`);
    the peaks only when asked (None otherwise)."""
    unique, rows = _distinct(shapes)
    row_of = np.array(rows)
    kind = variants[0].kind  # the bound's family
    # Per shape (one row each), then one row per point by look-up; the work per rank per shape and
    # whether the schedule recomputes whole stages (what `_work_per_rank` reads of it).
    parameters = np.array([shape.memory.parameters for shape in unique])[row_of]
    works: dict[tuple[int, bool], int] = {}
    work_rows: list[np.ndarray] = []
    work_of = []
    for shape_row, shape, variant in zip(rows, shapes, variants):
        key = (shape_row, variant.kind is ScheduleKind.VARUNA)
        row = works.get(key)
        if row is None:
            row = works[key] = len(work_rows)
            work_rows.append(_work_per_rank(shape, variant.kind))
        work_of.append(row)
    work = np.array(work_rows)[work_of]
    shape_chains = [chains(shape) for shape in unique]
    forward_chain = np.array([forward for forward, _ in shape_chains])[row_of]
    backward_chain = np.array([backward for _, backward in shape_chains])[row_of]

    degrees = np.array([point[:3] for point in points], dtype=np.int64)  # (d, m, ZeRO stage) per point
    ds, micro_batches, sharded = degrees[:, 0:1], degrees[:, 1:2], degrees[:, 2:3] >= 1
    held = state_dtype(dtype, hardware.features)  # the model state's bytes; `dtype` the collectives'
    # ZeRO-2/3 points (p = 1 only): their whole tensors on top, and their own communication below.
    gradients_sharded = [i for i, point in enumerate(points) if point[2] >= 2]
    peak = None
    if peaks:
        unit_bytes = np.array([shape.memory.unit_bytes for shape in unique])[row_of]
        buffer_bytes = np.array([shape.memory.recompute_buffer_bytes for shape in unique])[row_of]
        working_bytes = np.array([shape.memory.working_bytes for shape in unique])[row_of]
        per_device = np.array([point[3] for point in points], dtype=float)[:, None]
        units = rows_array([point[4] for point in points])
        per_step = np.array(
            [step_bytes(held, zero, d, variant.kind) for variant, (d, _, zero, _, _) in zip(variants, points)], dtype=float
        )[:, None]
        transient: np.ndarray | float = 0.0
        if gradients_sharded:
            transient = np.array(
                [transient_bytes(shape, held, zero, d) for shape, (d, _, zero, _, _) in zip(shapes, points)]
            )[:, None]
        # `StageMemory.per_rank_bytes`, one row per point; reported as the allocator's reserve
        # (int64: truncation, as int() does).
        allocated = peak_bytes(parameters, unit_bytes, buffer_bytes, working_bytes, per_device, per_step, units, transient)
        peak = hardware.memory_budget.reserved(allocated).astype(np.int64)
    overlapped = hardware.features is not None and hardware.features.gradient_reduce_overlap
    if hardware.runtime is not None or overlapped:  # rank by rank (measured terms; another engine's overlap)
        costs = [
            data_parallel_costs(shape, hardware, d, zero, dtype, m) for shape, (d, m, zero, _, _) in zip(shapes, points)
        ]
        allreduce = np.array([row for row, _ in costs])
        optimizer = np.array([row for _, row in costs])
    else:
        allreduce, optimizer = _data_parallel_costs_over(
            unique, row_of, parameters, ds, sharded, hardware, dtype, tied_rows
        )
        for i in gradients_sharded:
            d, m, zero, _, _ = points[i]
            allreduce[i], optimizer[i] = data_parallel_costs(shapes[i], hardware, d, zero, dtype, m)
    if kind is ScheduleKind.PIPEDREAM_2BW:  # priced per update in steady state
        bounds = two_bw_bound_seconds(work, micro_batches, allreduce, optimizer)
    elif kind.splits_backward:  # a rank's last W's have no B-chain after them
        bounds = zero_bubble_bound_seconds(forward_chain, work, micro_batches, allreduce, optimizer)
    else:
        bounds = chain_bound_seconds(forward_chain, backward_chain, work, micro_batches, allreduce, optimizer)
    return peak, allreduce, optimizer, bounds


def rows_array(rows: Sequence[tuple[int, ...]]) -> np.ndarray:
    """An int64 array of equal-length tuples, one row each. A search's rows repeat (the in-flight
    units of one (schedule, p, m)): each tuple object is converted once, then indexed."""
    if not rows:
        return np.zeros((0, 0), dtype=np.int64)
    # By identity: the repeated tuples are one object (`memory.in_flight_units` is cached), and
    # hashing a tuple of p integers per row would cost more than converting it.
    distinct, positions = _distinct(rows)
    return np.array(distinct, dtype=np.int64)[positions]


def _distinct(items: Sequence[T]) -> tuple[list[T], list[int]]:
    """The distinct objects among `items` by identity, in the order first met, and the position of
    each item among them (every item stays alive meanwhile, so no identity is reused)."""
    index: dict[int, int] = {}
    distinct: list[T] = []
    positions = []
    for item in items:
        position = index.get(id(item))
        if position is None:
            position = index[id(item)] = len(distinct)
            distinct.append(item)
        positions.append(position)
    return distinct, positions


def _data_parallel_costs_over(
    unique: list[Shape], row_of: np.ndarray, held: np.ndarray, ds: np.ndarray, sharded: np.ndarray,
    hardware: Hardware, dtype: str, tied_rows: dict[tuple, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """`data_parallel_costs` without measured engine terms, one row per point: its shape
    `unique[row_of[i]]`, its parameters per rank `held`, its d in `ds`, whether ZeRO shards the
    optimizer in `sharded`."""
    p = held.shape[1]
    n = hardware.devices_per_node
    element = DTYPE_BYTES.get(dtype, 4)
    links = hardware.links
    # `placement.replicas_share_node` for every rank of every point: rank k's first replica sits on
    # device k*t, its last on ((d-1)*p + k)*t; integer arithmetic, so the same answers.
    ranks = np.arange(p)
    t = np.array([shape.tensor_parallel for shape in unique], dtype=np.int64)[row_of][:, None]
    inside = ((ranks * t) // n == (((ds - 1) * p + ranks) * t) // n) & (not hardware.replicas_span_nodes)
    message = held * _ring_bytes(hardware, element, sharded)
    steps = 2 * (ds - 1)  # d = 1 rows: 0 steps, so 0.0 on every rank, as the unreplicated case's zeros
    # Each element through its own ring's formula, steps * (latency + bytes / d / bandwidth): the
    # ring's figures picked first, then one pass (the same operations as per ring, so the same values).
    intra, inter = links.allreduce_intra, links.allreduce_inter
    latency = np.where(inside, intra.latency_seconds, inter.latency_seconds)
    bandwidth = np.where(inside, intra.bandwidth_bytes_per_second, inter.bandwidth_bytes_per_second)
    allreduce = steps * (latency + message / ds / bandwidth)
    # The tied all-reduce per distinct (shape, d) of the points (the groups are only hashed then).
    tied = []
    known: dict[tuple[int, int], np.ndarray] = {}
    for shape_row, d in zip(row_of.tolist(), ds[:, 0].tolist()):
        row = known.get((shape_row, d))
        if row is None:
            shape = unique[shape_row]
            groups, t_shape = _tied_groups(shape), shape.tensor_parallel
            divisor = shape.table.divisor(t_shape)
            key = (groups, p, t_shape, d, divisor)
            row = tied_rows.get(key)
            if row is None:
                row = tied_rows[key] = _tied_seconds_of(groups, p, t_shape, d, hardware, element, divisor)
            known[(shape_row, d)] = row
        tied.append(row)
    allreduce += np.array(tied)
    updated = held / np.where(sharded, ds, 1)
    return allreduce, updated * adam_seconds_per_parameter(hardware)
