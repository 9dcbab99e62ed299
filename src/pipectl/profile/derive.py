"""Derive a profile from a model's shape and a device's datasheet, without running anything.

For hardware we cannot reach (an A100 cluster, a 1 T-parameter model), each layer is the list of
kernels eager PyTorch runs for it, timed by `pipectl.profile.compute_model`: GEMMs with their
m, n, k at the device's sustained GEMM efficiency and wave quantization, flash (or unfused)
attention, element-wise work at the memory bandwidth, and a host overhead per kernel. Checked
against measured H100 block shards (tests/profile/test_compute_model.py,
benchmarks/derived_vs_measured.py). A catalog entry without the compute constants falls back to
the whole-training efficiency curve: time = FLOPs / (peak FLOP/s x efficiency(b)).
`forward_flops` keeps the matrix-multiply convention of Narayanan et al. 2021 (Appendix; docs/design.md, 'Parameters and FLOPs'):
24 b s h^2 + 4 b s^2 h per block, full attention even where a causal kernel skips half.

The layer list is exactly `pipectl.models.registry` builds it (embed, block.0 .. block.{l-1},
final_norm, head; input, hidden.i, classifier for MLPs), with the measured profiler's conventions
(`pipectl.profile.measure`): the tied head is charged the token table it uses (V*h parameters, all
of them shared with `embed`); saved bytes are what autograd keeps (the head's include the loss's
16-bit logit gradient, or with another engine's fp32 loss its fp32 log-softmax); and

    peak_memory_bytes = 2 x parameter bytes + saved + output + working

where working is the transient memory the layer's forward and backward allocate and free by the
end of its backward (the head's chunk of fp32 log-probabilities and its gradients, or an fp32 loss's
whole fp32 logits; gradients in flight). The
planner reads it back as max(0, peak - 2 x parameter_bytes - saved - output). So a derived and a
measured profile of one config line up layer by layer.

Parameter count. The layer list holds P + 2h parameters, P being the closed form of Narayanan et al. 2021, §5.1
P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)): the closed form counts the blocks, the token table
(once) and the position table, but not the final LayerNorm's weight and bias (2h).

    >>> from pipectl.catalog import get_device
    >>> from pipectl.models.registry import load_model_config
    >>> gpt3 = derive_profile(load_model_config("gpt3-175b"), get_device("a100-80gb"), [1, 8])
    >>> round(gpt3.parameter_count / 1e9, 1)
    174.6
    >>> block = gpt3.layers[1].cost(1)      # 24 b s h^2 + 4 b s^2 h FLOPs, ~75 % of 312 TFLOP/s
    >>> round(block.forward_flops / 1e12, 3), round(block.forward_seconds * 1e3, 2)
    (7.628, 31.57)

Tensor-parallel shards. Each transformer block also gets one rank's shard for t in
`tensor_parallel` (2, 4, 8, 16 by default; each t that divides the heads): `BlockShape(tensor_parallel=t)`
(column-parallel QKV and fc1, row-parallel proj and fc2, heads/t local heads, LayerNorms whole), its
kernels timed as above (small shards launch-bound), its saved bytes tensor by tensor (about
8 + 24/t bytes per token and hidden unit in 16-bit: the LayerNorms' inputs and the block's input
stay whole on every rank). Embeddings, final norm and head are replicated and have none.

    >>> h = 12288   # a rank holds 12h^2/t + 7h/t of the split matrices and biases, 6h whole
    >>> [(s.tensor_parallel, s.parameter_count == (12 * h * h + 7 * h) // s.tensor_parallel + 6 * h)
    ...  for s in gpt3.layers[1].shards]
    [(2, True), (4, True), (8, True), (16, True)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import replace

from pydantic import ValidationError

from pipectl.artifacts.model import ModelConfig, ModelFamily
from pipectl.artifacts.profile import (
    EngineFeatures,
    LayerCost,
    LayerProfile,
    ModelProfile,
    ProfileSource,
    ShardProfile,
)
from pipectl.catalog import DTYPE_BYTES, DeviceSpec, get_device
from pipectl.errors import UserInputError
from pipectl.io import validation_message
from pipectl.profile.compute_model import (
    Attention,
    ComputeDevice,
    Kernel,
    phase_seconds,
)
from pipectl.profile.layer_shapes import (
    LayerShape, LayerWork, block_shards, engine_shards, mlp_shapes, transformer_shapes,
)


# The tensor-parallel degrees a derived profile has block shards for (where they divide the heads):
# every t inside an 8-device node, and 16, the tensor group over two such nodes the planner
# searches by default (`plan.space.tensor_parallel_degrees`).
DEFAULT_SHARD_DEGREES = (2, 4, 8, 16)


def _check_micro_batch_sizes(micro_batch_sizes: Sequence[int]) -> list[int]:
    if not micro_batch_sizes:
        raise UserInputError("no micro-batch sizes given to derive a profile for")
    for size in micro_batch_sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UserInputError(f"micro-batch size {size!r} is not a positive integer")
    return sorted(set(micro_batch_sizes))


def _check_dtype(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise UserInputError(f"unknown dtype '{dtype}'", hint=f"known dtypes: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def gpt_parameters_closed_form(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) (Narayanan et al. 2021, §5.1)."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


def _curve_device(device: DeviceSpec, dtype: str, micro_batch_size: int) -> ComputeDevice:
    """Stand-in constants for a device without the compute model's: the catalog's efficiency at b
    for every product, no launch overhead, no wave quantization (one 'SM')."""
    efficiency = device.efficiency(micro_batch_size)
    bandwidth = device.memory_bandwidth_gbytes_per_second
    return ComputeDevice(
        name=device.name,
        peak_flops_per_second=device.peak_flops_per_second(dtype),
        memory_bytes_per_second=(bandwidth or float("inf")) * 1e9,
        gemm_efficiency=efficiency,
        attention_efficiency=efficiency,
        kernel_overhead_seconds=0.0,
        multiprocessors=1,
        bytes_per_element=DTYPE_BYTES[dtype],
    )


def _curve_seconds(kernels: list[Kernel], device: ComputeDevice) -> float:
    """All FLOPs at peak x efficiency(b), or all bytes at the datasheet bandwidth, whichever is longer."""
    flops = sum(kernel.flops for kernel in kernels)
    memory_bytes = sum(kernel.bytes_moved for kernel in kernels if kernel.flops == 0)
    return max(
        flops / (device.peak_flops_per_second * device.gemm_efficiency),
        memory_bytes / device.memory_bytes_per_second,
    )


def _layer_cost(
    shape: LayerShape, micro_batch_size: int, device: DeviceSpec, dtype: str, compute: ComputeDevice | None
) -> LayerCost:
    return _cost_of(shape, shape.parameter_count, shape.work, micro_batch_size, device, dtype, compute,
                    shape.forward_flops_per_sample)  # fmt: skip


def _shard_profile(
    shape: LayerShape, t: int, sizes: Sequence[int], device: DeviceSpec, dtype: str, compute: ComputeDevice | None
) -> ShardProfile:
    """One rank's shard of a split layer at t; its FLOPs are the layer's / t (every product splits)."""
    parameters, work = shape.shards[t]
    output = -(-shape.output_elements_per_sample // t) if shape.shard_output_divided else shape.output_elements_per_sample
    return ShardProfile(
        tensor_parallel=t,
        parameter_count=parameters,
        parameter_bytes=parameters * DTYPE_BYTES[dtype],
        costs=[
            _cost_of(shape, parameters, work, b, device, dtype, compute, shape.forward_flops_per_sample / t, output)
            for b in sizes
        ],
    )


def _cost_of(
    shape: LayerShape,
    parameter_count: int,
    work_of: Callable[[int, ComputeDevice], LayerWork],
    micro_batch_size: int,
    device: DeviceSpec,
    dtype: str,
    compute: ComputeDevice | None,
    forward_flops_per_sample: float,
    output_elements_per_sample: int | None = None,
) -> LayerCost:
    """One layer's costs at micro-batch b.

    Times: with the device's compute constants, the kernel model (`compute_model.phase_seconds`);
    without, the curve (`_curve_seconds`). Memory, the measured profiler's convention:

        peak_memory_bytes = 2 x parameter bytes (weights + gradients) + saved + output + working

    where working is the transient memory of the layer's forward and backward run alone (freed when
    its backward ends: fp32 logits and their gradients, gradients in flight, a fresh weight gradient
    before it is added into `.grad`). A reader recovers it as
    max(0, peak - 2 x parameter_bytes - saved - output).
    """
    b = micro_batch_size
    bytes_per_element = DTYPE_BYTES[dtype]
    if compute is not None:
        work = work_of(b, compute)
        forward_seconds = phase_seconds(work.forward, compute)
        backward_seconds = phase_seconds(work.backward, compute)
        core_seconds = None if work.attention_core_forward is None else phase_seconds(work.attention_core_forward, compute)
    else:
        curve = _curve_device(device, dtype, b)
        work = work_of(b, curve)
        forward_seconds = _curve_seconds(work.forward, curve)
        backward_seconds = _curve_seconds(work.backward, curve)
        core_seconds = None if work.attention_core_forward is None else _curve_seconds(work.attention_core_forward, curve)
    if output_elements_per_sample is None:
        output_elements_per_sample = shape.output_elements_per_sample
    output_bytes = output_elements_per_sample * b * bytes_per_element
    parameter_bytes = parameter_count * bytes_per_element
    return LayerCost(
        micro_batch_size=b,
        forward_seconds=forward_seconds,
        backward_seconds=backward_seconds,
        output_activation_bytes=output_bytes,
        saved_activation_bytes=int(work.saved_bytes),
        peak_memory_bytes=int(2 * parameter_bytes + work.saved_bytes + output_bytes + work.working_bytes),
        forward_flops=forward_flops_per_sample * b,
        attention_core_saved_bytes=work.attention_core_saved_bytes,
        attention_core_forward_seconds=core_seconds,
    )


def without_attention_core(profile: ModelProfile) -> ModelProfile:
    """The profile with no layer recording an attention core, so that the planner does not search
    selective recomputation: for a model whose blocks pipectl's runtime runs whole (an hf: model,
    even one of GPT-2's shape)."""

    def strip(costs: list[LayerCost]) -> list[LayerCost]:
        return [c.model_copy(update={"attention_core_saved_bytes": None, "attention_core_forward_seconds": None})
                for c in costs]

    layers = [
        layer.model_copy(update={
            "costs": strip(layer.costs),
            "shards": [shard.model_copy(update={"costs": strip(shard.costs)}) for shard in layer.shards],
        })
        for layer in profile.layers
    ]  # fmt: skip
    return profile.model_copy(update={"layers": layers})


