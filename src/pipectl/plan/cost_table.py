"""The simulator's cost table for a candidate (`StageCosts`): per virtual stage, the layers' compute
and tensor-parallel communication (`plan.costs`), the point-to-point transfers between stages, and
the data-parallel collectives at the end of a step: the gradient all-reduce (bucketed as DeepSpeed
and Megatron do, with the small collectives each step adds), ZeRO's reduce-scatter and all-gather,
ZeRO-3's prefetched parameter gathers, and the tied embedding's all-reduce. The formulas are
those of `plan.costs`'s module docstring."""

from __future__ import annotations

from typing import Sequence

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.plan import Candidate
from pipectl.artifacts.profile import ModelProfile
from pipectl.catalog import DTYPE_BYTES
from pipectl.cluster import LinkCost, ResolvedLinks
from pipectl.errors import UserInputError
from pipectl.plan.layer_table import LayerTable, layer_table
from pipectl.plan.memory import chunks_by_rank, parameters_on_rank
from pipectl.plan.stage_costs import StageCosts
from pipectl.schedule import ScheduleKind, stage_ranks
from pipectl.plan.costs import Hardware, LayerSeconds, TRANSFORMER_BLOCK, collective_handoff_seconds, hardware_for, host_compute_slowdown, layer_seconds, overlapped_exposed_seconds, profile_for
from pipectl.plan.placement import ranks_share_node, replicas_share_node

# Bytes of memory traffic per parameter of one Adam step (read 4+4+4+2, write 4+4+4+2).
ADAM_BYTES_PER_PARAMETER = 28
# The same step under fp16 with loss scaling, as DeepSpeed's 16-bit optimizers run it per parameter
# they update (deepspeed/runtime/zero/stage_1_and_2.py `step`, fp16/fused_optimizer.py): the overflow
# check sums each gradient as fp32 (`x.float().sum()`: read 2, write 4, read 4), the gradients are
# flattened (2 + 2) and cast into the fp32 partition (2 + 4), the norm reads them (4), unscaling and
# clipping rewrite them (4 + 4), Adam reads the fp32 parameter, gradient and both moments and writes
# three (16 + 12), and the fp32 parameters are copied back to 16 bits (4 + 2).
LOSS_SCALED_ADAM_BYTES_PER_PARAMETER = 10 + 4 + 6 + 4 + 8 + 28 + 6

# Latency-bound collectives DeepSpeed's ZeRO-1 pipeline engine adds at the end of a step (counted by
# instrumenting torch.distributed in real runs, DeepSpeed 0.19.8): per data-parallel group (d > 1)
# the gradient-norm and loss all-reduces, per pipeline (p > 1) the gradient-norm all-reduce and the
# loss broadcast (costed as an all-reduce of a few bytes).
SMALL_COLLECTIVES_PER_DATA_PARALLEL_GROUP = 2
SMALL_COLLECTIVES_PER_PIPELINE = 2
SMALL_COLLECTIVE_BYTES = 8
# Megatron-Core's gradient bucket: max(40e6, 1e6 x d) parameters (DistributedDataParallel at commit
# f2e5db402c: "make buckets larger [...] to remain bandwidth-bound"); the floor is
# `EngineFeatures.bucket_parameters`.
MEGATRON_BUCKET_PARAMETERS_PER_REPLICA = 1_000_000
# DeepSpeed's ZeRO-3 prefetch (deepspeed/runtime/zero/partitioned_param_coordinator.py,
# `fetch_sub_module`, 0.19.8): at the start of each submodule it all-gathers the next parameters of
# the recorded trace, whole parameters, until stage3_prefetch_bucket_size elements are on their way
# (5e7 by default; pipectl's ds_config keeps it). A GPT block's linear layers, in the order they
# run (QKV, proj, fc1, fc2), hold 3, 1, 4 and 4 twelfths of its weights and do as much of its GEMM
# work (Shoeybi et al. 2019): `zero3_prefetch_units`.
DEEPSPEED_PREFETCH_BUCKET_ELEMENTS = 50_000_000
BLOCK_LINEAR_SHARES = (3 / 12, 1 / 12, 4 / 12, 4 / 12)


