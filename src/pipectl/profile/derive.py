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
fp32 log-softmax); and

    peak_memory_bytes = 2 x parameter bytes + saved + output + working

where working is the transient memory the layer's forward and backward allocate and free by the
end of its backward (the fp32 logits and their gradients in the head, gradients in flight). The
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
from dataclasses import dataclass, field, replace

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
    FP32_BYTES,
    TOKEN_ID_BYTES,
    Attention,
    BlockShape,
    ComputeDevice,
    Kernel,
    rms_norm_backward_kernels,
    rms_norm_forward_kernels,
    block_backward_kernels,
    block_forward_kernels,
    block_saved_bytes,
    block_working_bytes,
    attention_core_forward_kernels,
    attention_core_saved_bytes,
    gemm_kernel,
    memory_kernel,
    phase_seconds,
)


# The tensor-parallel degrees a derived profile has block shards for (where they divide the heads):
# every t inside an 8-device node, and 16, the tensor group over two such nodes the planner
# searches by default (`plan.space.tensor_parallel_degrees`).
DEFAULT_SHARD_DEGREES = (2, 4, 8, 16)


@dataclass(frozen=True)
class _Work:
    """What one layer does at one micro-batch size: its kernels (forward, backward) and its bytes."""

    forward: list[Kernel]
    backward: list[Kernel]
    saved_bytes: int
    working_bytes: int  # transient: freed when the layer's backward ends (see _layer_cost)
    # A block whose runtime recomputes its attention core selectively: the core's forward kernels
    # and the saved bytes that frees (`compute_model.attention_core_*`); None: not recorded.
    attention_core_forward: list[Kernel] | None = None
    attention_core_saved_bytes: int | None = None


@dataclass(frozen=True)
class _LayerShape:
    """One layer of the list; `work(b, device)` builds its kernels at micro-batch b."""

    name: str
    kind: str
    parameter_count: int
    shared_group: str | None
    shared_parameter_count: int
    forward_flops_per_sample: float  # matrix-multiply FLOPs (Narayanan et al. 2021 convention)
    output_elements_per_sample: int  # in the profile's dtype
    work: Callable[[int, ComputeDevice], _Work]
    # Tensor-parallel degree t -> (one rank's parameters, its work at b); empty: not split.
    shards: dict[int, tuple[int, Callable[[int, ComputeDevice], _Work]]] = field(default_factory=dict)
    # Whether a shard's output is 1/t of the layer's (sequence parallelism: the s/t tokens a rank
    # keeps; a vocabulary-parallel head: V/t logits); otherwise whole on every rank.
    shard_output_divided: bool = False


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


def _accumulate(name: str, elements: int, device: ComputeDevice) -> Kernel:
    """A parameter's new gradient added into its `.grad`: read both, write one."""
    return memory_kernel(f"{name} gradient accumulation", 3 * elements * device.bytes_per_element, device)


def _block_shape(
    config: ModelConfig, attention: Attention, b: int, t: int = 1, engine: EngineFeatures | None = None
) -> BlockShape:
    """The config's block (GPT-2's, or a Hugging Face decoder's) at micro-batch b on t ranks, as
    pipectl's runtime runs it or, with `engine`, as that engine does (sequence parallel, fused)."""
    return BlockShape(
        config.hidden, config.heads, config.seq_len, b, t, ffn_multiplier=config.ffn_multiplier,
        causal=config.family is ModelFamily.GPT, attention=attention, kv_heads=config.kv_heads,
        ffn_hidden=config.ffn_hidden, activation=config.activation, rms_norm=config.norm == "rms",
        bias=config.linear_bias, rotary=config.rotary,
        sequence_parallel=bool(engine and engine.sequence_parallel), fused=bool(engine and engine.fused_elementwise),
        dropout=bool(engine and engine.dropout),
        accumulation_fused=bool(engine and engine.gradient_accumulation_fusion),
    )  # fmt: skip