def derive_profile(
    config: ModelConfig,
    device: DeviceSpec | str,
    micro_batch_sizes: Sequence[int],
    dtype: str | None = None,
    attention: Attention | str = Attention.FLASH,
    tensor_parallel: Sequence[int] = DEFAULT_SHARD_DEGREES,
    engine: EngineFeatures | None = None,
) -> ModelProfile:
    """A `ModelProfile` (source=derived) of `config` on `device`, from closed forms only.

    `dtype` defaults to the device's 16-bit training type: bfloat16, or float16 where the device
    has no bfloat16 (V100, P100, T4, K80), which is then refused.

    Layers, names, kinds, parameter counts and tie groups match `pipectl.models.build_model` on the
    same config; costs come from the kernel model (`pipectl.profile.compute_model`) where the
    catalog entry has its constants, else from FLOPs / (peak x efficiency(b)); memory from the byte
    counts documented on the helpers above. `device` is a `DeviceSpec` or a catalog name;
    `attention` is what the blocks are assumed to run: 'flash' (fused, the default) or 'unfused'.
    `tensor_parallel`: the degrees t whose block shards to derive too (those that divide the heads;
    t = 1 is the layers themselves). `engine`: another engine's features (`EngineFeatures`) the
    profile is of (sequence-parallel and fused blocks, vocabulary-parallel embedding and head,
    a sequence-parallel final norm), recorded in `ModelProfile.engine` for the planner, which
    prices its overlaps and plans it for comparison only; None: pipectl's runtime.
    """
    try:
        return _derive(config, device, micro_batch_sizes, dtype, attention, tensor_parallel, engine)
    except ValidationError as error:  # a figure beyond what a profile may hold (e.g. a huge b)
        raise UserInputError(
            f"the derived profile of '{config.name}' is out of range: {validation_message(error)}",
            hint="derive it for smaller micro-batch sizes (-b)",
        ) from None


