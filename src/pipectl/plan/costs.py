"""From a profile, a cluster and candidate degrees to the simulator's cost table (`StageCosts`).

The devices a candidate's ranks take, and which link each message crosses, are `plan.placement`'s;
the data-parallel collectives and the table the simulator reads are `plan.cost_table`'s.

Per virtual stage and micro-batch (all seconds):

- compute: the profile's forward/backward time of the stage's layers at micro-batch b (interpolated,
  `layer_table`), scaled from the profiled device to the target by the ratio of their peak FLOP/s;
  with tensor parallelism, a profile with shard costs gives one rank's time directly (a block's
  shard, measured or derived; embeddings, final norm and head replicated, whole on every rank); a
  profile without divides every layer by t and charges the smaller per-device matrix products as a
  micro-batch t times smaller: x efficiency(b) / efficiency(b / t) from the device catalog;
- tensor-parallel communication (Megatron, Shoeybi et al. 2019 §3; Narayanan et al. 2021 §3.3): per
  transformer block two all-reduces of the b*s*h activation in the forward and two in the backward,
  ring all-reduces over the t devices of a node, or, for a group spanning t/n nodes, one ring over
  all t whose every step waits for an inter-node hop, at the bus bandwidth of the node's n NICs
  (`tensor_parallel_link`);
- recompute: one more forward, communication included (x4/3 of forward+backward: docs/design.md, 'Parameters and FLOPs'); whole
  stages as the schedule's R actions, or, with per-layer checkpointing, inside each backward;
- point-to-point: latency + bytes / bandwidth of the activation crossing each cut (the same bytes
  for its gradient on the way back), intra-node or inter-node by the placement rule (inter-node
  if any replica's cut crosses a node); docs/design.md, 'Cost model': 2 a / Bw per boundary, one a / Bw each way;
- data-parallel all-reduce, once per step per rank: ring all-reduce (Patarasuk & Yuan 2009) of the
  rank's gradient bytes over its d replicas; ZeRO-1's reduce-scatter + all-gather moves the same
  bytes (an engine that reduces 16-bit weights' gradients in fp32 moves 4 bytes a parameter in
  every gradient reduction, the parameters' all-gather still 2: `gradient_bytes`). Tied
  embeddings add an all-reduce of the shared table's gradient between the first and the last
  stage (Megatron's embedding group);
- optimizer step: Adam is memory-bound: it reads fp32 master weights, momentum, variance and the
  gradient and writes the first three and the 16-bit weights, about 28 bytes per parameter,
  at the device's memory bandwidth (ZeRO-1, 2, 3: each replica updates 1/d of them).

ZeRO-2 and ZeRO-3 (p = 1 only: DeepSpeed's pipeline engine refuses them, its ordinary engine runs
them; `sharded_data_parallel_seconds`). Both partition the gradients, so a layer's gradient is
reduce-scattered over the d replicas as soon as the backward has made it, in every micro-batch
(DeepSpeed reduces on every micro-step when gradients are partitioned, not once per step as
ZeRO-0/1 do), and ZeRO-3 partitions the weights too: each layer's weights are all-gathered
before its forward and again before its backward (ZeRO §7: 1.5x the volume of an all-reduce per
micro-batch; 2x with per-layer checkpointing, which gathers them for the recomputed forward too).
A ring all-gather or reduce-scatter of a layer's B bytes over d ranks takes
(d - 1)(latency + B / d / bandwidth), half a ring all-reduce (Thakur et al. 2005), on the intra- or
inter-node all-reduce link by the placement rule. ZeRO-3's run beside the compute, one collective
at a time, each hidden behind the layer computing while it runs (prefetch); ZeRO-2's reduce-scatters
run on the compute stream, as DeepSpeed runs them by default (`sharded_exposed_seconds`), and are
exposed whole:

    forward   gather(0) + sum_i max(0, gather(i) - forward(i - 1))             (ZeRO-3)
    backward  gather(L-1) + sum_j max(0, gather(j - 1) + scatter(j + 1) - backward(j))
              + scatter(0)                                                     (ZeRO-3)
              sum_j scatter(j)                                                 (ZeRO-2)

(while layer j runs its backward, the link gathers layer j - 1's weights and reduce-scatters the
gradient layer j + 1 has just made; nothing is left to hide layer 0's gradient behind; with
per-layer checkpointing layer j's window is its recomputed forward and its backward, and the link
gathers layer j's weights once more in it: the recomputation is a forward to DeepSpeed's hooks,
which partition the weights again after it), each
max(0, C - W) term never less than what the compute loses to the collective beside it
(`overlapped_exposed_seconds`: `OVERLAP_COMPUTE_SLOWDOWN`). The
exposed part of all m micro-batches is charged with the end-of-step collectives (one rank: where
it is charged does not change the step), plus, under ZeRO-2, the all-gather of the updated
parameters after the step (exposed, as ZeRO-0/1's all-reduce is: nothing overlaps the end of a
step). ZeRO-0/1's gradient all-reduce is not overlapped with the backward anywhere in the planner:
DeepSpeed's pipeline engine reduces after the last micro-batch (what the measured terms below count).

When the profile carries measured engine terms (`ModelProfile.runtime`, from
`profile.runtime_calibration`; used only on the device kind they were measured on) the step is
costed as the training engine really runs it (Varuna §4: calibrate once, scale-invariantly):

- each layer's forward/backward time x the engine's compute ratio at b (layers run colder inside a
  step than alone in the profiler's loop), plus per micro-batch and stage the engine's fixed
  forward and backward overhead (`LayerSeconds.stage_forward`/`stage_backward`);
- the end of the step per rank, replacing the bandwidth estimate of Adam: the measured fixed cost
  plus the measured cost per parameter held (gradient flattening, clipping, AdamW, copy-back);
- the collectives the engine adds at the end of a step, counted by instrumenting
  torch.distributed in real runs of DeepSpeed 0.19.8 with ZeRO-1 (which `pipectl launch`
  always uses): with d > 1 an all-gather of the updated parameters over the replicas (ring
  all-gather: half a ring all-reduce; Thakur et al. 2005) and two latency-bound all-reduces (the
  gradient norm and the loss); with p > 1 one latency-bound all-reduce of the gradient norm over
  the stages and one broadcast of the loss from the last stage;
- the host's sharing between ranks (measured with two ranks running the profiled model,
  `measure_host_sharing`): a blocking message between ranks of one node costs at least the
  measured *busy handoff* (the p2p latency of the node's links is raised to it in
  `hardware_for`); an intra-node all-reduce follows the ring model fitted to all-reduces timed
  right after both ranks computed (`busy_allreduce_*`, which replace the node's all-reduce
  figures; profiles without them add the busy handoff to each collective instead); and every
  rank's compute (layers, engine overheads, end of step) is multiplied by its measured slowdown:
  wall-clock / CPU time for one rank alone, or wall-clock with two ranks computing at once over
  the CPU time alone when the layout runs more than one rank on a node (`stage_costs`; measured
  for two ranks, used for any number). The profile's medians are close to CPU time; a step pays
  for the slices other jobs take and for what ranks sharing a host's caches and memory take from
  each other.

    >>> from pipectl.testing.profiles import synthetic_profile
    >>> from pipectl.cluster import local_cluster
    >>> from pipectl.plan.cost_table import stage_costs
    >>> profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu")
    >>> hardware = hardware_for(local_cluster(2), profile)
    >>> costs = stage_costs(profile, hardware, [(0, 3), (3, 7)], micro_batch_size=2, tensor_parallel=1, data_parallel=1)
    >>> [round(x, 4) for x in costs.forward_seconds]
    [0.048, 0.0488]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from pipectl.artifacts.cluster import ClusterSpec, NodeType, emulated_kind
from pipectl.artifacts.plan import Recompute
from pipectl.artifacts.profile import EngineFeatures, ModelProfile, RuntimeCosts
from pipectl.catalog import DTYPE_BYTES, GIB, DeviceSpec, get_device, load_catalog
from pipectl.cluster import LinkCost, ResolvedLinks, price_per_device_hour, resolve_links
from pipectl.errors import UserInputError
from pipectl.plan.layer_table import LayerTable, interpolate
from pipectl.plan.memory import MemoryBudget
from pipectl.plan.placement import tensor_group_spans_nodes, tensor_parallel_link
# All-reduces of a transformer block's activation per forward and per backward (Megatron).
TENSOR_PARALLEL_ALLREDUCES_FORWARD = 2
TENSOR_PARALLEL_ALLREDUCES_BACKWARD = 2
TRANSFORMER_BLOCK = "transformer_block"
# Vocabulary-parallel embedding and head (`EngineFeatures.vocab_parallel`): the embedding's forward
# all-reduces (or, sequence-parallel, reduce-scatters) its b s h output; the head's input gradient
# is all-reduced in its backward (sequence-parallel: the forward's all-gather and the backward's
# reduce-scatter, the same ring time in all).
VOCAB_PARALLEL_KINDS = ("embedding", "lm_head")
# Compute that runs beside a collective runs slower: the collective's kernels take SMs and memory
# bandwidth from it. Measured with GPT and Llama training on 4 A100, H100, MI250 and MI210: 18.9 %
# slower on average, at most 40.0 % ("Characterizing Compute-Communication Overlap in
# GPU-Accelerated Distributed Deep Learning: Performance and Power Implications", arXiv 2507.03114,
# 2025, abstract). Used for every overlap the planner prices (`overlapped_exposed_seconds`).
OVERLAP_COMPUTE_SLOWDOWN = 0.189


@dataclass(frozen=True)
class Hardware:
    """One homogeneous pool of devices, as the cost model needs it."""

    device: DeviceSpec
    devices_per_node: int
    devices: int
    links: ResolvedLinks
    price_per_device_hour: float
    peak_ratio: float = 1.0  # profiled device's peak FLOP/s over this device's (`compute_scale`)
    node_type: str = ""
    runtime: RuntimeCosts | None = None  # measured engine terms (same device kind only)
    memory_headroom: float = 0.0  # fraction of each device's memory the plan keeps free
    measured_memory_bytes: int | None = None  # the device's total as a profile on it measured
    emulated_slowdown: float = 1.0  # NodeType.compute_slowdown
    # Another engine's features the profile was derived for (`ModelProfile.engine`); None: pipectl's.
    features: EngineFeatures | None = None
    # fp16 training: loss scaling's passes over the gradients in the optimizer step (`cost_table`).
    loss_scaled: bool = False
    # A split over device kinds (`hetero._on_one_ring`): the data-parallel ring runs through every
    # kind's nodes, so it leaves the node wherever its replicas sit; tensor-parallel and pipeline
    # collectives stay on the kind's own links.
    replicas_span_nodes: bool = False

    @property
    def compute_scale(self) -> float:
        """A profiled layer's time -> its time on this pool: the peak ratio, times the emulated slowdown."""
        return self.peak_ratio * self.emulated_slowdown

    @property
    def kind(self) -> str:
        """What a candidate's `device` names: the catalog device, or the nodes' emulated slower kind."""
        if self.emulated_slowdown == 1.0:
            return self.device.name
        return emulated_kind(self.device.name, self.emulated_slowdown)

    @property
    def memory_budget(self) -> MemoryBudget:
        """A rank's memory: the measured total, else the catalog's; what sits outside the
        allocator and the allocator's overhead from the catalog."""
        device = self.device
        return MemoryBudget(
            device_bytes=self.measured_memory_bytes or device.memory_bytes,
            outside_allocator_bytes=int(device.outside_allocator_gib * GIB),
            allocator_overhead=device.allocator_overhead,
            headroom=self.memory_headroom,
        )

    @property
    def memory_bytes(self) -> float:
        """What a rank's tensors may add up to (allocated bytes): the planner's capacity."""
        return self.memory_budget.allocatable_bytes