# --- the cost table ----------------------------------------------------------------------------


FP32_BYTES = 4


def adam_seconds_per_parameter(hardware: Hardware) -> float:
    """Seconds of optimizer step per parameter a rank updates: its memory traffic at the datasheet
    bandwidth (a streaming pass; the step's kernels are large)."""
    bytes_per_parameter = LOSS_SCALED_ADAM_BYTES_PER_PARAMETER if hardware.loss_scaled else ADAM_BYTES_PER_PARAMETER
    return bytes_per_parameter / ((hardware.device.memory_bandwidth_gbytes_per_second or 100.0) * 1e9)


def gradient_bytes(hardware: Hardware, element_bytes: int) -> int:
    """Bytes per gradient element that a data-parallel reduction moves: fp32's where the engine
    reduces gradients in fp32 (`EngineFeatures.gradients_reduced_in_fp32`), else the training
    dtype's `element_bytes`. Parameter all-gathers always move `element_bytes`."""
    features = hardware.features
    return FP32_BYTES if features is not None and features.gradients_reduced_in_fp32 else element_bytes


def stage_costs(
    profile: ModelProfile,
    hardware: Hardware,
    stage_layers: Sequence[tuple[int, int]],
    *,
    micro_batch_size: int,
    tensor_parallel: int,
    data_parallel: int,
    pipeline_parallel: int | None = None,
    zero_stage: int = 0,
    seconds: LayerSeconds | None = None,
    micro_batches: int = 1,
    checkpoint_layers: bool = False,
    v_placement: bool = False,
    selective_recompute: bool = False,
) -> StageCosts:
    """The simulator's `StageCosts` for one candidate; `stage_layers` holds p*v virtual stages,
    stage s on rank s % p, or placed as zbv's V with `v_placement` (`pipectl.schedule.ir.stage_rank`).
    `micro_batches`: the step's m, which only ZeRO-2/3's per-micro-batch collectives read.
    `checkpoint_layers`: each backward recomputes its layers' forwards first (per-layer
    activation checkpointing), so it costs their forward time more (`ShapeBuilder.shape_from_cuts`).
    `selective_recompute`: each backward recomputes its blocks' attention cores first."""
    table = layer_table(profile, micro_batch_size, tensor_parallel)
    t, d = tensor_parallel, data_parallel
    p = pipeline_parallel or len(stage_layers)
    seconds = seconds or layer_seconds(table, hardware, t)
    n = hardware.devices_per_node
    links = hardware.links
    ranks = stage_ranks(len(stage_layers), p, v_placement)

    slowdown = host_compute_slowdown(hardware, t * p * d)
    forward = [seconds.stage_forward(s, e) * slowdown for s, e in stage_layers]
    if checkpoint_layers:
        backward = [(seconds.stage_backward(s, e) + seconds.recomputed_forward(s, e)) * slowdown for s, e in stage_layers]
    elif selective_recompute:
        backward = [(seconds.stage_backward(s, e) + seconds.recomputed_attention(s, e)) * slowdown for s, e in stage_layers]
    else:
        backward = [seconds.stage_backward(s, e) * slowdown for s, e in stage_layers]

    sends = []
    jitter = 0.0
    for stage in range(len(stage_layers) - 1):
        crossing = table.output_activation_bytes[stage_layers[stage][1] - 1]
        inside = ranks_share_node(ranks[stage], ranks[stage + 1], p, t, d, n)
        link = links.intra if inside else links.inter
        jitter = max(jitter, link.jitter_seconds)
        sends.append(link.seconds(crossing))

    element_bytes = DTYPE_BYTES.get(profile.dtype, 4)
    if zero_stage >= 2:
        allreduce, optimizer = sharded_data_parallel_seconds(
            table, seconds, hardware, pipeline_parallel=p, tensor_parallel=t, data_parallel=d,
            zero_stage=zero_stage, micro_batches=micro_batches, element_bytes=element_bytes, slowdown=slowdown,
            checkpoint_layers=checkpoint_layers,
        )  # fmt: skip
    else:
        parameters = parameters_per_rank(table, stage_layers, p, ranks)
        backward_window, forward_window = [0.0] * p, [0.0] * p
        for stage in range(len(stage_layers)):  # one micro-batch's backward and forward of each rank
            backward_window[ranks[stage]] += backward[stage]
            forward_window[ranks[stage]] += forward[stage]
        allreduce, optimizer = data_parallel_seconds(
            [held / table.divisor(t) for held in parameters], hardware, pipeline_parallel=p, tensor_parallel=t,
            data_parallel=d, zero_stage=zero_stage, element_bytes=element_bytes,
            backward_window=backward_window, forward_window=forward_window,
        )  # fmt: skip
    optimizer = [end_of_step * slowdown for end_of_step in optimizer]
    tied = tied_allreduce_seconds(table, stage_layers, ranks, p, t, d, n, links, element_bytes, hardware)
    for rank, extra in tied.items():
        allreduce[rank] += extra

    return StageCosts(
        forward_seconds=tuple(forward),
        backward_seconds=tuple(backward),
        recompute_seconds=tuple(forward),
        send_forward_seconds=tuple(sends),
        send_backward_seconds=tuple(sends),
        allreduce_seconds=tuple(allreduce),
        optimizer_seconds=tuple(optimizer),
        jitter_seconds=jitter,
        blocking_p2p=hardware.device.blocking_p2p,
    )


