"""Memory per device of a pipeline stage: model state, the activations its schedule keeps, the
working memory of its largest layer, and the optimizer step's peak.

Model state (docs/design.md, 'Memory model'; ZeRO, Rajbhandari et al. 2020, §5.1): mixed-precision Adam holds 16 bytes per
parameter while micro-batches run, 2 for the 16-bit weights, 2 for their gradients and 12 for the
fp32 optimizer state (master weights, momentum, variance); fp32 training holds 4 + 4 + 8 = 16 as
well. ZeRO stage 1 shards the optimizer part over the d data-parallel replicas, stage 2 the
gradients too, stage 3 the weights too (ZeRO §5.1-5.3; stages 2 and 3 only at p = 1, where
DeepSpeed's ordinary engine runs them: its pipeline engine refuses them). PipeDream-2BW keeps a
second copy of the weights (Narayanan et al. 2021, §3.1). Tensor parallelism (Megatron) splits a
stage's transformer blocks over its t devices; embeddings, the final norm and the head are
replicated on each.

The optimizer step is a second peak. DeepSpeed's bf16 engine with torch AdamW (ZeRO-0 and ZeRO-1
at d = 1, allocator peaks read on an H100; `benchmarks/gpu_check.py` holds the predicted peak
against a GPU's): 14 bytes per parameter held between steps (weights and the
fp32 optimizer state) and 22-24 at the step, where the engine adds the fp32 copy of the gradients
(4) and Adam's temporaries (4; torch's multi-tensor Adam allocates one fp32 buffer per parameter
for its update) to the 16 above. Both of these belong to the optimizer partition, so ZeRO-1
shards them too. The activations are freed by then, so a rank's peak is the larger of

    training:  parameters x state bytes + in-flight activations + recompute buffer + working memory
               (+ ZeRO-2/3's transient whole tensors, below)
    step:      parameters x step bytes (24 per parameter at d = 1 for 16-bit training, 20 for fp32)

Bytes per parameter by ZeRO stage (16-bit training: weights w = 2, gradients g = 2, optimizer
o = 12, the step's extra s = 8; fp32: 4, 4, 8, 4; 16-bit weights whose gradients the engine keeps
and reduces in fp32, `state_dtype`: 2, 4, 12, 4, the step needing no fp32 copy of them):

    stage   training                step
    0       w + g + o               w + g + o + s
    1       w + g + o/d             w + g + (o + s)/d
    2       w + (g + o)/d           w + (g + o + s)/d
    3       (w + g + o)/d           (w + g + o + s)/d

Sharded tensors are whole for a while (`sharded_transient_bytes`, with d > 1 only): under ZeRO-2 a
layer's gradient is produced whole and kept until its reduce-scatter has run, so the largest
layer's gradient (g x its parameters) is added to the training peak (DeepSpeed's reduce bucket,
sized to one layer); under ZeRO-3 the weights of the layer running and of the one prefetched
are gathered whole, plus the running layer's whole gradient: w x the largest two adjacent layers'
parameters + g x the largest layer's, where a block too large for DeepSpeed's prefetch bucket
counts as its four linear layers, fetched and released one at a time (`cost_table.zero3_prefetch_shares`).
The optimizer step works on shards only.

A layer's working memory is what its forward and backward allocate and free again beyond its
weights, gradients, saved activations and output: the head's fp32 logits, log-probabilities and
their gradients, the largest by far (6.25 GiB at b = 16, sequence 2048, vocabulary 51200).
`LayerProfile.working_memory_bytes` reads it from the profile; a stage needs its largest layer's,
on top of everything else it holds.

Activations: each micro-batch a stage has run forward on but not yet backward ("in flight") keeps
the stage's saved activations (docs/design.md, 'Memory model'). How many are in flight is a property of the schedule:

    GPipe                 m on every stage
    1F1B                  min(p - k, m) on stage k (0-based): warm-up forwards + 1
    2BW                   p - k on stage k: 1F1B's order with no flush between updates, so the
                          warm-up is never drained (p on stage 0 even at m = p - 1, the fewest
                          micro-batches per update 2BW runs with: `pipectl.schedule.twobw`)
    interleaved (v > 1)   min(2(p - k - 1) + (v - 1) p + 1, m v) chunk-micro-batches on rank k
                          (all m v when m == p), each holding one chunk (Megatron-LM's warm-up)
    Varuna                min(3 (p - 1 - k), m) on stage k < p - 1, 1 on the last stage: the
                          generated order (`generate`'s default, backward = 2 x forward) runs
                          forwards ahead until its first recompute is due; tests check this
                          closed form against `peak_in_flight_units` of the generated schedule
    zb-h1                 min(p, m) on every stage: a micro-batch's activations are held until its
                          W, which stage k postpones by k micro-batches; stage 0 holds 1F1B's
                          peak, the later stages as many (Qi et al. 2024: ZB-H1 peaks at 1F1B's
                          p M_B). Counted whole until W (W reads each layer's saved input)
    zbv                   2p chunk-micro-batches on every rank (m >= 2p - 1), each holding one of
                          its two chunks: p full-stage activations, 1F1B's stage-0 peak (Qi et al.
                          2024 §4: ZB-V peaks at p M_B on every worker); held until W as for zb-h1

With whole-stage recomputation (`Recompute.STAGE`) an in-flight micro-batch keeps only the stage's
input activation, and the stage needs one micro-batch's full activations while it recomputes
(docs/design.md, 'Memory model'). The last stage never recomputes (its backward follows its forward), so it keeps full
activations.

With per-layer activation checkpointing (`Recompute.LAYER`, Megatron-LM's "full" recompute;
Korthikanti et al. 2022, §2 and Table 2's "full" row: 2sbh per layer) an in-flight micro-batch
keeps every layer's input (`LayerTable.layer_inputs`: the sum over the stage's layers of the
previous layer's output), and the backward recomputes one layer at a time just before that
layer's backward, so one layer's full saved activations are alive on top (the stage's largest,
`LayerTable.largest_saved`, divided by t like any saved bytes). It applies to every stage, the last
and a one-stage plan included; there is no whole-stage recompute buffer. The language-model head
is not checkpointed (`layer_table.NOT_CHECKPOINTED_KINDS`: as in Megatron-LM, and the runtime
does the same): it keeps its saved activations, the 16-bit logits among them.

With selective recomputation (`Recompute.SELECTIVE`; Korthikanti et al. 2022, §5 and Table 2's
"selective" row: 34 sbh per layer instead of sbh (34 + 5as/h)) an in-flight micro-batch keeps each
layer's saved activations less its attention core's (`LayerTable.selective_kept`: the s x s scores,
softmax output, dropout mask and output of unfused attention; flash attention's log-sum-exp), and
the backward recomputes one block's core at a time, so one core's saved bytes are alive on top.

    unit bytes per in-flight micro-batch      buffer (one micro-batch, while recomputing)
    none    saved(stage)                       0
    stage   input(stage)   (not the last)      saved(stage)
    layer   its layers' inputs (the head:      largest saved(layer) of the stage's checkpointed
            its saved activations)             layers
    selective  saved(stage) - its cores'       largest attention core's saved bytes of the stage

What one tensor rank holds comes from the table (`LayerTable.divisor`). A profile with shard costs
gives each rank's own figures: a block shard's parameters (split matrices / t, LayerNorms and
row-parallel biases whole) and saved bytes (about 8 + 24/t bytes per token and hidden unit in
16-bit, not 32/t: the LayerNorms' inputs and the block's input are kept whole on every rank,
Korthikanti et al. 2022, §4.1), and replicated layers whole. A profile without divides every layer's
parameters and saved bytes by t, an under-estimate. The stage's input activation is replicated and
never divided; working memory is per layer and never divided.

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
from pipectl.schedule.ir import ActionKind, Schedule, ScheduleKind, stage_ranks

GIB = 1024**3

# Bytes per parameter: (weights, gradients, optimizer state, optimizer step's extra). Rajbhandari et al. 2020, §5.1; the
# step's extra (fp32 gradient copy + Adam's temporaries; 16-bit training) from the H100 measurement
# in the module docstring. fp32 training has no gradient copy to make: Adam's temporaries only.
_STATE_BYTES = {
    "bfloat16": (2.0, 2.0, 12.0, 8.0),
    "float16": (2.0, 2.0, 12.0, 8.0),
    "float32": (4.0, 4.0, 8.0, 4.0),
}
FP32_GRADIENTS = "+fp32-gradients"
for _dtype in ("bfloat16", "float16"):
    _STATE_BYTES[_dtype + FP32_GRADIENTS] = (2.0, 4.0, 12.0, 4.0)


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
    """Bytes of model state per parameter held on a device (the table in the module docstring).

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

    >>> step_bytes_per_parameter("bfloat16", 0, 8)  # the H100 measurement: 22-24
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
    (module docstring); 0 for stages 0 and 1 and at d = 1 (nothing is sharded then).
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
        rows: "RangeMemory | None" = None,
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