def compute_scale(profile: ModelProfile, device: DeviceSpec) -> float:
    """How much longer (>1) or shorter (<1) a profiled layer takes on `device`: peak FLOP/s ratio.

    1.0 when the profile was made on this device kind (or on a device the catalog does not know).
    """
    if profile.device == device.name:
        return 1.0
    catalog = load_catalog()
    if profile.device not in catalog:
        return 1.0
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "float32"
    source = catalog[profile.device].peak_flops_per_second(dtype)
    return source / device.peak_flops_per_second(dtype)


def profile_for(device: str, profile: ModelProfile, kind_profiles: Sequence[ModelProfile] = ()) -> ModelProfile:
    """The profile made on `device` (a catalog device), else `profile`, whose layer times are
    then scaled by the ratio of the two devices' peak FLOP/s (`compute_scale`)."""
    return next((p for p in [profile, *kind_profiles] if p.device == device), profile)


def hardware_for(
    cluster: ClusterSpec, profile: ModelProfile, node_type: NodeType | str | None = None, *, memory_headroom: float = 0.0
) -> Hardware:
    """The pool of one node type (the first one by default); every node type of a homogeneous
    cluster has the same device, and the pool counts all of them. `memory_headroom`: the fraction
    of each device's memory the plan keeps free."""
    if node_type is None:
        node_type = cluster.node_types[0]
    elif isinstance(node_type, str):
        node_type = next((n for n in cluster.node_types if n.name == node_type), None)  # type: ignore[assignment]
        if node_type is None:
            raise UserInputError(f"cluster '{cluster.name}' has no node type '{node_type}'")
    same_kind = cluster.nodes_of_kind(node_type.kind)
    device = get_device(node_type.device)
    if profile.engine is not None and profile.engine.blocking_p2p and not device.blocking_p2p:
        device = device.model_copy(update={"blocking_p2p": True})  # the engine's transfers are rendezvous
    runtime = runtime_for(profile, device)
    return Hardware(
        device=device,
        devices_per_node=min(n.devices_per_node for n in same_kind),
        devices=sum(n.devices for n in same_kind),
        links=with_busy_handoff(resolve_links(cluster, node_type), runtime),
        price_per_device_hour=price_per_device_hour(cluster, node_type),
        peak_ratio=compute_scale(profile, device),
        node_type=node_type.name,
        runtime=runtime,
        memory_headroom=memory_headroom,
        measured_memory_bytes=profile.device_memory_bytes if profile.device == device.name else None,
        emulated_slowdown=node_type.compute_slowdown,
        features=profile.engine,
        loss_scaled=profile.dtype == "float16",
    )