def data_parallel_seconds(
    parameters_per_rank: Sequence[float],
    hardware: Hardware,
    *,
    pipeline_parallel: int,
    tensor_parallel: int,
    data_parallel: int,
    zero_stage: int,
    element_bytes: int,
    backward_window: Sequence[float] | None = None,
    forward_window: Sequence[float] | None = None,
) -> tuple[list[float], list[float]]:
    """(all-reduce, optimizer) seconds per pipeline rank at the end of a step (tied weights aside).

    With another engine's overlap (`hardware.features`: gradient_reduce_overlap,
    parameter_gather_overlap) the collectives are charged only where they outlast what hides them
    (`overlapped_data_parallel_seconds`): `backward_window` and `forward_window` are each rank's
    backward and forward of one micro-batch.

    `parameters_per_rank` are the parameters each rank holds after the tensor split. All-reduce:
    the ring all-reduce of the rank's gradient over its d replicas (its bytes `gradient_bytes`;
    under ZeRO-1 the parameters' all-gather half of it moves `element_bytes`), plus, with
    measured engine terms, the engine's extra collectives (module docstring). Optimizer: with measured engine
    terms, fixed + per-parameter seconds of the end of a step; otherwise Adam's memory traffic
    at the device's bandwidth. Worked example (gpt-tiny's 318 k parameters on one rank whose
    calibration gave 1.2 ms fixed and 22 ns per parameter):

        1.2 ms + 318e3 x 22e-9 s = 8.2 ms of optimizer step, no all-reduce (d = 1)
    """
    p, t, d = pipeline_parallel, tensor_parallel, data_parallel
    n = hardware.devices_per_node
    links = hardware.links
    runtime = hardware.runtime
    gradient = gradient_bytes(hardware, element_bytes)
    allreduce: list[float] = []
    optimizer: list[float] = []
    pipeline_inside = ranks_share_node(0, p - 1, p, t, d, n)
    pipeline_ring = links.allreduce_intra if pipeline_inside else links.allreduce_inter
    pipeline_handoff = collective_handoff_seconds(hardware, p, pipeline_inside)
    for rank, held in enumerate(parameters_per_rank):
        inside = replicas_share_node(rank, p, t, d, n) and not hardware.replicas_span_nodes
        ring = links.allreduce_intra if inside else links.allreduce_inter
        handoff = collective_handoff_seconds(hardware, d, inside)
        gradient_seconds = ring.ring_allreduce_seconds(held * gradient, d)
        # ZeRO-1 (the distributed optimizer): the gradients' reduce-scatter, half the ring, then the
        # updated parameters' all-gather, half a ring of their bytes; ZeRO-0: the all-reduce. An
        # engine that all-reduces before its sharded step (`gradients_all_reduced`) pays both.
        sharded = zero_stage >= 1
        features = hardware.features
        scattered = sharded and not (features is not None and features.gradients_all_reduced)
        reduce_seconds = gradient_seconds / 2 if scattered else gradient_seconds
        gather_seconds = ring.ring_allreduce_seconds(held * element_bytes, d) / 2
        seconds = reduce_seconds + (gather_seconds if sharded else 0.0) + handoff
        if runtime is None and features is not None and features.gradient_reduce_overlap and d > 1:
            bucket = min(held, max(features.bucket_parameters, MEGATRON_BUCKET_PARAMETERS_PER_REPLICA * d))
            bucket_seconds = ring.ring_allreduce_seconds(bucket * gradient, d) / (2 if scattered else 1)
            seconds = handoff + overlapped_data_parallel_seconds(
                reduce_seconds,
                gather_seconds if sharded else 0.0,
                bucket_seconds,
                backward_window[rank] if backward_window else 0.0,
                forward_window[rank] if forward_window else 0.0,
                gather_overlapped=features.parameter_gather_overlap,
            )
        if runtime is None:
            updated = held / d if zero_stage >= 1 else held
            optimizer.append(updated * adam_seconds_per_parameter(hardware) + engine_step_overhead(hardware))
        else:
            optimizer.append(runtime.step_fixed_seconds + runtime.step_seconds_per_parameter * held)
            small = ring.ring_allreduce_seconds(SMALL_COLLECTIVE_BYTES, d) + handoff
            seconds += gather_seconds + handoff  # ZeRO-1 parameter all-gather
            seconds += SMALL_COLLECTIVES_PER_DATA_PARALLEL_GROUP * small
            seconds += SMALL_COLLECTIVES_PER_PIPELINE * (
                pipeline_ring.ring_allreduce_seconds(SMALL_COLLECTIVE_BYTES, p) + pipeline_handoff
            )
        allreduce.append(seconds)
    return allreduce, optimizer