def _derive(
    config: ModelConfig,
    device: DeviceSpec | str,
    micro_batch_sizes: Sequence[int],
    dtype: str | None,
    attention: Attention | str,
    tensor_parallel: Sequence[int],
    engine: EngineFeatures | None = None,
) -> ModelProfile:
    """`derive_profile`, whose figures the artifacts' validators check."""
    if isinstance(device, str):
        device = get_device(device)
    sizes = _check_micro_batch_sizes(micro_batch_sizes)
    if dtype is None:
        dtype = "bfloat16" if device.bf16 else "float16"
    _check_dtype(dtype)
    if dtype == "bfloat16" and not device.bf16:
        raise UserInputError(
            f"{device.name} has no bfloat16: its 16-bit training is float16 (with loss scaling)",
            hint="derive with --dtype float16 (the default on this device)",
        )
    attention = _check_attention(attention)
    transformer = config.family in (ModelFamily.GPT, ModelFamily.BERT)
    shapes = _shapes(config, attention, _check_tensor_parallel(tensor_parallel), engine)
    compute = ComputeDevice.of(device, dtype)
    if compute is not None and engine is not None and engine.launch_blocking:
        compute = replace(compute, launch_blocking=True)
    bytes_per_element = DTYPE_BYTES[dtype]

    # Layers that share a work function (a model's blocks) are priced once: the kernel model is
    # pure, and pricing 96 alike blocks 96 times was most of a derivation (and of a calibration's fit).
    priced: dict[tuple, Any] = {}

    def once(key: tuple, price: Callable[[], Any]) -> Any:
        if key not in priced:
            priced[key] = price()
        return priced[key]

    def costs(shape: LayerShape) -> list[LayerCost]:
        key = ("layer", id(shape.work), shape.parameter_count, shape.forward_flops_per_sample, shape.output_elements_per_sample)
        return once(key, lambda: [_layer_cost(shape, b, device, dtype, compute) for b in sizes])

    def shard(shape: LayerShape, t: int) -> ShardProfile:
        parameters, work = shape.shards[t]
        key = ("shard", id(work), t, parameters, shape.forward_flops_per_sample, shape.output_elements_per_sample,
               shape.shard_output_divided)
        return once(key, lambda: _shard_profile(shape, t, sizes, device, dtype, compute))

    layers = [
        LayerProfile(
            index=index,
            name=shape.name,
            kind=shape.kind,
            parameter_count=shape.parameter_count,
            parameter_bytes=shape.parameter_count * bytes_per_element,
            shared_group=shape.shared_group,
            shared_parameter_count=shape.shared_parameter_count,
            costs=costs(shape),
            shards=[shard(shape, t) for t in sorted(shape.shards)],
        )
        for index, shape in enumerate(shapes)
    ]
    notes = _notes(device, compute, attention if transformer else None, layers, engine)
    return ModelProfile(
        model=config.name,
        source=ProfileSource.DERIVED,
        device=device.name,
        dtype=dtype,
        micro_batch_sizes=sizes,
        seq_len=config.seq_len if transformer else None,
        hidden=config.hidden if transformer else None,
        vocab=config.vocab if transformer else None,
        layers=layers,
        notes=notes,
        engine=engine,
    )