def with_busy_handoff(links: ResolvedLinks, runtime: RuntimeCosts | None) -> ResolvedLinks:
    """Intra-node p2p latency raised to the measured busy handoff, when that is larger; intra-node
    all-reduce figures replaced by the busy all-reduce fit, when the profile has one.

    A stage's message arrives when the receiving rank runs again, not when the bytes land: that
    is what the handoff measures (module docstring). Likewise a collective after compute: the
    busy all-reduce was timed from both ranks having arrived, in the state a step reaches it.
    """
    if runtime is None:
        return links
    sources = dict(links.sources)
    if runtime.busy_handoff_seconds > links.intra_latency_seconds:
        links = replace(links, intra_latency_seconds=runtime.busy_handoff_seconds)
        sources["intra_latency"] = "profile runtime (busy handoff)"
    if busy_allreduce_measured(runtime):
        links = replace(
            links,
            allreduce_intra_latency_seconds=runtime.busy_allreduce_latency_seconds,
            allreduce_intra_bandwidth_bytes_per_second=runtime.busy_allreduce_bandwidth_bytes_per_second,
        )
        sources["allreduce_intra"] = "profile runtime (busy all-reduce)"
    return replace(links, sources=sources)


def busy_allreduce_measured(runtime: RuntimeCosts | None) -> bool:
    """Whether the profile has the busy all-reduce fit (latency and bandwidth)."""
    return (
        runtime is not None
        and runtime.busy_allreduce_latency_seconds > 0
        and runtime.busy_allreduce_bandwidth_bytes_per_second > 0
    )