def engine_step_overhead(hardware: Hardware) -> float:
    """Another engine's fitted time per step and rank beyond the optimizer's traffic
    (`EngineFeatures.step_overhead_seconds`); 0 with measured engine terms, which include it."""
    if hardware.runtime is not None or hardware.features is None:
        return 0.0
    return hardware.features.step_overhead_seconds


def overlapped_data_parallel_seconds(
    reduce_seconds: float, gather_seconds: float, last_bucket_seconds: float, backward_window: float,
    forward_window: float, *, gather_overlapped: bool,
) -> float:
    """Exposed seconds of a rank's data-parallel collectives when the engine overlaps them
    (Megatron-Core's --overlap-grad-reduce, --overlap-param-gather; `EngineFeatures`).

    The gradient reduction (a reduce-scatter under the distributed optimizer, an all-reduce
    without) runs bucket by bucket while the rank's last micro-batch runs its backward: exposed
    is the last bucket, made by the backward's last layers with nothing left to hide it, plus what
    the others add beside that backward (`overlapped_exposed_seconds`: what outlasts it, and never
    less than what the backward loses to them). The parameter all-gather after the optimizer runs
    beside the next step's first forward when overlapped (exposed: the same rule), else at the end
    of the step:

        >>> round(overlapped_data_parallel_seconds(0.3, 0.3, 0.01, 0.5, 0.2, gather_overlapped=True), 6)   # 0.01 + 0.046 + 0.1
        0.156098
        >>> round(overlapped_data_parallel_seconds(0.3, 0.3, 0.01, 0.5, 0.2, gather_overlapped=False), 6)  # 0.01 + 0.046 + 0.3
        0.356098
        >>> round(overlapped_data_parallel_seconds(0.8, 0.0, 0.01, 0.5, 0.2, gather_overlapped=True), 6)
        0.3
    """
    overlapped = max(0.0, reduce_seconds - last_bucket_seconds)
    reduce_exposed = min(reduce_seconds, last_bucket_seconds) + overlapped_exposed_seconds(overlapped, backward_window)
    gather_exposed = overlapped_exposed_seconds(gather_seconds, forward_window) if gather_overlapped else gather_seconds
    return reduce_exposed + gather_exposed