def block_matmul_flops(config: ModelConfig, micro_batch_size: int = 1) -> float:
    """Matrix-multiply FLOPs of one block's forward in Narayanan et al.'s convention (2021,
    Appendix): 2 b s per weight of the block's matrices, plus 4 b s^2 h for attention (QK^T and
    attention over values, full even when causal). GPT-2's block: QKV 6bsh^2, projection 2bsh^2,
    MLP 16bsh^2 at f = 4, so 24 b s h^2 + 4 b s^2 h. Element-wise work is left out.

        >>> gpt = ModelConfig(name="x", family="gpt", layers=1, hidden=64, heads=4, seq_len=32)
        >>> block_matmul_flops(gpt) == 24 * 32 * 64**2 + 4 * 32**2 * 64
        True
    """
    h, s, b = config.hidden, config.seq_len, micro_batch_size
    kv = (config.kv_heads or config.heads) * (h // config.heads)
    matrices = 2 * h * h + 2 * h * kv + (3 if config.activation == "swiglu" else 2) * h * config.mlp_width
    return 2 * b * s * matrices + 4 * b * s * s * h


def _embedding_work(vocab: int, hidden: int, seq_len: int, b: int, device: ComputeDevice, positions: bool = True) -> _Work:
    """Token gather + position add forward; backward builds the dense V x h table gradient.

    PyTorch's dense embedding backward zeroes a V x h gradient, sorts the token ids and adds each
    token's output gradient into its row; autograd then adds that table into `.grad` (every
    micro-batch but the first, and always for a tied table, whose head gradient lands there too):
    about 4 V h element bytes, independent of b, which dwarf the b s h gather for any real vocabulary.
    """
    e, T, h, V = device.bytes_per_element, b * seq_len, hidden, vocab
    forward = [memory_kernel("token gather", 2 * T * h * e + T * TOKEN_ID_BYTES, device)]
    if positions:
        forward.append(memory_kernel("position add", 3 * T * h * e, device))
    backward = [
        *([memory_kernel("position gradient (sum over the batch)", T * h * e + seq_len * h * e, device)] if positions else []),
        memory_kernel("zero the table gradient", V * h * e, device),
        memory_kernel("sort token ids", 4 * T * TOKEN_ID_BYTES, device),
        memory_kernel("segment offsets", 2 * T * TOKEN_ID_BYTES, device),
        memory_kernel("scatter-add rows", 3 * T * h * e, device),
        _accumulate("token table", V * h, device),
        *([_accumulate("positions", seq_len * h, device)] if positions else []),
    ]
    # Transient: the output's gradient (b s h), the fresh V x h gradient before it is added into
    # `.grad`, the sort's id buffers.
    working = T * h * e + V * h * e + 4 * T * TOKEN_ID_BYTES
    return _Work(forward, backward, saved_bytes=T * TOKEN_ID_BYTES, working_bytes=working)


def _block_work(shape: BlockShape, device: ComputeDevice, selective: bool = False) -> _Work:
    """A block's work; with `selective` its attention core's too (`_selective_blocks`)."""
    e = device.bytes_per_element
    largest_parameter = max(shape.parameter_tensors())
    return _Work(
        forward=block_forward_kernels(shape, device),
        backward=block_backward_kernels(shape, device),
        saved_bytes=block_saved_bytes(shape, e),
        # + the largest parameter's fresh gradient before it is added into `.grad`.
        working_bytes=block_working_bytes(shape, e) + largest_parameter * e,
        attention_core_forward=attention_core_forward_kernels(shape, device) if selective else None,
        attention_core_saved_bytes=attention_core_saved_bytes(shape, e) if selective else None,
    )


def _selective_blocks(config: ModelConfig, engine: EngineFeatures | None) -> bool:
    """Whether the blocks record their attention core, which the planner prices selective
    recomputation from: pipectl's own block (GPT-2's shape), which the runtime recomputes
    selectively, and another engine's (Megatron-LM's --recompute-granularity selective); not a
    Hugging Face decoder's, which pipectl's runtime runs whole."""
    return config.builtin_block or engine is not None


def _final_norm_work(hidden: int, seq_len: int, b: int, device: ComputeDevice, rms: bool = False,
                     fused: bool = False) -> _Work:
    e, T, h = device.bytes_per_element, b * seq_len, hidden
    if rms and not fused:  # transformers' eager RMSNorm, as in the blocks (compute_model)
        return _Work(
            forward=rms_norm_forward_kernels(T, h, device),
            backward=[*rms_norm_backward_kernels(T, h, device), _accumulate("weight", h, device)],
            saved_bytes=T * h * (FP32_BYTES + e) + T * FP32_BYTES,
            working_bytes=2 * T * h * FP32_BYTES,
        )
    return _Work(
        forward=[memory_kernel("layer norm", 2 * T * h * e, device)],
        backward=[
            memory_kernel("layer norm backward", 3 * T * h * e, device),
            memory_kernel("layer norm weight gradient", 2 * T * h * e, device),
            _accumulate("weight", h, device),
            _accumulate("bias", h, device),
        ],
        # Its input, plus the fp32 mean and reciprocal std. per token.
        saved_bytes=T * h * e + 2 * T * FP32_BYTES,
        working_bytes=2 * T * h * e,  # the output's and the input's gradients
    )


def _head_work(vocab: int, hidden: int, seq_len: int, b: int, device: ComputeDevice) -> _Work:
    """Logits x W^T and the loss `pipectl.models.transformer.lm_loss` computes on them.

    lm_loss upcasts the logits to fp32 and takes cross-entropy = log-softmax + NLL. Saved: the
    head's input (for the weight gradient) and the fp32 log-softmax output (Korthikanti et al. 2022,
    §4.3: 4 s b V bytes). Transient, beyond those and the 16-bit logits (the output):

        forward:  the fp32 copy of the logits                                      4 T V
        backward: NLL's dense gradient of the log-softmax output and log-softmax's
                  gradient of the fp32 logits, alive together                      8 T V
                  then the fp32 and 16-bit logit gradients                      (4 + e) T V
                  then the 16-bit logit gradient, the input gradient and the
                  fresh V x h weight gradient                        e T V + e T h + e V h

    so the working memory is the largest of these (8 T V bytes for any real vocabulary).
    """
    e, T, h, V = device.bytes_per_element, b * seq_len, hidden, vocab
    forward = [
        gemm_kernel("logits", T, V, h, device),
        memory_kernel("logits to fp32", T * V * (e + FP32_BYTES), device),
        memory_kernel("log-softmax (max and sum pass)", T * V * FP32_BYTES, device),
        memory_kernel("log-softmax", 2 * T * V * FP32_BYTES, device),
        memory_kernel("nll loss", T * (FP32_BYTES + TOKEN_ID_BYTES), device),
    ]
    backward = [
        memory_kernel("nll backward (zero + scatter)", T * V * FP32_BYTES, device),
        memory_kernel("log-softmax backward (sum pass)", T * V * FP32_BYTES, device),
        memory_kernel("log-softmax backward", 3 * T * V * FP32_BYTES, device),
        memory_kernel("logit gradient to dtype", T * V * (FP32_BYTES + e), device),
        gemm_kernel("logits input gradient", T, h, V, device),
        gemm_kernel("logits weight gradient", V, h, T, device),
        _accumulate("token table", V * h, device),
    ]
    working = max(
        FP32_BYTES * T * V,
        2 * FP32_BYTES * T * V,
        (FP32_BYTES + e) * T * V,
        e * T * V + e * T * h + e * V * h,
    )
    return _Work(forward, backward, saved_bytes=T * h * e + T * V * FP32_BYTES, working_bytes=working)


def _block_shards(
    config: ModelConfig, attention: Attention, degrees: Sequence[int], engine: EngineFeatures | None = None
) -> dict[int, tuple[int, Callable[[int, ComputeDevice], _Work]]]:
    """One rank's shard of a block for each t in `degrees` that divides the heads (and the hidden size)."""
    h, a = config.hidden, config.heads
    shards: dict[int, tuple[int, Callable[[int, ComputeDevice], _Work]]] = {}
    for t in degrees:
        if a % t or h % t or (config.kv_heads or a) % t:
            continue
        shape_at = lambda b, t=t: _block_shape(config, attention, b, t, engine)
        selective = _selective_blocks(config, engine)
        shards[t] = (sum(shape_at(1).parameter_tensors()),
                     lambda b, d, shape_at=shape_at: _block_work(shape_at(b), d, selective))
    return shards


def _engine_shards(
    shape: _LayerShape, config: ModelConfig, degrees: Sequence[int], engine: EngineFeatures
) -> _LayerShape:
    """The embedding, final norm and head of another engine's run, split over t ranks where it
    splits them: vocabulary-parallel embedding and head (V/t rows of the table and of the logits:
    1/t of their work, parameters and saved logits), a sequence-parallel final norm (s/t tokens).
    The collectives they add are the planner's (`plan.costs.layer_seconds`)."""
    h, s, V = config.hidden, config.seq_len, config.vocab
    positions = not config.rotary
    rms = config.norm == "rms"
    shards: dict[int, tuple[int, Callable[[int, ComputeDevice], _Work]]] = {}
    for t in degrees:
        local_vocab = -(-V // t)
        if shape.kind == "embedding" and engine.vocab_parallel:
            parameters = local_vocab * h + (s * h if positions else 0)
            shards[t] = (parameters, lambda b, d, v=local_vocab: _embedding_work(v, h, s, b, d, positions))
        elif shape.kind == "lm_head" and engine.vocab_parallel:
            shards[t] = (local_vocab * h, lambda b, d, v=local_vocab: _head_work(v, h, s, b, d))
        elif shape.kind == "layer_norm" and engine.sequence_parallel:
            shards[t] = (shape.parameter_count,
                         lambda b, d, t=t: _final_norm_work(h, -(-s // t), b, d, rms, engine.fused_elementwise))
    if not shards:
        return shape
    divided = engine.vocab_parallel if shape.kind == "lm_head" else engine.sequence_parallel
    return replace(shape, shards=shards, shard_output_divided=divided)


def _transformer_shapes(config: ModelConfig, attention: Attention, engine: EngineFeatures | None = None) -> list[_LayerShape]:
    h, s, V = config.hidden, config.seq_len, config.vocab
    positions = not config.rotary
    rms = config.norm == "rms"
    tied_group = "embed" if config.tied_embeddings else None
    shapes = [
        _LayerShape(
            name="embed",
            kind="embedding",
            parameter_count=V * h + (s * h if positions else 0),  # token table + learned positions
            shared_group=tied_group,
            shared_parameter_count=V * h if config.tied_embeddings else 0,
            forward_flops_per_sample=s * h if positions else 0,  # the position add
            output_elements_per_sample=s * h,
            work=lambda b, d: _embedding_work(V, h, s, b, d, positions),
        )
    ]
    block_params = config.block_parameters()
    for i in range(config.layers):
        shapes.append(
            _LayerShape(
                name=f"block.{i}",
                kind="transformer_block",
                parameter_count=block_params,
                shared_group=None,
                shared_parameter_count=0,
                forward_flops_per_sample=block_matmul_flops(config),
                output_elements_per_sample=s * h,
                work=lambda b, d: _block_work(_block_shape(config, attention, b, 1, engine), d,
                                              _selective_blocks(config, engine)),
            )
        )
    shapes.append(
        _LayerShape(
            name="final_norm",
            kind="layer_norm",
            parameter_count=h if rms else 2 * h,
            shared_group=None,
            shared_parameter_count=0,
            forward_flops_per_sample=(4 if rms else 8) * s * h,  # (mean,) variance, normalise, scale(, shift)
            output_elements_per_sample=s * h,
            work=lambda b, d: _final_norm_work(h, s, b, d, rms, bool(engine and engine.fused_elementwise)),
        )
    )
    shapes.append(
        _LayerShape(
            name="head",
            kind="lm_head",
            # Tied: the head uses the embedding's token table (charged here, all of it shared).
            parameter_count=V * h,
            shared_group=tied_group,
            shared_parameter_count=V * h if config.tied_embeddings else 0,
            forward_flops_per_sample=2 * s * h * V,  # logits: 2bshV forward (docs/design.md, 'Parameters and FLOPs')
            output_elements_per_sample=s * V,
            work=lambda b, d: _head_work(V, h, s, b, d),
        )
    )
    return shapes


def _dense_work(inputs: int, outputs: int, b: int, device: ComputeDevice, last: bool) -> _Work:
    """Linear + ReLU (or, last, the classifier and its fp32 cross-entropy)."""
    e = device.bytes_per_element
    if last:
        after = [memory_kernel("logits to fp32 + log-softmax", b * outputs * (e + 3 * FP32_BYTES), device)]
        after_backward = [memory_kernel("log-softmax backward", b * outputs * 4 * FP32_BYTES, device)]
        kept_after = b * outputs * FP32_BYTES  # the log-softmax output
        working = 2 * b * outputs * FP32_BYTES + b * inputs * e
    else:
        after = [memory_kernel("relu", 2 * b * outputs * e, device)]
        after_backward = [memory_kernel("relu backward", 3 * b * outputs * e, device)]
        kept_after = b * outputs * e  # ReLU keeps its output
        working = b * outputs * e + b * inputs * e  # the output's and the input's gradients
    forward = [gemm_kernel("linear", b, outputs, inputs, device), *after]
    backward = [
        *after_backward,
        gemm_kernel("linear input gradient", b, inputs, outputs, device),
        gemm_kernel("linear weight gradient", outputs, inputs, b, device),
        memory_kernel("linear bias gradient", b * outputs * e, device),
        _accumulate("weight", inputs * outputs, device),
        _accumulate("bias", outputs, device),
    ]
    return _Work(forward, backward, saved_bytes=b * inputs * e + kept_after, working_bytes=working)


def _dense_shape(name: str, kind: str, inputs: int, outputs: int, last: bool) -> _LayerShape:
    return _LayerShape(
        name=name,
        kind=kind,
        parameter_count=inputs * outputs + outputs,
        shared_group=None,
        shared_parameter_count=0,
        forward_flops_per_sample=2 * inputs * outputs,
        output_elements_per_sample=outputs,
        work=lambda b, d: _dense_work(inputs, outputs, b, d, last),
    )


def _mlp_shapes(config: ModelConfig) -> list[_LayerShape]:
    inputs = config.input_dim or config.hidden
    classes = config.classes or 10  # as pipectl.models.registry.mlp_layers
    shapes = [_dense_shape("input", "dense", inputs, config.hidden, last=False)]
    shapes += [
        _dense_shape(f"hidden.{i}", "dense", config.hidden, config.hidden, last=False)
        for i in range(config.layers)
    ]
    shapes.append(_dense_shape("classifier", "classifier", config.hidden, classes, last=True))
    return shapes


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
    shape: _LayerShape, micro_batch_size: int, device: DeviceSpec, dtype: str, compute: ComputeDevice | None
) -> LayerCost:
    return _cost_of(shape, shape.parameter_count, shape.work, micro_batch_size, device, dtype, compute,
                    shape.forward_flops_per_sample)  # fmt: skip


def _shard_profile(
    shape: _LayerShape, t: int, sizes: Sequence[int], device: DeviceSpec, dtype: str, compute: ComputeDevice | None
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
    shape: _LayerShape,
    parameter_count: int,
    work_of: Callable[[int, ComputeDevice], _Work],
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
    shapes = _transformer_shapes(config, attention, engine) if transformer else _mlp_shapes(config)
    degrees = _check_tensor_parallel(tensor_parallel)
    if transformer and degrees:
        shards = _block_shards(config, attention, degrees, engine)
        sequence_parallel = bool(engine and engine.sequence_parallel)
        shapes = [replace(shape, shards=shards, shard_output_divided=sequence_parallel)
                  if shape.kind == "transformer_block" else shape for shape in shapes]
        if engine is not None:
            split = sorted(shards)  # the degrees the blocks split at: every split layer has the same
            shapes = [_engine_shards(shape, config, split, engine) if shape.kind != "transformer_block" else shape
                      for shape in shapes]
    compute = ComputeDevice.of(device, dtype)
    bytes_per_element = DTYPE_BYTES[dtype]

    layers = [
        LayerProfile(
            index=index,
            name=shape.name,
            kind=shape.kind,
            parameter_count=shape.parameter_count,
            parameter_bytes=shape.parameter_count * bytes_per_element,
            shared_group=shape.shared_group,
            shared_parameter_count=shape.shared_parameter_count,
            costs=[_layer_cost(shape, b, device, dtype, compute) for b in sizes],
            shards=[_shard_profile(shape, t, sizes, device, dtype, compute) for t in sorted(shape.shards)],
        )
        for index, shape in enumerate(shapes)
    ]
    notes = []  # that it is derived, and for which device, the profile's source and device say
    if compute is not None:
        notes.append(
            f"time: kernel model (GEMMs {compute.gemm_efficiency:g} of peak, attention "
            f"{compute.attention_efficiency:g}, element-wise by bandwidth, {compute.kernel_overhead_seconds * 1e6:g} µs/kernel)"
        )
    else:
        notes.append(
            f"time: FLOPs / (peak x efficiency(b)) or bytes / bandwidth; '{device.name}' has no compute "
            "constants in the catalog"
        )
    if transformer:
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