def host_compute_slowdown(hardware: Hardware, ranks: int) -> float:
    """Wall-clock / CPU time of a rank's compute in a layout of `ranks` ranks (t*p*d): measured for
    two ranks at once if a node runs more than one of them, for one rank alone otherwise; 1
    without measured terms.

    A node running more ranks than its host has cores (`RuntimeCosts.host_cores`) shares them:
    while r ranks compute on c < r cores each gets c / r of one (processor sharing), so the
    measured slowdown of `concurrent_ranks` ranks is scaled by how much more over-subscribed r
    ranks are. Every rank is taken to compute at once, as in a data-parallel step or a pipeline's
    steady state; in the warm-up and cool-down fewer do, so a deep pipeline's step comes out
    somewhat long: with 2 cores, four ranks compute twice as slowly as two. In a pipeline the
    sharing shows in the step more than phase by phase (the forwards come out shorter than
    predicted and the waits longer); `benchmarks/calibration.py` measures how close the step is.
    """
    runtime = hardware.runtime
    if runtime is None:
        return 1.0
    on_node = min(ranks, hardware.devices_per_node)
    if on_node < 2:
        return runtime.alone_compute_slowdown
    return runtime.concurrent_compute_slowdown * core_sharing(on_node, runtime.host_cores) / core_sharing(
        runtime.concurrent_ranks, runtime.host_cores
    )