def sharded_exposed_seconds(
    layer_bytes: Sequence[float], forward: Sequence[float], backward: Sequence[float], link: LinkCost,
    data_parallel: int, zero_stage: int, handoff_seconds: float = 0.0, gradient_scale: float = 1.0,
    recomputed: Sequence[float] | None = None,
) -> float:
    """Exposed seconds of one micro-batch's ZeRO-2/3 collectives on a one-stage pipeline (the
    formulas in the module docstring). `layer_bytes`: each layer's weight bytes on the rank (its
    gradient's are the same); `forward`/`backward`: each layer's compute seconds; `handoff_seconds`:
    what each blocking collective waits besides (`collective_handoff_seconds`); `gradient_scale`:
    a gradient's bytes over its weight's (2 where 16-bit weights' gradients are reduced in fp32,
    `gradient_bytes`); `recomputed`: with per-layer checkpointing, each layer's forward run again
    at the start of its backward (0 for a layer not checkpointed). 0 for stages 0 and 1 and at d = 1.

    Under ZeRO-3 a checkpointed layer's weights are gathered three times a micro-batch, not two:
    its recomputed forward is an ordinary forward to DeepSpeed's module hooks, which gather the
    weights before it and partition them again after it, and the backward's hooks gather them once
    more (the behaviour traced in huggingface/transformers#47254 on DeepSpeed 0.19). The
    recomputed forward also lengthens the window the link hides behind: while layer j recomputes
    and runs its backward, the link gathers layer j - 1's weights for its recomputation, layer j's
    again for its backward, and reduce-scatters layer j + 1's gradient.

    DeepSpeed runs ZeRO-3's collectives on their own streams, beside the compute, but ZeRO-2's
    reduce-scatters on the compute stream (its `overlap_comm` defaults to on for stage 3 only:
    deepspeed/runtime/zero/config.py, `overlap_comm_valid`; stage_1_and_2.py reduces on
    `reduction_stream` only with it), and pipectl's ds_config leaves it at that default: ZeRO-2
    exposes every layer's reduce-scatter.

    Two layers of 1 GB over 8 ranks at 5 µs and 25 GB/s: one gather or scatter takes
    7 x (5e-6 + 1e9 / 8 / 25e9) = 35.035 ms; with 10 ms forwards and 20 ms backwards ZeRO-3 exposes
    35.035 + 25.035 (forward) + 35.035 + 15.035 + 15.035 + 35.035 (backward) = 160.21 ms, ZeRO-2
    2 x 35.035:

        >>> link = LinkCost(5e-6, 25e9)
        >>> round(sharded_exposed_seconds([1e9, 1e9], [0.01, 0.01], [0.02, 0.02], link, 8, 3) * 1e3, 2)
        160.21
        >>> round(sharded_exposed_seconds([1e9, 1e9], [0.01, 0.01], [0.02, 0.02], link, 8, 2) * 1e3, 2)
        70.07

    Checkpointed, each backward window is 30 ms and carries one gather more: the backward exposes
    35.035 + 2 x (70.07 - 30) + 35.035, 50 ms more:

        >>> round(sharded_exposed_seconds([1e9, 1e9], [0.01, 0.01], [0.02, 0.02], link, 8, 3,
        ...                               recomputed=[0.01, 0.01]) * 1e3, 2)
        210.28
    """
    d, layers = data_parallel, len(layer_bytes)
    if zero_stage < 2 or d <= 1 or layers == 0:
        return 0.0
    # One ring all-gather or reduce-scatter of each layer's bytes: half a ring all-reduce.
    moved = [link.ring_allreduce_seconds(size, d) / 2 + handoff_seconds for size in layer_bytes]
    scattered = moved if gradient_scale == 1.0 else [
        link.ring_allreduce_seconds(size * gradient_scale, d) / 2 + handoff_seconds for size in layer_bytes
    ]
    if zero_stage == 2:  # on the compute stream: nothing hides them
        return sum(scattered)
    gathers = zero_stage >= 3
    exposed = scattered[0]  # layer 0's gradient, made last: nothing left to hide its reduce-scatter behind
    if gathers:
        exposed += moved[0] + moved[-1]  # the forward's first gather, the backward's first (last layer)
        for i in range(1, layers):
            exposed += overlapped_exposed_seconds(moved[i], forward[i - 1])
    for j in range(layers):
        on_link = (scattered[j + 1] if j + 1 < layers else 0.0) + (moved[j - 1] if gathers and j > 0 else 0.0)
        window = backward[j]
        if recomputed is not None and recomputed[j] > 0:
            window += recomputed[j]
            on_link += moved[j] if gathers else 0.0  # the backward's own gather, after the recomputation's
        exposed += overlapped_exposed_seconds(on_link, window)
    return exposed