@dataclass(frozen=True)
class RangeMemory:
    """The terms of one stage's memory for every layer range [start, end) of one table and t, as lists.

    The memory-constrained partitioner asks "does layers [start, end) fit on stage i?" millions of
    times at scale; reading these rows costs a few list look-ups instead of the table's range
    queries. Values are computed with the same operations as `StageMemory.build` from the table
    (parameter counts are exact in float64 below 2**53), so a stage alone on its rank gets
    exactly the same bytes.
    """

    parameters: list[list[float]]  # [start][end]: parameters on a rank (/ t, `LayerTable.divisor`; 0 where end <= start)
    saved: list[list[float]]  # [start][end]: saved activations on a rank (/ t likewise)
    input_bytes: list[float]  # [start]: the activation a stage starting there receives
    working: list[list[float]]  # [start][end]: the largest working memory of layers [start, end)
    # [start][end]: what layers [start, end) keep per micro-batch under per-layer checkpointing
    # (`LayerTable.layer_inputs`: their inputs; the head's saved activations / t)
    layer_inputs: list[list[float]]
    largest_saved: list[list[float]]  # [start][end]: the largest saved activations of one checkpointed layer (/ t)
    # [start][end]: what layers [start, end) keep per micro-batch under selective recomputation
    # (`LayerTable.selective_saved`), and their largest attention core's saved bytes (/ t)
    selective_saved: list[list[float]]
    largest_core: list[list[float]]
    # The same values as arrays, for looking up every stage of a cut at once.
    parameter_matrix: np.ndarray
    saved_matrix: np.ndarray
    input_array: np.ndarray
    working_matrix: np.ndarray
    layer_input_matrix: np.ndarray
    largest_saved_matrix: np.ndarray
    selective_saved_matrix: np.ndarray
    largest_core_matrix: np.ndarray
    parameter_prefix: np.ndarray  # the table's parameter counts, as float64 prefix sums (not divided)

    @classmethod
    def build(cls, table, tensor_parallel: int) -> "RangeMemory":
        layers = table.layers
        divisor = table.divisor(tensor_parallel)  # t for whole layers, 1 for one tensor rank's figures
        parameter_prefix = np.asarray(table.parameter_prefix, dtype=float)
        saved_prefix = np.asarray(table.saved_prefix, dtype=float)
        parameters = (parameter_prefix[None, :] - parameter_prefix[:, None]) / divisor
        saved = (saved_prefix[None, :] - saved_prefix[:, None]) / divisor
        rows = parameters.tolist()
        # Ranges holding two members of a shared group (a tied embedding) count it once.
        shared = np.zeros(layers + 1, dtype=int)
        for index in table.shared_layer_indices:
            shared[index + 1:] += 1
        for start, end in zip(*np.nonzero(shared[None, :] - shared[:, None] >= 2)):
            rows[start][end] = table.parameters(int(start), int(end)) / divisor
        inputs = [table.input_activation_bytes(start) for start in range(layers)] + [0.0]
        working = np.zeros((layers + 1, layers + 1))
        per_layer = np.asarray(table.working_bytes, dtype=float)
        largest = np.zeros((layers + 1, layers + 1))
        per_layer_saved = np.asarray(
            [saved if table.checkpointed(i) else 0.0 for i, saved in enumerate(table.saved_activation_bytes)], dtype=float
        )
        for start in range(layers):
            working[start, start + 1:] = np.maximum.accumulate(per_layer[start:])
            largest[start, start + 1:] = np.maximum.accumulate(per_layer_saved[start:])
        largest /= divisor
        # What layers [start, end) keep under per-layer checkpointing, added in layer order as
        # `LayerTable.layer_inputs` adds them (a cumulative sum is the same sequence of float additions).
        layer_input = np.zeros((layers + 1, layers + 1))
        per_layer_input = np.asarray([table.checkpoint_kept(i, divisor) for i in range(layers)], dtype=float)
        for start in range(layers):
            layer_input[start, start + 1:] = np.cumsum(per_layer_input[start:])
        # Selective recomputation, as `LayerTable.selective_saved` and `largest_attention_core` add
        # and compare them.
        selective = np.zeros((layers + 1, layers + 1))
        per_layer_selective = np.asarray([table.selective_kept(i, divisor) for i in range(layers)], dtype=float)
        largest_core = np.zeros((layers + 1, layers + 1))
        per_layer_core = np.asarray([table.attention_core_saved(i) for i in range(layers)], dtype=float)
        for start in range(layers):
            selective[start, start + 1:] = np.cumsum(per_layer_selective[start:])
            largest_core[start, start + 1:] = np.maximum.accumulate(per_layer_core[start:])
        largest_core /= divisor
        return cls(
            rows, saved.tolist(), inputs, working.tolist(), layer_input.tolist(), largest.tolist(),
            selective.tolist(), largest_core.tolist(),
            np.array(rows), saved, np.array(inputs), working, layer_input, largest, selective, largest_core,
            parameter_prefix,
        )

    def stage_bytes(
        self, start: int, end: int, *, state_bytes: float, step_bytes: float, units: int,
        recompute: Recompute | bool,
    ) -> float:
        """Peak bytes of a stage holding layers [start, end) with `units` micro-batches in flight:
        the larger of parameters × step bytes (the optimizer step) and parameters × state bytes +
        units × what one keeps + what recomputing holds + its largest working memory (the table in
        the module docstring). Pass `recompute=False` (NONE) for the last stage of a pipeline that
        recomputes whole stages: it never does."""
        parameters = self.parameters[start][end]
        if recompute is Recompute.LAYER:
            training = (
                parameters * state_bytes + units * self.layer_inputs[start][end] + self.largest_saved[start][end]
            )
        elif recompute is Recompute.SELECTIVE:
            training = (
                parameters * state_bytes + units * self.selective_saved[start][end] + self.largest_core[start][end]
            )
        elif recompute:
            training = parameters * state_bytes + units * self.input_bytes[start] + self.saved[start][end]
        else:
            training = parameters * state_bytes + units * self.saved[start][end]
        return max(training + self.working[start][end], parameters * step_bytes)