def _shapes(
    config: ModelConfig, attention: Attention, degrees: list[int], engine: EngineFeatures | None
) -> list[LayerShape]:
    """The layer list, its blocks with their shards at `degrees` (and, for another engine's run, its
    other split layers' shards at the same degrees)."""
    if config.family not in (ModelFamily.GPT, ModelFamily.BERT):
        return mlp_shapes(config)
    shapes = transformer_shapes(config, attention, engine)
    if not degrees:
        return shapes
    shards = block_shards(config, attention, degrees, engine)
    sequence_parallel = bool(engine and engine.sequence_parallel)
    shapes = [replace(shape, shards=shards, shard_output_divided=sequence_parallel)
              if shape.kind == "transformer_block" else shape for shape in shapes]
    if engine is not None:
        split = sorted(shards)  # the degrees the blocks split at: every split layer has the same
        shapes = [engine_shards(shape, config, split, engine) if shape.kind != "transformer_block" else shape
                  for shape in shapes]
    return shapes


def _wave_words(compute: ComputeDevice) -> str:
    """The wave quantization a calibration fitted, where it is not the model's whole waves."""
    q = compute.wave_quantization
    return "" if q == 1.0 else f" with {q:.3g} of the modelled wave quantization"


def _notes(
    device: DeviceSpec,
    compute: ComputeDevice | None,
    attention: Attention | None,
    layers: list[LayerProfile],
    engine: EngineFeatures | None,
) -> list[str]:
    """How the figures were derived (that they are derived, and for which device, the profile's
    source and device say). `attention`: None for a model without attention."""
    notes = []
    if compute is not None:
        notes.append(
            f"time: kernel model (GEMMs {compute.gemm_efficiency:.3g} of peak{_wave_words(compute)}, attention "
            f"{compute.attention_efficiency:.3g}, element-wise by bandwidth, {compute.kernel_overhead_seconds * 1e6:.3g} µs/kernel)"
        )
    else:
        notes.append(
            f"time: FLOPs / (peak x efficiency(b)) or bytes / bandwidth; '{device.name}' has no compute "
            "constants in the catalog"
        )
    if attention is not None:
        notes.append(
            f"attention: {attention.value} ("
            + ("fused, no s x s scores kept" if attention is Attention.FLASH else "the s x s softmax output kept")
            + "); saved activations counted tensor by tensor"
        )
    notes.append("peak memory = 2 x parameters + saved + output + the layer's transient working memory")
    shard_degrees = sorted({s.tensor_parallel for layer in layers for s in layer.shards})
    if shard_degrees:
        notes.append(
            f"shards (t = {', '.join(map(str, shard_degrees))}): a rank's share of a block, compute only; "
            "embed, norm, head whole"
        )
    if engine is not None:
        notes.append(
            f"derived for a run of {engine.name} ({', '.join(engine.named) or 'no features'}): "
            "planned for comparison only, pipectl's runtimes do not run these features"
        )
    return notes


def _check_tensor_parallel(degrees: Sequence[int]) -> list[int]:
    for t in degrees:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise UserInputError(f"tensor-parallel degree {t!r} is not a positive integer")
    return sorted({t for t in degrees if t > 1})


def _check_attention(attention: Attention | str) -> Attention:
    try:
        return Attention(attention)
    except ValueError:
        known = ", ".join(a.value for a in Attention)
        raise UserInputError(f"unknown attention implementation '{attention}'", hint=f"known: {known}") from None