def zero3_prefetch_units(
    kinds: Sequence[str], parameters: Sequence[float], *per_layer: Sequence[float]
) -> tuple[list[float], ...]:
    """(parameters, *per_layer) per unit that DeepSpeed's ZeRO-3 gathers one ahead of the compute
    (`per_layer`: seconds per layer, forward, backward, ..., split as the parameters are): each
    layer, except a transformer block whose every linear layer holds more than the prefetch bucket
    (`DEEPSPEED_PREFETCH_BUCKET_ELEMENTS`). DeepSpeed then prefetches one linear at a time, so fc1's
    gather hides only behind proj's compute, a quarter of its own: the block becomes its four
    linears (`BLOCK_LINEAR_SHARES` of its parameters and of its time). Smaller blocks keep one unit:
    the bucket then reaches a layer or more ahead.

        >>> units = zero3_prefetch_units(["transformer_block"], [1.2e9], [0.012], [0.024])
        >>> [round(x / 1e6) for x in units[0]], [round(x * 1e3) for x in units[1]]
        ([300, 100, 400, 400], [3, 1, 4, 4])
        >>> zero3_prefetch_units(["transformer_block"], [1.2e8], [0.012], [0.024])[0]   # proj: 10 M
        [120000000.0]
    """
    units: tuple[list[float], ...] = tuple([] for _ in range(1 + len(per_layer)))
    for kind, count, *values in zip(kinds, parameters, *per_layer):
        for share in zero3_prefetch_shares(kind, count):
            for column, value in zip(units, (count, *values)):
                column.append(share * value)
    return units


def zero3_prefetch_shares(kind: str, parameters: float) -> tuple[float, ...]:
    """The shares of a layer that ZeRO-3 gathers one at a time (`zero3_prefetch_units`)."""
    if kind == TRANSFORMER_BLOCK and min(BLOCK_LINEAR_SHARES) * parameters > DEEPSPEED_PREFETCH_BUCKET_ELEMENTS:
        return BLOCK_LINEAR_SHARES
    return (1.0,)


