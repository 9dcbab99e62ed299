"""Per-layer figures of a profile at any micro-batch size, as flat arrays with prefix sums.

The planner asks the same questions millions of times ("how long does layers [i, j) take at
b = 4?", "how many parameters do they hold?"). A `LayerTable` answers each in O(1) from prefix
sums instead of walking the profile's pydantic objects.

Micro-batch sizes the profile did not measure are interpolated linearly between the two nearest
measured sizes, and extrapolated linearly from the last two beyond the largest (clamped to be no
smaller than the largest measured value); below the smallest the value is scaled in proportion to b.
Linear in b is what the layers' work is (FLOPs and activation bytes grow with b); the measured
points carry the efficiency curve.

Tensor parallelism. A profile without shard costs gives one table per b of whole layers, and the
planner divides a rank's time, saved activations and parameters by t (`LayerTable.divisor`). A
profile with shard costs (`LayerProfile.shards`) gives, for t > 1, a table of what ONE tensor rank
runs and holds: a layer's shard at t where it has one, the whole layer where it has none (it is
replicated: embeddings, final norm, head), and for a layer that splits but has no shard at this t,
its time and saved bytes divided by t (`divided`; the planner adds the matrix-product slowdown) and
its parameters divided by t, rounded up. Measured shards of small layers are launch-bound and keep
the LayerNorm inputs whole on every rank, which a division by t misses (tests/profile/data/
h100-block-shards.json). FLOPs stay the whole layer's: they count the model's work, not a rank's.

    >>> from pipectl.testing.profiles import synthetic_profile
    >>> profile = synthetic_profile(blocks=2, micro_batch_sizes=[1, 4])  # linear in b
    >>> table = layer_table(profile, 2)  # b = 2 was not measured: interpolated
    >>> round(table.forward_seconds[1] / layer_table(profile, 1).forward_seconds[1], 3)
    2.0
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from pipectl.artifacts.plan import Recompute
from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile
from pipectl.errors import UserInputError

# Layer kinds per-layer activation checkpointing leaves alone: the language-model head keeps its
# saved activations (Megatron-LM checkpoints its transformer layers only, and the logits are not
# recomputed in Narayanan et al. 2021's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); the runtime's
# `PlannedPipelineModule` does not checkpoint them either).
NOT_CHECKPOINTED_KINDS = frozenset({"lm_head"})

# The cost fields interpolated over b, in LayerTable order.
_COST_FIELDS = (
    "forward_seconds",
    "backward_seconds",
    "output_activation_bytes",
    "saved_activation_bytes",
    "forward_flops",
)


def interpolate(points: Sequence[tuple[int, float]], micro_batch_size: float) -> float:
    """Value at b from (b, value) points, ascending in b: linear inside, linear beyond the ends.

    >>> interpolate([(1, 1.0), (4, 2.5)], 2)
    1.5
    >>> interpolate([(1, 1.0), (4, 2.5)], 8)
    4.5
    >>> interpolate([(2, 4.0)], 1)
    2.0
    """
    if micro_batch_size <= 0:
        raise UserInputError(f"micro-batch size must be positive, got {micro_batch_size}")
    sizes = [size for size, _ in points]
    if len(points) == 1 or micro_batch_size < sizes[0]:
        size, value = points[0]
        return value * micro_batch_size / size
    for (low_size, low_value), (high_size, high_value) in zip(points, points[1:]):
        if micro_batch_size <= high_size:
            weight = (micro_batch_size - low_size) / (high_size - low_size)
            return low_value + weight * (high_value - low_value)
    (low_size, low_value), (high_size, high_value) = points[-2], points[-1]
    slope = (high_value - low_value) / (high_size - low_size)
    return max(high_value, high_value + slope * (micro_batch_size - high_size))


def _at(points: Sequence[tuple[int, float]], micro_batch_size: int) -> float:
    """The value at b: the measured point itself, else interpolated over b."""
    exact = next((value for size, value in points if size == micro_batch_size), None)
    return exact if exact is not None else interpolate(points, micro_batch_size)


def _cost_at(layer: LayerProfile, micro_batch_size: int, field: str, costs: Sequence[LayerCost] | None = None) -> float:
    """A cost field at b from the layer's costs (or `costs`, a shard's), interpolated over b."""
    costs = layer.costs if costs is None else costs
    return _at([(c.micro_batch_size, float(getattr(c, field))) for c in costs], micro_batch_size)


# The attention core's figures (`LayerCost.attention_core_*`), interpolated over b like the cost
# fields; a cost that does not record them counts 0 (nothing to recompute, nothing freed).
_ATTENTION_CORE_FIELDS = ("attention_core_saved_bytes", "attention_core_forward_seconds")


def _core_at(costs: Sequence[LayerCost], micro_batch_size: int, field: str) -> float:
    return _at([(c.micro_batch_size, float(getattr(c, field) or 0.0)) for c in costs], micro_batch_size)


def _working_at(layer: LayerProfile, micro_batch_size: int, tensor_parallel: int = 1) -> float:
    """The layer's working memory at b (its shard's at t, when it has one), interpolated over b
    like the cost fields."""
    shard = layer.shard(tensor_parallel) if tensor_parallel > 1 else None
    holder = shard if shard is not None else layer
    return _at([(c.micro_batch_size, float(holder.working_memory_bytes(c))) for c in holder.costs], micro_batch_size)


def _prefix(values: Sequence[float]) -> tuple[float, ...]:
    return (0.0, *accumulate(values))


@dataclass(frozen=True)
class LayerTable:
    """Per-layer figures at one micro-batch size, plus prefix sums for O(1) range queries.

    Ranges are half-open: `range_sum(prefix, i, j)` covers layers i..j-1.
    """

    micro_batch_size: int
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    forward_seconds: tuple[float, ...]
    backward_seconds: tuple[float, ...]
    output_activation_bytes: tuple[float, ...]
    saved_activation_bytes: tuple[float, ...]
    forward_flops: tuple[float, ...]
    working_bytes: tuple[float, ...]  # `LayerProfile.working_memory_bytes`: transient, not divided by t
    parameter_count: tuple[int, ...]
    shared_group: tuple[str | None, ...]
    shared_parameter_count: tuple[int, ...]
    # Prefix sums (length layers + 1).
    forward_prefix: tuple[float, ...]
    backward_prefix: tuple[float, ...]
    saved_prefix: tuple[float, ...]
    parameter_prefix: tuple[float, ...]
    shared_layer_indices: tuple[int, ...]
    # The degree t whose one tensor rank these figures are for; 1: whole layers (module docstring).
    tensor_parallel: int = 1
    # Per layer, in a table for t > 1: whether its time and saved bytes are the whole layer's / t
    # (a layer that splits but has no shard at t); empty for whole-layer tables.
    divided: tuple[bool, ...] = ()
    # Per layer: the attention core's saved bytes (part of `saved_activation_bytes`) and forward
    # time, what selective recomputation frees and adds (`LayerCost.attention_core_*`); empty: none.
    attention_core_saved_bytes: tuple[float, ...] = ()
    attention_core_forward_seconds: tuple[float, ...] = ()

    @property
    def layers(self) -> int:
        return len(self.names)

    def divisor(self, tensor_parallel: int) -> int:
        """What a rank's time, saved bytes and parameters are divided by at degree t: t for a table
        of whole layers, 1 for a table of one tensor rank's figures (which must be this t's)."""
        if self.tensor_parallel == 1:
            return tensor_parallel
        if tensor_parallel != self.tensor_parallel:
            raise ValueError(f"a table of t={self.tensor_parallel} ranks asked for t={tensor_parallel}")
        return 1

    def forward(self, start: int, end: int) -> float:
        return self.forward_prefix[end] - self.forward_prefix[start]

    def backward(self, start: int, end: int) -> float:
        return self.backward_prefix[end] - self.backward_prefix[start]

    def saved(self, start: int, end: int) -> float:
        return self.saved_prefix[end] - self.saved_prefix[start]

    def parameters(self, start: int, end: int) -> int:
        """Parameters held by a stage of layers [start, end): a shared group counts once per stage."""
        total = int(self.parameter_prefix[end] - self.parameter_prefix[start])
        shared = self.shared_layer_indices
        if bisect_left(shared, end) - bisect_left(shared, start) < 2:
            return total  # at most one holder of a shared group here: nothing counted twice
        seen: set[str] = set()
        for index in self._shared_indices_in(start, end):
            group = self.shared_group[index]
            if group in seen:
                total -= self.shared_parameter_count[index]
            seen.add(group)  # type: ignore[arg-type]
        return total

    def _shared_indices_in(self, start: int, end: int) -> list[int]:
        return [i for i in self.shared_layer_indices if start <= i < end]

    def working(self, start: int, end: int) -> float:
        """The largest working memory of layers [start, end) (0 for an empty range)."""
        return max(self.working_bytes[start:end], default=0.0)

    def input_activation_bytes(self, start: int) -> float:
        """Bytes a stage starting at `start` receives (0 for the first stage: its input is tokens)."""
        return self.output_activation_bytes[start - 1] if start > 0 else 0.0

    def checkpointed(self, index: int) -> bool:
        """Whether per-layer checkpointing recomputes layer `index` (all but `NOT_CHECKPOINTED_KINDS`)."""
        return self.kinds[index] not in NOT_CHECKPOINTED_KINDS

    def checkpoint_kept(self, index: int, divisor: int) -> float:
        """What layer `index` keeps per in-flight micro-batch under per-layer checkpointing: its
        input (the previous layer's output, whole on every tensor rank; tokens for the first: 0),
        or, for a layer it leaves alone, its saved activations / `divisor` (`divisor(t)`)."""
        if self.checkpointed(index):
            return self.input_activation_bytes(index)
        return self.saved_activation_bytes[index] / divisor

    def layer_inputs(self, start: int, end: int, divisor: int = 1) -> float:
        """What a stage of layers [start, end) keeps per in-flight micro-batch under per-layer
        checkpointing: the sum of `checkpoint_kept`, in layer order."""
        return float(sum(self.checkpoint_kept(index, divisor) for index in range(start, end)))

    def largest_saved(self, start: int, end: int) -> float:
        """The largest saved activations of one checkpointed layer of [start, end) (0 if none): what
        per-layer checkpointing holds while a layer is recomputed for its backward."""
        return max((self.saved_activation_bytes[i] for i in range(start, end) if self.checkpointed(i)), default=0.0)

    def attention_core_saved(self, index: int) -> float:
        """The attention core's saved bytes of layer `index` (0 where none is recorded)."""
        return self.attention_core_saved_bytes[index] if self.attention_core_saved_bytes else 0.0

    def selective_kept(self, index: int, divisor: int) -> float:
        """What layer `index` keeps per in-flight micro-batch under selective recomputation: its
        saved activations less its attention core's, / `divisor` (`divisor(t)`)."""
        return (self.saved_activation_bytes[index] - self.attention_core_saved(index)) / divisor

    def selective_saved(self, start: int, end: int, divisor: int = 1) -> float:
        """What a stage of layers [start, end) keeps per in-flight micro-batch under selective
        recomputation: the sum of `selective_kept`, in layer order."""
        return float(sum(self.selective_kept(index, divisor) for index in range(start, end)))

    def largest_attention_core(self, start: int, end: int) -> float:
        """The largest attention core's saved bytes of [start, end) (0 if none): what selective
        recomputation holds again while one block's core is recomputed for its backward."""
        return max((self.attention_core_saved(i) for i in range(start, end)), default=0.0)

    def total_forward_flops(self) -> float:
        return sum(self.forward_flops)


def build_layer_table(layers: Sequence[LayerProfile], micro_batch_size: int, tensor_parallel: int = 1) -> LayerTable:
    """The layers' figures at b: whole layers (t = 1), or one tensor rank's at t (module docstring)."""
    if tensor_parallel > 1:
        return _rank_table(layers, micro_batch_size, tensor_parallel)
    columns = {field: [_cost_at(layer, micro_batch_size, field) for layer in layers] for field in _COST_FIELDS}
    for field in _ATTENTION_CORE_FIELDS:
        columns[field] = [_core_at(layer.costs, micro_batch_size, field) for layer in layers]
    return _table(
        layers, micro_batch_size, columns, [layer.parameter_count for layer in layers],
        [layer.shared_parameter_count for layer in layers],
    )


def _ceil_div(value: int, divisor: int) -> int:
    return -(-value // divisor)


def _rank_table(layers: Sequence[LayerProfile], b: int, t: int) -> LayerTable:
    """One tensor rank's figures at t: its shard, the whole replicated layer, or a split layer / t."""
    columns: dict[str, list[float]] = {field: [] for field in (*_COST_FIELDS, *_ATTENTION_CORE_FIELDS)}
    parameters: list[int] = []
    shared: list[int] = []
    divided: list[bool] = []
    for layer in layers:
        shard = layer.shard(t)
        estimate = shard is None and bool(layer.shards)
        for field in _COST_FIELDS:
            if field == "forward_flops" or (shard is None and not estimate):
                value = _cost_at(layer, b, field)  # the whole layer: FLOPs, or a replicated layer
            elif shard is not None:
                value = _cost_at(layer, b, field, shard.costs)
            else:
                value = _cost_at(layer, b, field)
                if field != "output_activation_bytes":  # a split layer's output is whole on every rank
                    value = value / t
            columns[field].append(value)
        for field in _ATTENTION_CORE_FIELDS:
            # A shard's own figures; a shard that records none (measured shards), and a split layer
            # without a shard, the layer's / t (its heads split t ways); a replicated layer's whole.
            own = shard is not None and shard.costs[0].attention_core_saved_bytes is not None
            value = _core_at(shard.costs if own else layer.costs, b, field)
            columns[field].append(value / t if (estimate or (shard is not None and not own)) else value)
        if shard is not None:
            parameters.append(shard.parameter_count)
            shared.append(min(shard.parameter_count, layer.shared_parameter_count))
        elif estimate:
            parameters.append(_ceil_div(layer.parameter_count, t))
            shared.append(_ceil_div(layer.shared_parameter_count, t))
        else:
            parameters.append(layer.parameter_count)
            shared.append(layer.shared_parameter_count)
        divided.append(estimate)
    return _table(layers, b, columns, parameters, shared, tensor_parallel=t, divided=tuple(divided))


def _table(
    layers: Sequence[LayerProfile], b: int, columns: dict[str, list[float]], parameters: list[int],
    shared: list[int], *, tensor_parallel: int = 1, divided: tuple[bool, ...] = (),
) -> LayerTable:
    """A `LayerTable` of per-layer columns at b, with its prefix sums."""
    return LayerTable(
        micro_batch_size=b,
        names=tuple(layer.name for layer in layers),
        kinds=tuple(layer.kind for layer in layers),
        forward_seconds=tuple(columns["forward_seconds"]),
        backward_seconds=tuple(columns["backward_seconds"]),
        output_activation_bytes=tuple(columns["output_activation_bytes"]),
        saved_activation_bytes=tuple(columns["saved_activation_bytes"]),
        forward_flops=tuple(columns["forward_flops"]),
        working_bytes=tuple(_working_at(layer, b, tensor_parallel) for layer in layers),
        parameter_count=tuple(parameters),
        shared_group=tuple(layer.shared_group for layer in layers),
        shared_parameter_count=tuple(shared),
        forward_prefix=_prefix(columns["forward_seconds"]),
        backward_prefix=_prefix(columns["backward_seconds"]),
        saved_prefix=_prefix(columns["saved_activation_bytes"]),
        parameter_prefix=_prefix(parameters),
        shared_layer_indices=tuple(i for i, layer in enumerate(layers) if layer.shared_group),
        tensor_parallel=tensor_parallel,
        divided=divided,
        attention_core_saved_bytes=tuple(columns["attention_core_saved_bytes"]),
        attention_core_forward_seconds=tuple(columns["attention_core_forward_seconds"]),
    )


# (id(profile), b, t) -> (profile, table). The profile is kept so its id cannot be reused while cached.
_TABLES: dict[tuple[int, int, int], tuple[ModelProfile, LayerTable]] = {}
_TABLES_MAX = 512


def layer_table(profile: ModelProfile, micro_batch_size: int, tensor_parallel: int = 1) -> LayerTable:
    """The profile's layers at micro-batch size b (measured, or interpolated; cached per profile):
    whole layers, or, for t > 1 in a profile with shard costs, one tensor rank's figures."""
    key = (id(profile), micro_batch_size, tensor_parallel)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]  # checked when it was built
    if tensor_parallel > 1 and not profile.has_shards:
        table = layer_table(profile, micro_batch_size)  # whole layers, divided by t where they are used
    else:
        if not profile.layers:
            raise UserInputError(f"profile of '{profile.model}' has no layers")
        empty = [layer.name for layer in profile.layers if not layer.costs]
        if empty:
            raise UserInputError(f"profile of '{profile.model}': layer '{empty[0]}' has no costs")
        empty = [f"{layer.name} (t={s.tensor_parallel})" for layer in profile.layers for s in layer.shards if not s.costs]
        if empty:
            raise UserInputError(f"profile of '{profile.model}': the shard of layer {empty[0]} has no costs")
        table = build_layer_table(profile.layers, micro_batch_size, tensor_parallel)
    if len(_TABLES) >= _TABLES_MAX:
        _TABLES.clear()
    _TABLES[key] = (profile, table)
    return table


# Selective recomputation freeing less than this share of each layer's saved bytes changes what
# fits by less than the memory model's own margins (the allocator's reserve, 6 % on an H100, and
# --memory-headroom, 5 % by default). Flash attention keeps only its log-sum-exp in the core (0.1 %
# of a GPT block's saved bytes): beside full recomputation its families would only lengthen a
# large search (GPT-1T on 3,072 A100s: a sixth of the search's time), never change its plan.
SELECTIVE_MIN_SHARE = 0.01


def selective_frees_little(profile: ModelProfile) -> bool:
    """Whether selective recomputation frees under `SELECTIVE_MIN_SHARE` of every layer's saved
    bytes, at every profiled micro-batch size."""
    return all(
        (cost.attention_core_saved_bytes or 0) < SELECTIVE_MIN_SHARE * cost.saved_activation_bytes
        for layer in profile.layers for cost in layer.costs
        if cost.attention_core_saved_bytes
    )


def offered_granularities(requested: Sequence[Recompute], profile: ModelProfile) -> tuple[Recompute, ...]:
    """The recomputation granularities the search tries: those asked for, less selective
    recomputation where the profile records no attention core (`ModelProfile.records_attention_core`:
    older measured profiles, Hugging Face blocks, which pipectl's runtime cannot recompute
    selectively). Asked for alone (`--recompute selective`), that is an error that says why.
    Asked for beside full recomputation (`auto`, `always`), it is left out where it frees little
    (`selective_frees_little`: flash attention); asked for alone, it is searched all the same.

        >>> from pipectl.testing.profiles import synthetic_profile
        >>> offered_granularities((Recompute.NONE, Recompute.LAYER, Recompute.SELECTIVE), synthetic_profile(blocks=2))
        (<Recompute.NONE: 0>, <Recompute.LAYER: 2>)
    """
    requested = tuple(requested)
    if Recompute.SELECTIVE in requested and profile.records_attention_core:
        if set(requested) - {Recompute.NONE, Recompute.SELECTIVE} and selective_frees_little(profile):
            # Beside full recomputation (`auto`, `always`) it only adds families to search.
            return tuple(granularity for granularity in requested if granularity is not Recompute.SELECTIVE)
        return requested
    if Recompute.SELECTIVE not in requested:
        return requested
    left = tuple(granularity for granularity in requested if granularity is not Recompute.SELECTIVE)
    if set(left) <= {Recompute.NONE}:
        raise UserInputError(
            f"the profile of '{profile.model}' records no attention core (time and saved bytes), which selective "
            "recomputation is priced from",
            hint="re-run `pipectl profile` (it measures the core of pipectl's transformer blocks; Hugging Face "
            "blocks have none), or plan with --recompute layer",
        )
    return left