def core_sharing(ranks: int, cores: int) -> float:
    """How many times slower each of `ranks` ranks computing at once runs on `cores` cores than on
    a core of its own: ranks / cores when they outnumber the cores, else 1 (and 1 when the cores
    are not known, 0).

        >>> core_sharing(4, 2), core_sharing(3, 2), core_sharing(2, 2), core_sharing(4, 0)
        (2.0, 1.5, 1.0, 1.0)
    """
    if cores <= 0 or ranks <= cores:
        return 1.0
    return ranks / cores


def collective_handoff_seconds(hardware: Hardware, ring_size: int, inside_node: bool) -> float:
    """The busy handoff one blocking collective over `ring_size` ranks of one node waits (0 else;
    0 too when the busy all-reduce fit, which includes it, prices the collective)."""
    if hardware.runtime is None or ring_size < 2 or not inside_node or busy_allreduce_measured(hardware.runtime):
        return 0.0
    return hardware.runtime.busy_handoff_seconds


def runtime_for(profile: ModelProfile, device: DeviceSpec) -> RuntimeCosts | None:
    """The profile's measured engine terms if they apply to `device`: they were measured on it.

    An engine's overheads on one machine say little about another (other host CPU, other kernels
    and collectives), so a profile measured on `cpu` and planned for A100s keeps the datasheet
    model alone.
    """
    if profile.runtime is None or profile.device != device.name:
        return None
    return profile.runtime


def tensor_parallel_slowdown(device: DeviceSpec, micro_batch_size: int, tensor_parallel: int) -> float:
    """Extra time of a t-way split matrix product: efficiency(b) / efficiency(b / t) >= 1.

    Each device multiplies matrices t times narrower, about as efficient as a micro-batch t times
    smaller (the catalog's efficiency curve):

        >>> tensor_parallel_slowdown(get_device("a100-80gb"), 8, 1)
        1.0
    """
    if tensor_parallel == 1:
        return 1.0
    return device.efficiency(micro_batch_size) / device.efficiency(micro_batch_size / tensor_parallel)


@dataclass(frozen=True)
class LayerSeconds:
    """Per-layer forward and backward seconds on the target, for one (b, t); prefix sums included."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    forward_prefix: tuple[float, ...]
    backward_prefix: tuple[float, ...]
    # The engine's fixed cost per micro-batch of any stage (0 without measured runtime terms).
    forward_overhead: float = 0.0
    backward_overhead: float = 0.0
    # Prefix sums of the forwards per-layer checkpointing runs again in the backward (every
    # layer's but `layer_table.NOT_CHECKPOINTED_KINDS`'); empty: every layer's (`forward_prefix`).
    checkpointed_prefix: tuple[float, ...] = ()
    # Prefix sums of the attention cores' forwards selective recomputation runs again in the
    # backward (`LayerTable.attention_core_forward_seconds` at the layers' scale); empty: none.
    attention_core_prefix: tuple[float, ...] = ()

    def recomputed_attention(self, start: int, end: int) -> float:
        """What selective recomputation adds to the backward of a stage of layers [start, end)."""
        if not self.attention_core_prefix:
            return 0.0
        return self.attention_core_prefix[end] - self.attention_core_prefix[start]

    def recomputed_forward(self, start: int, end: int) -> float:
        """What per-layer checkpointing adds to the backward of a stage of layers [start, end)."""
        prefix = self.checkpointed_prefix or self.forward_prefix
        return prefix[end] - prefix[start]

    def stage_forward(self, start: int, end: int) -> float:
        """One micro-batch's forward through layers [start, end) as a stage: layers + overhead."""
        return self.forward_prefix[end] - self.forward_prefix[start] + self.forward_overhead

    def stage_backward(self, start: int, end: int) -> float:
        return self.backward_prefix[end] - self.backward_prefix[start] + self.backward_overhead

    def work(self, recompute: Recompute | bool) -> list[float]:
        """Per-layer time of one micro-batch's forward + backward (+ recompute forward: every
        layer's for whole stages, the checkpointed layers' for per-layer checkpointing, the
        attention cores' for selective recomputation)."""
        if recompute is Recompute.LAYER and self.checkpointed_prefix:
            return self._with_runs_again(self.checkpointed_prefix)
        if recompute is Recompute.SELECTIVE:
            return self._with_runs_again(self.attention_core_prefix or (0.0,) * (len(self.forward) + 1))
        factor = 2.0 if recompute else 1.0
        return [factor * f + b for f, b in zip(self.forward, self.backward)]

    def _with_runs_again(self, prefix: Sequence[float]) -> list[float]:
        """Per layer forward + backward + what its backward runs again (the steps of `prefix`)."""
        return [f + b + (after - before) for f, b, before, after in zip(self.forward, self.backward, prefix, prefix[1:])]