def sharded_data_parallel_seconds(
    table: LayerTable,
    seconds: LayerSeconds,
    hardware: Hardware,
    *,
    pipeline_parallel: int,
    tensor_parallel: int,
    data_parallel: int,
    zero_stage: int,
    micro_batches: int,
    element_bytes: int,
    slowdown: float = 1.0,
    checkpoint_layers: bool = False,
) -> tuple[list[float], list[float]]:
    """(communication, optimizer) seconds of the one rank of a ZeRO-2/3 candidate (p = 1; module
    docstring): m x `sharded_exposed_seconds` of the rank's layers (their compute x the host's
    `slowdown`; with `checkpoint_layers`, each backward after its layers' recomputed forwards), plus
    ZeRO-2's all-gather of the updated parameters after the step, plus, with measured engine terms,
    the engine's latency-bound collectives. Optimizer: as `data_parallel_seconds` (Adam on 1/d of
    the parameters; with measured terms, the measured end of a step, which is ZeRO-1's)."""
    if pipeline_parallel != 1:
        raise UserInputError(
            f"ZeRO stage {zero_stage} is priced for one pipeline stage only (p = 1), not p = {pipeline_parallel}",
            hint="DeepSpeed's pipeline engine runs ZeRO stages 0 and 1 only",
        )
    t, d = tensor_parallel, data_parallel
    divisor = table.divisor(t)
    held = table.parameters(0, table.layers) / divisor
    inside = replicas_share_node(0, 1, t, d, hardware.devices_per_node) and not hardware.replicas_span_nodes
    ring = hardware.links.allreduce_intra if inside else hardware.links.allreduce_inter
    handoff = collective_handoff_seconds(hardware, d, inside)
    counts = [count / divisor for count in table.parameter_count]
    forward = [f * slowdown for f in seconds.forward]
    backward = [b * slowdown for b in seconds.backward]
    recomputed = [seconds.recomputed_forward(i, i + 1) * slowdown if checkpoint_layers else 0.0
                  for i in range(len(forward))]
    if zero_stage == 3:
        counts, forward, backward, recomputed = zero3_prefetch_units(table.kinds, counts, forward, backward, recomputed)
    exposed = sharded_exposed_seconds(
        [count * element_bytes for count in counts], forward, backward, ring, d, zero_stage, handoff,
        gradient_scale=gradient_bytes(hardware, element_bytes) / element_bytes, recomputed=recomputed,
    )
    communication = micro_batches * exposed
    if zero_stage == 2 and d > 1:
        communication += ring.ring_allreduce_seconds(held * element_bytes, d) / 2 + handoff
    runtime = hardware.runtime
    if runtime is None:
        optimizer = held / d * adam_seconds_per_parameter(hardware) + engine_step_overhead(hardware)
    else:
        optimizer = runtime.step_fixed_seconds + runtime.step_seconds_per_parameter * held
        if d > 1:
            small = ring.ring_allreduce_seconds(SMALL_COLLECTIVE_BYTES, d) + handoff
            communication += SMALL_COLLECTIVES_PER_DATA_PARALLEL_GROUP * small
    return [communication], [optimizer]


def parameters_per_rank(
    table: LayerTable, stage_layers: Sequence[tuple[int, int]], p: int, ranks: Sequence[int]
) -> list[int]:
    """Parameters per rank (virtual stage s on rank `ranks[s]`), a shared group once per rank
    (`memory.parameters_on_rank`: zbv's rank 0 holds the tied embedding and head)."""
    return [parameters_on_rank(table, chunks) for chunks in chunks_by_rank(stage_layers, ranks, p)]


