"""Memory per device of a pipeline stage: model state, the activations its schedule keeps, the
working memory of its largest layer, and the optimizer step's peak.

A rank's peak is the larger of two moments (docs/design.md, 'Memory model', which derives every
term below with its source):

    training:  parameters x state bytes + in-flight activations + recompute buffer + working memory
               (+ ZeRO-2/3's transient whole tensors)
    step:      parameters x step bytes (activations are freed; the fp32 gradient copy and Adam's
               temporaries are not)

- Model state per parameter by precision and ZeRO stage (Rajbhandari et al. 2020, §5.1-5.3):
  `state_bytes_per_parameter`, `step_bytes_per_parameter`; ZeRO-2/3's whole tensors:
  `sharded_transient_bytes`. PipeDream-2BW keeps a second copy of the weights (Narayanan et al.
  2021, §3.1): `weight_versions`.
- Micro-batches in flight per stage, a property of the schedule: `in_flight_units` (closed forms
  per schedule), `peak_in_flight_units` (counted on a generated schedule; tests hold one to the other).
- What an in-flight micro-batch keeps, by recomputation (none, whole stage, per layer, selective;
  Korthikanti et al. 2022, §2, §5 and Table 2), and the buffer a recomputation needs: `StageMemory`.
- What one tensor rank holds: a profile's shard figures where it has them (the LayerNorms' inputs
  and the block's input stay whole, Korthikanti et al. 2022, §4.1), else every layer divided by t
  (`LayerTable.divisor`, an under-estimate); the stage input and working memory are never divided.
- The partitioner asks the same questions per layer range, millions of times: `RangeMemory` and
  `FurthestFittingEnds` evaluate the same expressions from precomputed rows.

    >>> from pipectl.testing.profiles import synthetic_profile
    >>> from pipectl.plan.layer_table import layer_table
    >>> table = layer_table(synthetic_profile(blocks=4, micro_batch_sizes=[1]), 1)
    >>> stages = StageMemory.build(table, [(0, 3), (3, 7)], tensor_parallel=1, recompute=False)
    >>> units = in_flight_units(ScheduleKind.ONE_F_ONE_B, 2, 4)
    >>> units
    (2, 1)
    >>> held, step = state_bytes_per_parameter("bfloat16", 0, 1), step_bytes_per_parameter("bfloat16", 0, 1)
    >>> estimate = stages.estimate(held, step, units, capacity_bytes=10**9)
    >>> training, step = 16 * table.parameters(0, 3) + 2 * table.saved(0, 3), 24 * table.parameters(0, 3)
    >>> estimate.feasible, estimate.per_rank_bytes[0] == max(training, step)
    (True, True)
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from pipectl.artifacts.plan import Recompute
from pipectl.artifacts.profile import ModelProfile
from pipectl.plan.layer_table import LayerTable
from pipectl.plan.memory_ranges import RangeMemory
from pipectl.schedule.ir import ActionKind, Schedule, ScheduleKind, stage_ranks

GIB = 1024**3

# Bytes per parameter: (weights, gradients, optimizer state, optimizer step's extra). Rajbhandari et al. 2020, §5.1; the
# step's extra (fp32 gradient copy + Adam's temporaries; 16-bit training) from allocator peaks read on
# a GPU (docs/design.md, 'Memory model'). fp32 training has no gradient copy to make: Adam's temporaries only.
FP32_GRADIENTS = "+fp32-gradients"
_STATE_BYTES = {
    "bfloat16": (2.0, 2.0, 12.0, 8.0),
    "float16": (2.0, 2.0, 12.0, 8.0),
    "float32": (4.0, 4.0, 8.0, 4.0),
    "bfloat16" + FP32_GRADIENTS: (2.0, 4.0, 12.0, 4.0),
    "float16" + FP32_GRADIENTS: (2.0, 4.0, 12.0, 4.0),
}


def state_dtype(dtype: str, features) -> str:
    """The key the model-state functions below read for a training dtype: the dtype itself, or, for
    16-bit weights whose gradients the engine keeps and reduces in fp32 (`features`, the profile's
    `EngineFeatures`: gradients_reduced_in_fp32; Megatron's fp32 gradient buffers), the dtype with
    `FP32_GRADIENTS`: 4 bytes of gradient a parameter, and no fp32 copy of them at the step.

    >>> state_dtype("bfloat16", None), state_bytes_per_parameter(state_dtype("bfloat16", None), 1, 4)
    ('bfloat16', 7.0)
    """
    if features is not None and features.gradients_reduced_in_fp32 and dtype + FP32_GRADIENTS in _STATE_BYTES:
        return dtype + FP32_GRADIENTS
    return dtype


def _sharded(weights: float, gradients: float, optimizer: float, zero_stage: int, data_parallel: int) -> float:
    """weights + gradients + optimizer bytes per parameter, each divided by d where the stage shards it."""
    d = data_parallel
    if zero_stage >= 1:
        optimizer /= d
    if zero_stage >= 2:
        gradients /= d
    if zero_stage >= 3:
        weights /= d
    return weights + gradients + optimizer


def state_bytes_per_parameter(dtype: str, zero_stage: int, data_parallel: int, weight_versions: int = 1) -> float:
    """Bytes of model state per parameter held on a device (docs/design.md, 'Memory model').

    >>> state_bytes_per_parameter("bfloat16", 0, 8)
    16.0
    >>> state_bytes_per_parameter("bfloat16", 1, 4)  # 2 + 2 + 12/4
    7.0
    >>> state_bytes_per_parameter("float32", 0, 1, weight_versions=2)  # 2BW: a second weight copy
    20.0
    >>> state_bytes_per_parameter("bfloat16", 2, 4)  # 2 + (2 + 12)/4
    5.5
    >>> state_bytes_per_parameter("bfloat16", 3, 4)  # (2 + 2 + 12)/4
    4.0
    """
    weights, gradients, optimizer, _ = _STATE_BYTES.get(dtype, _STATE_BYTES["float32"])
    return _sharded(weights * weight_versions, gradients, optimizer, zero_stage, data_parallel)


def step_bytes_per_parameter(dtype: str, zero_stage: int, data_parallel: int, weight_versions: int = 1) -> float:
    """Bytes per parameter at the optimizer step's peak: the held state plus the step's fp32
    gradient copy and Adam's temporaries, sharded with the optimizer state from ZeRO-1 on.

    >>> step_bytes_per_parameter("bfloat16", 0, 8)  # 22-24 measured at the step on a GPU
    24.0
    >>> step_bytes_per_parameter("bfloat16", 1, 4)  # 2 + 2 + (12 + 8)/4
    9.0
    >>> step_bytes_per_parameter("float32", 0, 1)
    20.0
    >>> step_bytes_per_parameter("bfloat16", 2, 4)  # 2 + (2 + 12 + 8)/4
    7.5
    >>> step_bytes_per_parameter("bfloat16", 3, 4)  # (2 + 2 + 12 + 8)/4
    6.0
    """
    weights, gradients, optimizer, step = _STATE_BYTES.get(dtype, _STATE_BYTES["float32"])
    return _sharded(weights * weight_versions, gradients, optimizer + step, zero_stage, data_parallel)


def sharded_transient_bytes(layer_parameters: Sequence[float], dtype: str, zero_stage: int, data_parallel: int) -> float:
    """Bytes ZeRO-2/3 hold whole for a while during a micro-batch, on top of the sharded state
    (docs/design.md, 'Memory model'); 0 for stages 0 and 1 and at d = 1 (nothing is sharded then).
    `layer_parameters`: each layer's parameters on the rank (after the tensor split), in order.

    >>> sharded_transient_bytes([10, 40, 40, 30], "bfloat16", 2, 4)  # g x 40
    80.0
    >>> sharded_transient_bytes([10, 40, 40, 30], "bfloat16", 3, 4)  # w x (40 + 40) + g x 40
    240.0
    >>> sharded_transient_bytes([10, 40, 40, 30], "bfloat16", 3, 1), sharded_transient_bytes([10], "float32", 1, 8)
    (0.0, 0.0)
    """
    if zero_stage < 2 or data_parallel <= 1 or not layer_parameters:
        return 0.0
    weights, gradients, _, _ = _STATE_BYTES.get(dtype, _STATE_BYTES["float32"])
    largest = float(max(layer_parameters))
    if zero_stage == 2:
        return gradients * largest
    pairs = [float(a) + float(b) for a, b in zip(layer_parameters, layer_parameters[1:])] or [largest]
    return weights * max(pairs) + gradients * largest


def weight_versions(kind: ScheduleKind) -> int:
    """PipeDream-2BW stashes two weight versions; every other schedule one."""
    return 2 if kind is ScheduleKind.PIPEDREAM_2BW else 1


@lru_cache(maxsize=65536)
def in_flight_units(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int = 1) -> tuple[int, ...]:
    """Peak chunk-micro-batches with activations held, per rank, by the closed forms above (cached).

    >>> in_flight_units(ScheduleKind.GPIPE, 3, 5)
    (5, 5, 5)
    >>> in_flight_units(ScheduleKind.ONE_F_ONE_B, 4, 2)
    (2, 2, 2, 1)
    >>> in_flight_units(ScheduleKind.INTERLEAVED, 2, 4, 2)
    (5, 3)
    >>> in_flight_units(ScheduleKind.PIPEDREAM_2BW, 4, 3)  # no flush: p - k whatever m
    (4, 3, 2, 1)
    >>> in_flight_units(ScheduleKind.ZB_H1, 4, 8)  # held until W: 1F1B's stage-0 peak on every stage
    (4, 4, 4, 4)
    >>> in_flight_units(ScheduleKind.ZBV, 4, 8, 2)  # 2p half-size chunks: p full stages, as 1F1B's stage 0
    (8, 8, 8, 8)
    """
    p, m, v = pipeline_parallel, micro_batches, chunks
    if kind is ScheduleKind.GPIPE:
        return (m,) * p
    if kind is ScheduleKind.ZB_H1:
        return (min(p, m),) * p
    if kind is ScheduleKind.ZBV:
        return (2 * p,) * p
    if kind is ScheduleKind.PIPEDREAM_2BW:
        return tuple(range(p, 0, -1))
    if kind is ScheduleKind.VARUNA:
        # min(3 (p - 1 - k), m) for k < p - 1: m while 3 (p - 1 - k) >= m, then 3 (p - 1 - k)
        # stepping down by 3; as ranges (the search asks this for ~10^4 (p, m) pairs).
        below = min(p - 1, -(-m // 3) - 1)  # the largest p - 1 - k with 3 (p - 1 - k) < m
        return (m,) * (p - 1 - below) + tuple(range(3 * below, 0, -3)) + (1,)
    if kind is ScheduleKind.INTERLEAVED and v > 1:
        if m == p:
            return (m * v,) * p
        return tuple(min(2 * (p - k - 1) + (v - 1) * p + 1, m * v) for k in range(p))
    # min(p - k, m): m on the first p - m + 1 stages (when m < p), then p - k (a range: the
    # search asks this for ~10^4 (p, m) pairs).
    if m >= p:
        return tuple(range(p, 0, -1))
    return (m,) * (p - m + 1) + tuple(range(m - 1, 0, -1))


def peak_in_flight_units(schedule: Schedule) -> tuple[int, ...]:
    """Per rank: the most chunk-micro-batches forwarded but not yet backwarded at any point (a split
    backward: not yet through its W)."""
    peaks = []
    for rank in range(schedule.pipeline_parallel):
        live = peak = 0
        for action in schedule.actions[rank]:
            if action.kind is ActionKind.FORWARD:
                live += 1
                peak = max(peak, live)
            elif action.kind is ActionKind.BACKWARD or action.kind is ActionKind.BACKWARD_WEIGHT:
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


def format_gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryBudget:
    """What one device offers a rank's tensors, and how predicted bytes compare with a measurement.

    The planner adds up what a rank's tensors need (allocated bytes). PyTorch's caching allocator
    reserves more than it hands out (`allocator_overhead`: reserved / allocated - 1 at the peak),
    and the CUDA context, NCCL's and cuBLAS's buffers sit outside it (`outside_allocator_bytes`).
    The user may keep a fraction of the device free (`headroom`). So a rank fits when

        allocated x (1 + allocator_overhead) <= device x (1 - headroom) - outside_allocator_bytes

    and the predicted peak reported (plan.json's `peak_memory_bytes`) is the left side, what
    `torch.cuda.max_memory_reserved` measures.

        >>> budget = MemoryBudget(80 * GIB, outside_allocator_bytes=GIB, allocator_overhead=0.25, headroom=0.05)
        >>> budget.usable_bytes / GIB, budget.allocatable_bytes / GIB, budget.reserved(4 * GIB) / GIB
        (75.0, 60.0, 5.0)
    """

    device_bytes: int
    outside_allocator_bytes: int = 0
    allocator_overhead: float = 0.0
    headroom: float = 0.0

    @property
    def usable_bytes(self) -> float:
        return self.device_bytes * (1.0 - self.headroom) - self.outside_allocator_bytes

    @property
    def allocatable_bytes(self) -> float:
        """What the rank's tensors may add up to (the planner's capacity)."""
        return self.usable_bytes / (1.0 + self.allocator_overhead)

    def reserved(self, allocated_bytes: float) -> float:
        """The allocator's reserve for `allocated_bytes` of tensors: the figure reported."""
        return allocated_bytes * (1.0 + self.allocator_overhead)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per rank (device) and whether every rank fits; `reason` says which does not.

    Bytes are as allocated, against the allocatable capacity; `reserved_per_allocated` turns both
    into what the message reports (the allocator's reserve against the device's usable bytes).
    """

    per_rank_bytes: tuple[int, ...]
    capacity_bytes: int
    reserved_per_allocated: float = 1.0

    @property
    def feasible(self) -> bool:
        return max(self.per_rank_bytes) <= self.capacity_bytes

    @property
    def worst_rank(self) -> int:
        return int(np.argmax(self.per_rank_bytes))

    @property
    def reason(self) -> str | None:
        """E.g. "stage 0 needs 21.3 GiB > 16.0 GiB"; None when everything fits."""
        if self.feasible:
            return None
        worst = self.worst_rank
        scale = self.reserved_per_allocated
        return (
            f"stage {worst} needs {format_gib(self.per_rank_bytes[worst] * scale)} > "
            f"{format_gib(self.capacity_bytes * scale)}"
        )


@dataclass(frozen=True)
class StageMemory:
    """What one partition keeps per rank, independent of d, ZeRO and the schedule's counts.

    `parameters[k]`: parameters on rank k's devices (after the tensor-parallel split);
    `unit_bytes[k]`: bytes one in-flight chunk-micro-batch keeps (full; input only when
    recomputing the stage; its layers' inputs when checkpointing layers);
    `recompute_buffer_bytes[k]`: what recomputing holds for one chunk (the stage's full activations,
    or its largest layer's when checkpointing layers);
    `working_bytes[k]`: the largest working memory of its layers.
    """

    parameters: np.ndarray
    unit_bytes: np.ndarray
    recompute_buffer_bytes: np.ndarray
    working_bytes: np.ndarray

    @classmethod
    def build(
        cls,
        table: LayerTable,
        stage_layers: Sequence[tuple[int, int]],
        *,
        tensor_parallel: int,
        recompute: Recompute | bool,
        pipeline_parallel: int | None = None,
        rows: RangeMemory | None = None,
        bounds: np.ndarray | None = None,
        v_placement: bool = False,
    ) -> "StageMemory":
        """Per-rank figures; virtual stage s (of p*v) lives on rank s % p, or as a V with
        `v_placement` (`pipectl.schedule.ir.stage_rank`: rank k holds stages k and 2p - 1 - k).

        `rows` (the same table's `RangeMemory` at this t) reads every stage from it at once unless
        a rank holds two layers of one shared group; `bounds` is `stage_layers` as a (stages, 2)
        integer array when the caller has one. `recompute`: a `Recompute` (False and True read as
        NONE and STAGE).
        """
        recompute = Recompute(recompute)
        p = pipeline_parallel or len(stage_layers)
        last = len(stage_layers) - 1
        divisor = table.divisor(tensor_parallel)  # t for whole layers, 1 for one tensor rank's figures
        ranks = stage_ranks(len(stage_layers), p, v_placement)
        if rows is not None and len(stage_layers) % p == 0 and _no_shared_group_twice_per_rank(table, stage_layers, ranks):
            # Every chunk at once: the same figures as the loop below. Parameter counts are whole
            # numbers below 2**53 in float64, so their sums, and the sums over t, are exact.
            if bounds is None:
                bounds = np.array(stage_layers, dtype=np.intp)
            starts, ends = bounds[:, 0], bounds[:, 1]
            prefix = rows.parameter_prefix
            parameters = by_rank(prefix[ends] - prefix[starts], p, v_placement).sum(axis=0) / divisor
            full = rows.saved_matrix[starts, ends]
            if recompute is Recompute.LAYER:
                unit = by_rank(rows.layer_input_matrix[starts, ends], p, v_placement).max(axis=0)
                buffer = by_rank(rows.largest_saved_matrix[starts, ends], p, v_placement).max(axis=0)
            elif recompute is Recompute.SELECTIVE:
                unit = by_rank(rows.selective_saved_matrix[starts, ends], p, v_placement).max(axis=0)
                buffer = by_rank(rows.largest_core_matrix[starts, ends], p, v_placement).max(axis=0)
            else:
                recomputes = (
                    np.arange(last + 1) != last if recompute is Recompute.STAGE else np.zeros(last + 1, dtype=bool)
                )
                unit = by_rank(np.where(recomputes, rows.input_array[starts], full), p, v_placement).max(axis=0)
                buffer = by_rank(np.where(recomputes, full, 0.0), p, v_placement).max(axis=0)
            working = by_rank(rows.working_matrix[starts, ends], p, v_placement).max(axis=0)
            return cls(parameters, unit, buffer, working)
        chunks_of = chunks_by_rank(stage_layers, ranks, p)
        parameters = np.zeros(p)
        unit = np.zeros(p)
        buffer = np.zeros(p)
        working = np.zeros(p)
        for rank, chunks in enumerate(chunks_of):
            parameters[rank] = parameters_on_rank(table, chunks) / divisor
            for stage, start, end in chunks:
                full = table.saved(start, end) / divisor
                if recompute is Recompute.LAYER:
                    unit[rank] = max(unit[rank], table.layer_inputs(start, end, divisor))
                    buffer[rank] = max(buffer[rank], table.largest_saved(start, end) / divisor)
                    working[rank] = max(working[rank], table.working(start, end))
                    continue
                if recompute is Recompute.SELECTIVE:
                    unit[rank] = max(unit[rank], table.selective_saved(start, end, divisor))
                    buffer[rank] = max(buffer[rank], table.largest_attention_core(start, end) / divisor)
                    working[rank] = max(working[rank], table.working(start, end))
                    continue
                recomputes = recompute is Recompute.STAGE and stage != last
                per_unit = table.input_activation_bytes(start) if recomputes else full
                unit[rank] = max(unit[rank], per_unit)
                if recomputes:
                    buffer[rank] = max(buffer[rank], full)
                working[rank] = max(working[rank], table.working(start, end))
        return cls(parameters, unit, buffer, working)

    def per_rank_bytes(self, state_bytes, step_bytes, units, transient_bytes=0.0) -> np.ndarray:
        """Peak allocated bytes per rank (`peak_bytes`). Scalars give one row; a column of bytes per
        parameter with a row of units per rank for each gives one row per demand.
        `transient_bytes`: ZeRO-2/3's whole tensors (`sharded_transient_bytes`), training only."""
        return peak_bytes(
            self.parameters, self.unit_bytes, self.recompute_buffer_bytes, self.working_bytes,
            state_bytes, step_bytes, np.asarray(units), transient_bytes,
        )

    def estimate(
        self, state_bytes: float, step_bytes: float, units: Sequence[int], capacity_bytes: float,
        reserved_per_allocated: float = 1.0, transient_bytes: float = 0.0,
    ) -> MemoryEstimate:
        per_rank = self.per_rank_bytes(state_bytes, step_bytes, units, transient_bytes)
        return MemoryEstimate(tuple(int(x) for x in np.ceil(per_rank)), int(capacity_bytes), reserved_per_allocated)

    def fits(
        self, state_bytes: float, step_bytes: float, units: Sequence[int], capacity_bytes: float,
        transient_bytes: float = 0.0,
    ) -> bool:
        return bool((self.per_rank_bytes(state_bytes, step_bytes, units, transient_bytes) <= capacity_bytes).all())


def peak_bytes(
    parameters, unit_bytes, buffer_bytes, working_bytes, state_bytes, step_bytes, units, transient_bytes=0.0
) -> np.ndarray:
    """Peak allocated bytes of ranks, element-wise over numpy arrays: the larger of the training
    peak (parameters x state bytes + units x unit bytes + recompute buffer + working memory, + ZeRO-2/3's
    transient whole tensors) and the optimizer step's (parameters x step bytes). The one
    definition the search's batched checks share; `RangeMemory.stage_bytes` and
    `FurthestFittingEnds` write the same expression for one stage, in the same order (without the
    transient term: ZeRO-2/3 are p = 1 only, checked on their one cut). Adding a 0.0 transient is
    exact, so stages 0 and 1 get the same figures as without it."""
    training = parameters * state_bytes + units * unit_bytes + buffer_bytes
    return np.maximum(training + working_bytes + transient_bytes, parameters * step_bytes)


def stage_holding(stage_layers: Sequence[tuple[int, int]], index: int) -> int:
    """The stage whose layer range holds layer `index`, by bisection: stages are contiguous, so it
    is the last whose start is at most the index, i.e. whose (start, end) <= (index, inf)."""
    return bisect_right(stage_layers, (index, math.inf)) - 1


def by_rank(per_stage: np.ndarray, p: int, v_placement: bool = False) -> np.ndarray:
    """Per-virtual-stage figures as a (chunks, p) matrix whose column k holds rank k's chunks
    (`stage_ranks`): in a loop, row c is stages c·p .. c·p + p − 1; as a V, every odd row reversed.

    >>> by_rank(np.arange(6), 3).tolist(), by_rank(np.arange(6), 3, v_placement=True).tolist()
    ([[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [5, 4, 3]])
    """
    matrix = per_stage.reshape(-1, p)
    if v_placement:
        matrix = matrix.copy()
        matrix[1::2] = matrix[1::2, ::-1]
    return matrix


def _no_shared_group_twice_per_rank(table: LayerTable, stage_layers: Sequence[tuple[int, int]], ranks: Sequence[int]) -> bool:
    """Whether no rank (virtual stage s on rank `ranks[s]`) holds two layers of one shared group (a
    tied embedding): then each chunk's parameters are its layers' and a rank's are their sum."""
    shared = table.shared_layer_indices
    if len(shared) < 2:
        return True
    holders: set[tuple[str, int]] = set()
    for index in shared:
        holder = (table.shared_group[index], ranks[stage_holding(stage_layers, index)])
        if holder in holders:
            return False
        holders.add(holder)  # type: ignore[arg-type]
    return True


def chunks_by_rank(
    stage_layers: Sequence[tuple[int, int]], ranks: Sequence[int], p: int
) -> list[list[tuple[int, int, int]]]:
    """Per rank, its (stage, start, end) chunks in stage order (virtual stage s on rank `ranks[s]`)."""
    chunks_of: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]
    for stage, (start, end) in enumerate(stage_layers):
        chunks_of[ranks[stage]].append((stage, start, end))
    return chunks_of


def parameters_on_rank(table: LayerTable, chunks: list[tuple[int, int, int]]) -> int:
    """Parameters over a rank's chunks; a shared group (tied embedding) is held once per rank."""
    total = sum(table.parameters(start, end) for _, start, end in chunks)
    if len(chunks) > 1 and table.shared_layer_indices:
        seen: set[str] = set()
        for _, start, end in chunks:
            groups = {table.shared_group[i] for i in table.shared_layer_indices if start <= i < end}
            for group in groups:
                if group in seen:
                    total -= max(
                        table.shared_parameter_count[i]
                        for i in table.shared_layer_indices
                        if table.shared_group[i] == group
                    )
                seen.add(group)  # type: ignore[arg-type]
    return total


def stage_parameter_and_activation_bytes(candidate: Any, profile: ModelProfile) -> tuple[list[int], list[int] | None]:
    """Per stage, per device: parameter bytes (2BW keeps two versions of them: `plan.twobw_steady_state`), and one micro-batch's saved activations (None with
    recomputation, whole-stage, per layer or selective, where a stage keeps less, or when the profile
    lacks the micro-batch size). With t > 1: a layer's shard for t if the profile has one; else the whole layer if the
    profile has shards elsewhere (it is replicated), else 1/t of it (as the memory model above)."""
    t, b = candidate.tensor_parallel, candidate.micro_batch_size
    sharded = any(layer.shards for layer in profile.layers)
    parameters: list[int] = []
    recomputes = (candidate.recompute or getattr(candidate, "checkpoint_layers", False)
                  or getattr(candidate, "selective_recompute", False))
    activations: list[int] | None = None if recomputes else []
    for start, end in candidate.stage_layers:
        stage_parameters = stage_activations = 0.0
        for layer in profile.layers[start:end]:
            shard = next((sh for sh in layer.shards if sh.tensor_parallel == t), None) if t > 1 else None
            owner, divisor = (shard, 1) if shard is not None else (layer, 1 if t == 1 or sharded else t)
            stage_parameters += owner.parameter_bytes / divisor
            if activations is not None:
                try:
                    stage_activations += owner.cost(b).saved_activation_bytes / divisor
                except KeyError:  # not profiled at this micro-batch size
                    activations = None
        parameters.append(round(stage_parameters))
        if activations is not None:
            activations.append(round(stage_activations))
    return parameters, activations