class FurthestFittingEnds:
    """For a stage starting at a layer: the furthest end whose stage still fits, memoised.

    `end(start, state_bytes, step_bytes, units, keeps_input_only)` is the largest `end` in
    (start, layers] with `RangeMemory.stage_bytes(start, end, ...) <= capacity` (the same float
    expressions the partitioner's memory test evaluates), or `start` when not even one layer fits.
    A stage's bytes never shrink as its range grows (parameters, saved activations and working
    memory are non-negative; a shared group counts once), so bisection finds it. The search asks
    the same question for many pipelines of one (t, b): the stage memory only depends on the
    start, the bytes per parameter (training and step), the in-flight units and what the stage
    keeps (`keeps_input_only`: False/NONE its saved activations, True/STAGE only its input,
    `Recompute.LAYER` its layers' inputs, `Recompute.SELECTIVE` its saved activations less the
    attention cores') — so the answers are remembered by exactly those values.

        >>> from pipectl.testing.profiles import synthetic_profile
        >>> from pipectl.plan.layer_table import layer_table
        >>> rows = RangeMemory.build(layer_table(synthetic_profile(blocks=4, micro_batch_sizes=[1]), 1), 1)
        >>> ends = FurthestFittingEnds(rows, capacity_bytes=10**12)
        >>> ends.end(0, 16.0, 24.0, 1, False)  # everything fits: up to the last layer
        7
        >>> FurthestFittingEnds(rows, capacity_bytes=0).end(0, 16.0, 24.0, 1, False)  # nothing fits
        0
    """

    def __init__(self, rows: RangeMemory, capacity_bytes: float) -> None:
        self.rows = rows
        self.capacity_bytes = capacity_bytes
        self.layers = len(rows.input_bytes) - 1
        # (state bytes, step bytes, keeps input only) -> units -> end per start (-1: not yet
        # asked). Callers on hot paths read these rows directly; nested by kind of key so a
        # look-up hashes an int.
        self._rows: dict[tuple[float, float, Recompute | bool], dict[int, list[int]]] = {}
        self._lengths: dict[tuple[float, float, int, Recompute | bool], int] = {}  # last fitting stage length per demand

    def by_units(self, state_bytes: float, step_bytes: float, keeps_input_only: Recompute | bool) -> dict[int, list[int]]:
        """The memo rows of one (bytes per parameter, keeps input only), by in-flight units."""
        key = (state_bytes, step_bytes, keeps_input_only)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = {}
        return rows

    def row(self, state_bytes: float, step_bytes: float, units: int, keeps_input_only: Recompute | bool) -> list[int]:
        """The memo row of one demand: the end for each start, -1 where not yet asked."""
        rows = self.by_units(state_bytes, step_bytes, keeps_input_only)
        row = rows.get(units)
        if row is None:
            row = rows[units] = [-1] * (self.layers + 1)
        return row

    def end(self, start: int, state_bytes: float, step_bytes: float, units: int, keeps_input_only: Recompute | bool) -> int:
        row = self.row(state_bytes, step_bytes, units, keeps_input_only)
        end = row[start]
        if end < 0:
            end = row[start] = self.search(start, state_bytes, step_bytes, units, keeps_input_only)
        return end

    def search(self, start: int, state_bytes: float, step_bytes: float, units: int, keeps_input_only: Recompute | bool) -> int:
        """`end` without the memo (callers holding a memo row store the answer themselves)."""
        rows = self.rows
        parameters, saved, working = rows.parameters[start], rows.saved[start], rows.working[start]
        capacity = self.capacity_bytes
        if keeps_input_only is Recompute.LAYER or keeps_input_only is Recompute.SELECTIVE:
            # `RangeMemory.stage_bytes`'s per-layer checkpointing: `P*s + u*inputs + largest + W`;
            # selective recomputation: `P*s + u*(saved - cores) + largest core + W`.
            if keeps_input_only is Recompute.LAYER:
                layer_inputs, largest = rows.layer_inputs[start], rows.largest_saved[start]
            else:
                layer_inputs, largest = rows.selective_saved[start], rows.largest_core[start]

            def fits(end: int) -> bool:
                held = parameters[end]
                return (
                    held * state_bytes + units * layer_inputs[end] + largest[end] + working[end] <= capacity
                    and held * step_bytes <= capacity
                )

        else:
            # One expression for both other kinds of stage: `P*s + u*I + S + W` keeping only the
            # input, else `P*s + 0.0 + u*S + W`; adding 0.0 and multiplying by 1 are exact, so each
            # equals `RangeMemory.stage_bytes`'s training peak; the optimizer step's `P*step` is the other.
            if keeps_input_only:
                held_input, saved_coefficient = units * rows.input_bytes[start], 1
            else:
                held_input, saved_coefficient = 0.0, units

            def fits(end: int) -> bool:
                held = parameters[end]
                return (
                    held * state_bytes + held_input + saved_coefficient * saved[end] + working[end] <= capacity
                    and held * step_bytes <= capacity
                )

        low, high = start, self.layers  # low fits (or is `start`); every end above `high` fails
        # Bracket first around the length last found for this demand (stages of a model's
        # repeated blocks fit the same number of layers), then bisect what is left.
        demand = (state_bytes, step_bytes, units, keeps_input_only)
        length = self._lengths.get(demand)
        if length is not None and start + length <= high:
            guess = start + length
            if fits(guess):
                low = guess
                if guess + 1 <= high and not fits(guess + 1):
                    high = guess
            else:
                high = guess - 1
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        if low > start:
            self._lengths[demand] = low - start
        return low


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