def _prefix(values: Sequence[float]) -> tuple[float, ...]:
    out = [0.0]
    for value in values:
        out.append(out[-1] + value)
    return tuple(out)


def engine_compute_ratios(runtime: RuntimeCosts | None, micro_batch_size: int) -> tuple[float, float]:
    """(forward, backward) ratio of the engine's compute to the profiled layers' at b.

    Linear between the measured sizes, flat beyond them (a ratio, unlike a time, does not grow
    with b); (1, 1) without measured terms.

        >>> from pipectl.artifacts.profile import EngineComputeRatio
        >>> runtime = RuntimeCosts(engine="e", forward_overhead_seconds=0, backward_overhead_seconds=0,
        ...     step_fixed_seconds=0, step_seconds_per_parameter=0, compute_ratios=[
        ...     EngineComputeRatio(micro_batch_size=2, forward_ratio=1.0, backward_ratio=1.2),
        ...     EngineComputeRatio(micro_batch_size=8, forward_ratio=1.3, backward_ratio=1.2)])
        >>> [round(r, 3) for r in engine_compute_ratios(runtime, 4)], engine_compute_ratios(runtime, 16)
        ([1.1, 1.2], (1.3, 1.2))
    """
    if runtime is None or not runtime.compute_ratios:
        return 1.0, 1.0
    points = sorted(runtime.compute_ratios, key=lambda r: r.micro_batch_size)
    low, high = points[0], points[-1]
    b = min(max(micro_batch_size, low.micro_batch_size), high.micro_batch_size)
    forward = interpolate([(r.micro_batch_size, r.forward_ratio) for r in points], b)
    backward = interpolate([(r.micro_batch_size, r.backward_ratio) for r in points], b)
    if b == low.micro_batch_size:  # interpolate scales in proportion below the first point
        forward, backward = low.forward_ratio, low.backward_ratio
    return forward, backward


def micro_batch_overheads(hardware: Hardware) -> tuple[float, float]:
    """(forward, backward) fixed seconds per micro-batch and stage: the measured engine terms', else
    another engine's fitted overhead (`EngineFeatures.micro_batch_overhead_seconds`), half to each
    direction; (0, 0) without either."""
    if hardware.runtime is not None:
        return hardware.runtime.forward_overhead_seconds, hardware.runtime.backward_overhead_seconds
    if hardware.features is not None:
        half = hardware.features.micro_batch_overhead_seconds / 2
        return half, half
    return 0.0, 0.0