def tied_allreduce_seconds(
    table: LayerTable,
    stage_layers: Sequence[tuple[int, int]],
    ranks: Sequence[int],
    p: int,
    t: int,
    d: int,
    devices_per_node: int,
    links: ResolvedLinks,
    element_bytes: int,
    hardware: Hardware | None = None,
) -> dict[int, float]:
    """Shared groups held by several ranks: their gradients are all-reduced among the holders."""
    holders: dict[str, set[int]] = {}
    shared_count: dict[str, int] = {}
    for stage, (start, end) in enumerate(stage_layers):
        for index in table.shared_layer_indices:
            if start <= index < end:
                group = table.shared_group[index]
                holders.setdefault(group, set()).add(ranks[stage])  # type: ignore[arg-type]
                shared_count[group] = table.shared_parameter_count[index]  # type: ignore[index]
    extra: dict[int, float] = {}
    for group, ranks in holders.items():
        if len(ranks) < 2:
            continue
        ordered = sorted(ranks)
        inside = all(ranks_share_node(ordered[0], r, p, t, d, devices_per_node) for r in ordered[1:])
        link: LinkCost = links.allreduce_intra if inside else links.allreduce_inter
        gradient = element_bytes if hardware is None else gradient_bytes(hardware, element_bytes)
        seconds = link.ring_allreduce_seconds(shared_count[group] / table.divisor(t) * gradient, len(ordered))
        if hardware is not None:
            seconds += collective_handoff_seconds(hardware, len(ordered), inside)
        for rank in ordered:
            extra[rank] = extra.get(rank, 0.0) + seconds
    return extra


def stage_costs_for(
    candidate: Candidate, profile: ModelProfile, cluster: ClusterSpec, kind_profiles: Sequence[ModelProfile] = ()
) -> StageCosts:
    """Re-build the cost table of a plan's candidate (what `pipectl simulate` re-simulates).

    Heterogeneous candidates are costed on the node type of their first replica, with the profile
    made on its device where `kind_profiles` holds one (`profile_for`); every replica of a split,
    each on its kind, is `plan.hetero.replica_stage_costs`.
    """
    if candidate.device == "mixed":
        kind = candidate.replicas[0].device if candidate.replicas else cluster.node_types[0].device
    else:
        kind = candidate.device
    node_type = next(iter(cluster.nodes_of_kind(kind)), None)
    if node_type is None:
        raise UserInputError(
            f"cluster '{cluster.name}' has no '{kind}' devices, which the plan's candidate uses",
            hint=f"device kinds in the cluster: {', '.join(cluster.device_kinds)}",
        )
    if candidate.stage_layers[-1][1] != len(profile.layers):
        raise UserInputError(
            f"the plan cuts {candidate.stage_layers[-1][1]} layers but the profile has {len(profile.layers)}",
            hint="simulate with the profile the plan was made from",
        )
    profile = profile_for(node_type.device, profile, kind_profiles)
    hardware = hardware_for(cluster, profile, node_type)
    return stage_costs(
        profile,
        hardware,
        candidate.stage_layers,
        micro_batch_size=candidate.micro_batch_size,
        tensor_parallel=candidate.tensor_parallel,
        data_parallel=candidate.data_parallel,
        pipeline_parallel=candidate.pipeline_parallel,
        zero_stage=candidate.zero_stage,
        micro_batches=candidate.micro_batches,
        checkpoint_layers=candidate.checkpoint_layers,
        v_placement=ScheduleKind(candidate.schedule).v_placement,
        selective_recompute=candidate.selective_recompute,
    )


def replica_groups(candidate: Candidate) -> list[tuple[str, int]]:
    """The distinct (device kind, micro-batches) of a candidate's replicas, in replica order: one
    for an even layout, one per kind and share for a split (`Candidate.replicas`).

        >>> from pipectl.artifacts.plan import ReplicaShare
        >>> shares = [ReplicaShare(replica=0, device="p100", micro_batch_size=2, micro_batches=30, samples=60,
        ...                        gradient_weight=0.25), ReplicaShare(replica=1, device="v100-16gb",
        ...                        micro_batch_size=2, micro_batches=90, samples=180, gradient_weight=0.75)]
        >>> replica_groups_of(shares)
        [('p100', 30), ('v100-16gb', 90)]
    """
    if not candidate.replicas:
        return [(candidate.device, candidate.micro_batches)]
    return replica_groups_of(candidate.replicas)


def replica_groups_of(replicas) -> list[tuple[str, int]]:
    return list(dict.fromkeys((share.device, share.micro_batches) for share in replicas))