def layer_seconds(table: LayerTable, hardware: Hardware, tensor_parallel: int) -> LayerSeconds:
    """Per-layer time on the target device at the table's b with t-way tensor parallelism.

    A table of whole layers (`layer_table` of a profile without shards) is divided by t and slowed
    by `tensor_parallel_slowdown`; a table of one tensor rank's figures (a profile with shards) is
    taken as it is: measured or derived shards, replicated layers whole. With measured engine terms (`hardware.runtime`) the layers take the engine's compute ratio at
    b and every stage the engine's fixed per-micro-batch overhead (module docstring).
    """
    t = tensor_parallel
    forward_ratio, backward_ratio = engine_compute_ratios(hardware.runtime, table.micro_batch_size)
    slowdown = tensor_parallel_slowdown(hardware.device, table.micro_batch_size, t)
    if table.divisor(t) == t:  # whole layers: each divided by t, at the efficiency of a t-times-smaller b
        scales = [hardware.compute_scale / t * slowdown] * table.layers
    else:  # one tensor rank's figures: shards and replicated layers as they are; divided ones slowed
        scales = [hardware.compute_scale * (slowdown if divided else 1.0) for divided in table.divided]
    forward = [f * scale * forward_ratio for f, scale in zip(table.forward_seconds, scales)]
    backward = [b * scale * backward_ratio for b, scale in zip(table.backward_seconds, scales)]
    if t > 1:
        ring = tensor_parallel_link(hardware.links, t, hardware.devices_per_node)
        forward_comm, backward_comm = tensor_parallel_communication(
            table, ring, t, hardware.features, issue_seconds=(hardware.device.kernel_overhead_us or 0.0) * 1e-6
        )
        # Transformer Engine's comm+GEMM overlap (Userbuffers) needs the group inside one NVLink
        # domain: a group spanning nodes runs its collectives unoverlapped (TransformerEngine issue
        # #1071, 2024: "only possible with single-node tensor-parallelism").
        overlap = bool(hardware.features and hardware.features.tensor_parallel_overlap) and not (
            tensor_group_spans_nodes(t, hardware.devices_per_node))
        for index in range(table.layers):
            forward[index] += exposed_tensor_parallel_seconds(forward_comm[index], forward[index], overlap)
            backward[index] += exposed_tensor_parallel_seconds(backward_comm[index], backward[index], overlap)
    forward_overhead, backward_overhead = micro_batch_overheads(hardware)
    return LayerSeconds(
        tuple(forward),
        tuple(backward),
        _prefix(forward),
        _prefix(backward),
        forward_overhead=forward_overhead,
        backward_overhead=backward_overhead,
        checkpointed_prefix=_prefix([f if table.checkpointed(i) else 0.0 for i, f in enumerate(forward)]),
        # The core's kernels at the layer's compute scale; no tensor-parallel communication (the
        # core is inside the split, between the all-reduces).
        attention_core_prefix=_prefix([
            core * scale * forward_ratio for core, scale in zip(table.attention_core_forward_seconds, scales)
        ]) if table.attention_core_forward_seconds else (),
    )


def tensor_parallel_communication(
    table: LayerTable, ring: LinkCost, tensor_parallel: int, features: EngineFeatures | None = None,
    issue_seconds: float = 0.0,
) -> tuple[list[float], list[float]]:
    """Per layer, the (forward, backward) seconds of one micro-batch's tensor-parallel collectives
    on a ring of t devices over `ring` (`tensor_parallel_link`: the node's all-reduce link, or the
    inter-node one for a group spanning nodes).

    Each transformer block: two all-reduces of its b s h output forward and two backward
    (Megatron; Shoeybi et al. 2019 §3). With sequence parallelism each all-reduce is an all-gather
    plus a reduce-scatter of the same whole b s h bytes: the same ring time (Korthikanti et al.
    2022, §4.2.2); the block's output is then 1/t of the sequence on each rank, so the whole is t
    times the table's output bytes. A collective is issued by the host like a kernel (the autograd
    function, the process group's stream handshake, the launch): one that moves less than the host
    takes to issue it (`issue_seconds`, the device's per-kernel overhead of a derived profile) costs
    that issue, as a kernel of a launch-bound phase does (`compute_model.phase_seconds`). The
    backward's second all-gather of the saved s/t norm outputs (for the weight gradients) runs
    beside the input-gradient GEMMs and is not charged. With a
    vocabulary-parallel embedding and head (`VOCAB_PARALLEL_KINDS`): one all-reduce of b s h in the
    embedding's forward and one in the head's backward. Replicated layers: none.

    One block of 100 MB (sequence-parallel: 12.5 MB a rank) over 8 ranks at 1 µs and 100 GB/s:
    2 x 14 x (1e-6 + 12.5e6 / 100e9) = 3.528 ms forward and backward either way:

        >>> from dataclasses import replace
        >>> from pipectl.artifacts.profile import EngineFeatures
        >>> from pipectl.cluster import LinkCost
        >>> from pipectl.plan.layer_table import layer_table
        >>> from pipectl.testing.profiles import synthetic_profile
        >>> link = LinkCost(1e-6, 100e9)
        >>> table = layer_table(synthetic_profile(blocks=1), 1)
        >>> table.kinds
        ('embedding', 'transformer_block', 'layer_norm', 'lm_head')
        >>> whole = replace(table, output_activation_bytes=(0.0, 100e6, 0.0, 0.0))
        >>> [round(x * 1e3, 3) for x in tensor_parallel_communication(whole, link, 8)[0]]
        [0.0, 3.528, 0.0, 0.0]
        >>> sp = EngineFeatures(name="e", sequence_parallel=True)
        >>> eighth = replace(table, output_activation_bytes=(0.0, 12.5e6, 0.0, 0.0))
        >>> [round(x * 1e3, 3) for x in tensor_parallel_communication(eighth, link, 8, sp)[1]]
        [0.0, 3.528, 0.0, 0.0]
    """
    t = tensor_parallel
    forward = [0.0] * table.layers
    backward = [0.0] * table.layers
    if t <= 1:
        return forward, backward
    sequence_parallel = bool(features and features.sequence_parallel)
    vocab_parallel = bool(features and features.vocab_parallel)
    whole = 0.0  # a block's whole b s h bytes, for the embedding's and head's collectives
    for index, kind in enumerate(table.kinds):
        if kind == TRANSFORMER_BLOCK:
            whole = table.output_activation_bytes[index] * (t if sequence_parallel else 1)
            break
    for index, kind in enumerate(table.kinds):
        if kind == TRANSFORMER_BLOCK:
            message = table.output_activation_bytes[index] * (t if sequence_parallel else 1)
            allreduce = max(ring.ring_allreduce_seconds(message, t), issue_seconds)
            forward[index] = TENSOR_PARALLEL_ALLREDUCES_FORWARD * allreduce
            backward[index] = TENSOR_PARALLEL_ALLREDUCES_BACKWARD * allreduce
        elif vocab_parallel and kind == "embedding":
            forward[index] = max(ring.ring_allreduce_seconds(whole, t), issue_seconds)
        elif vocab_parallel and kind == "lm_head":
            backward[index] = max(ring.ring_allreduce_seconds(whole, t), issue_seconds)
    return forward, backward


def exposed_tensor_parallel_seconds(communication: float, compute: float, overlapped: bool) -> float:
    """What a layer's tensor-parallel collectives add to its time: all of it, or, overlapped with
    its GEMMs (`EngineFeatures.tensor_parallel_overlap`: Megatron's --tp-comm-overlap pipelines
    each all-gather and reduce-scatter in chunks against the GEMM that consumes or produces it),
    what `overlapped_exposed_seconds` leaves of it.

        >>> exposed_tensor_parallel_seconds(0.002, 0.010, False), round(exposed_tensor_parallel_seconds(0.002, 0.010, True), 6)
        (0.002, 0.000318)
        >>> round(exposed_tensor_parallel_seconds(0.012, 0.010, True), 6)
        0.002
    """
    if not overlapped:
        return communication
    return overlapped_exposed_seconds(communication, compute)


def overlapped_exposed_seconds(communication: float, compute: float) -> float:
    """What a collective of `communication` seconds adds to `compute` seconds of work it runs
    beside: what outlasts that work, and never less than what the work loses to it. While the
    collective runs, the work runs `OVERLAP_COMPUTE_SLOWDOWN` slower, so a collective hidden
    whole still adds sigma / (1 + sigma) of its own time (15.9 %):

        >>> round(overlapped_exposed_seconds(0.002, 0.010), 6)   # hidden: 0.002 x 0.189 / 1.189
        0.000318
        >>> round(overlapped_exposed_seconds(0.012, 0.010), 6)   # outlasts the work
        0.002
        >>> overlapped_exposed_seconds(0.002, 0.0)               # nothing beside it
        0.002
    """
    lost = communication * OVERLAP_COMPUTE_SLOWDOWN / (1.0 + OVERLAP_COMPUTE_SLOWDOWN)
    return max(communication - compute, lost)
