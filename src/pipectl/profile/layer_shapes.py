"""What each layer of a model config does, for `derive`: its parameters, FLOPs and output, and at any
micro-batch size its kernels (`compute_model`) and the bytes it saves and works in, for the layer
and for one rank's shard of it under tensor parallelism. The layer list and its conventions are
those of `pipectl.models.registry` and the measured profiler (`derive`'s module docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace


from pipectl.artifacts.model import ModelConfig, ModelFamily
from pipectl.artifacts.profile import (
    EngineFeatures,
)
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
    attention_core_forward_kernels,
    gemm_kernel,
    memory_kernel,
)
from pipectl.profile.block_memory import attention_core_saved_bytes, block_saved_bytes, block_working_bytes


@dataclass(frozen=True)
class LayerWork:
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
class LayerShape:
    """One layer of the list; `work(b, device)` builds its kernels at micro-batch b."""

    name: str
    kind: str
    parameter_count: int
    shared_group: str | None
    shared_parameter_count: int
    forward_flops_per_sample: float  # matrix-multiply FLOPs (Narayanan et al. 2021 convention)
    output_elements_per_sample: int  # in the profile's dtype
    work: Callable[[int, ComputeDevice], LayerWork]
    # Tensor-parallel degree t -> (one rank's parameters, its work at b); empty: not split.
    shards: dict[int, tuple[int, Callable[[int, ComputeDevice], LayerWork]]] = field(default_factory=dict)
    # Whether a shard's output is 1/t of the layer's (sequence parallelism: the s/t tokens a rank
    # keeps; a vocabulary-parallel head: V/t logits); otherwise whole on every rank.
    shard_output_divided: bool = False


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
        megatron_deepspeed=bool(engine and engine.megatron_deepspeed_layer),
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


def _embedding_work(vocab: int, hidden: int, seq_len: int, b: int, device: ComputeDevice, positions: bool = True) -> LayerWork:
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
    return LayerWork(forward, backward, saved_bytes=T * TOKEN_ID_BYTES, working_bytes=working)


def _block_work(shape: BlockShape, device: ComputeDevice, selective: bool = False) -> LayerWork:
    """A block's work; with `selective` its attention core's too (`_selective_blocks`)."""
    e = device.bytes_per_element
    largest_parameter = max(shape.parameter_tensors())
    return LayerWork(
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
                     fused: bool = False) -> LayerWork:
    e, T, h = device.bytes_per_element, b * seq_len, hidden
    if rms and not fused:  # transformers' eager RMSNorm, as in the blocks (compute_model)
        return LayerWork(
            forward=rms_norm_forward_kernels(T, h, device),
            backward=[*rms_norm_backward_kernels(T, h, device), _accumulate("weight", h, device)],
            saved_bytes=T * h * (FP32_BYTES + e) + T * FP32_BYTES,
            working_bytes=2 * T * h * FP32_BYTES,
        )
    return LayerWork(
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


# `pipectl.models.transformer.LOSS_CHUNK_BYTES` (kept apart: deriving a profile imports no torch; a
# test holds the two equal).
LOSS_CHUNK_BYTES = 256 << 20


def _head_work(vocab: int, hidden: int, seq_len: int, b: int, device: ComputeDevice) -> LayerWork:
    """Logits x W^T and pipectl's loss on them (`pipectl.models.transformer.lm_loss`).

    A chunk of rows at a time (`LOSS_CHUNK_BYTES` of fp32): log-softmax in fp32 from the 16-bit
    logits (one kernel reading them twice, for the maximum and sum and for the output), the
    picked log-probabilities, exp in place, the one-hot subtracted, the gradient written in 16-bit.
    Saved: the head's input and that 16-bit gradient (not the logits). The backward scales the
    gradient in place, then the two GEMMs. Transient: one chunk's fp32 log-probabilities in the
    forward; the input gradient and the V x h weight gradient in the backward.
    """
    e, T, h, V = device.bytes_per_element, b * seq_len, hidden, vocab
    rows = max(1, LOSS_CHUNK_BYTES // (FP32_BYTES * V))
    forward = [gemm_kernel("logits", T, V, h, device)]
    for start in range(0, T, rows):
        n = min(rows, T - start)
        forward += [
            memory_kernel("log-softmax to fp32 (max and sum pass)", n * V * e, device),
            memory_kernel("log-softmax to fp32", n * V * (e + FP32_BYTES), device),
            memory_kernel("picked log-probabilities", n * (FP32_BYTES + TOKEN_ID_BYTES), device),
            memory_kernel("exp", 2 * n * V * FP32_BYTES, device),
            memory_kernel("minus one-hot", n * (FP32_BYTES + TOKEN_ID_BYTES), device),
            memory_kernel("gradient to dtype", n * V * (FP32_BYTES + e), device),
        ]
    forward.append(memory_kernel("mean over tokens", 2 * T * FP32_BYTES, device))
    backward = [
        memory_kernel("gradient x incoming / tokens", 2 * T * V * e, device),
        gemm_kernel("logits input gradient", T, h, V, device),
        gemm_kernel("logits weight gradient", V, h, T, device),
        _accumulate("token table", V * h, device),
    ]
    working = max(FP32_BYTES * min(rows, T) * V, e * T * h + e * V * h)
    return LayerWork(forward, backward, saved_bytes=T * h * e + T * V * e, working_bytes=working)


def _fp32_loss_head_work(vocab: int, hidden: int, seq_len: int, b: int, device: ComputeDevice) -> LayerWork:
    """Logits x W^T and an eager fp32 cross-entropy on them, as Megatron's runs take it.

    The logits are upcast to fp32 and cross-entropy = log-softmax + NLL. Saved: the
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
    return LayerWork(forward, backward, saved_bytes=T * h * e + T * V * FP32_BYTES, working_bytes=working)


def block_shards(
    config: ModelConfig, attention: Attention, degrees: Sequence[int], engine: EngineFeatures | None = None
) -> dict[int, tuple[int, Callable[[int, ComputeDevice], LayerWork]]]:
    """One rank's shard of a block for each t in `degrees` that divides the heads (and the hidden size)."""
    h, a = config.hidden, config.heads
    shards: dict[int, tuple[int, Callable[[int, ComputeDevice], LayerWork]]] = {}
    for t in degrees:
        if a % t or h % t or (config.kv_heads or a) % t:
            continue
        shape_at = lambda b, t=t: _block_shape(config, attention, b, t, engine)
        selective = _selective_blocks(config, engine)
        shards[t] = (sum(shape_at(1).parameter_tensors()),
                     lambda b, d, shape_at=shape_at: _block_work(shape_at(b), d, selective))
    return shards


def engine_shards(
    shape: LayerShape, config: ModelConfig, degrees: Sequence[int], engine: EngineFeatures
) -> LayerShape:
    """The embedding, final norm and head of another engine's run, split over t ranks where it
    splits them: vocabulary-parallel embedding and head (V/t rows of the table and of the logits:
    1/t of their work, parameters and saved logits), a sequence-parallel final norm (s/t tokens).
    The collectives they add are the planner's (`plan.costs.layer_seconds`)."""
    h, s, V = config.hidden, config.seq_len, config.vocab
    positions = not config.rotary
    rms = config.norm == "rms"
    shards: dict[int, tuple[int, Callable[[int, ComputeDevice], LayerWork]]] = {}
    for t in degrees:
        local_vocab = -(-V // t)
        if shape.kind == "embedding" and engine.vocab_parallel:
            parameters = local_vocab * h + (s * h if positions else 0)
            shards[t] = (parameters, lambda b, d, v=local_vocab: _embedding_work(v, h, s, b, d, positions))
        elif shape.kind == "lm_head" and engine.vocab_parallel:
            shards[t] = (local_vocab * h, lambda b, d, v=local_vocab: _fp32_loss_head_work(v, h, s, b, d))
        elif shape.kind == "layer_norm" and engine.sequence_parallel:
            shards[t] = (shape.parameter_count,
                         lambda b, d, t=t: _final_norm_work(h, -(-s // t), b, d, rms, engine.fused_elementwise))
    if not shards:
        return shape
    divided = engine.vocab_parallel if shape.kind == "lm_head" else engine.sequence_parallel
    return replace(shape, shards=shards, shard_output_divided=divided)


def transformer_shapes(config: ModelConfig, attention: Attention, engine: EngineFeatures | None = None) -> list[LayerShape]:
    h, s, V = config.hidden, config.seq_len, config.vocab
    positions = not config.rotary
    rms = config.norm == "rms"
    tied_group = "embed" if config.tied_embeddings else None
    shapes = [
        LayerShape(
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
    # One work function for every block: the blocks are alike, and `derive` prices each work once.
    block_work = lambda b, d: _block_work(_block_shape(config, attention, b, 1, engine), d, _selective_blocks(config, engine))
    for i in range(config.layers):
        shapes.append(
            LayerShape(
                name=f"block.{i}",
                kind="transformer_block",
                parameter_count=block_params,
                shared_group=None,
                shared_parameter_count=0,
                forward_flops_per_sample=block_matmul_flops(config),
                output_elements_per_sample=s * h,
                work=block_work,
            )
        )
    shapes.append(
        LayerShape(
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
        LayerShape(
            name="head",
            kind="lm_head",
            # Tied: the head uses the embedding's token table (charged here, all of it shared).
            parameter_count=V * h,
            shared_group=tied_group,
            shared_parameter_count=V * h if config.tied_embeddings else 0,
            forward_flops_per_sample=2 * s * h * V,  # logits: 2bshV forward (docs/design.md, 'Parameters and FLOPs')
            output_elements_per_sample=s * V,
            # pipectl's own loss, or another engine's fp32 one.
            work=lambda b, d: (_head_work if engine is None else _fp32_loss_head_work)(V, h, s, b, d),
        )
    )
    return shapes


def _dense_work(inputs: int, outputs: int, b: int, device: ComputeDevice, last: bool) -> LayerWork:
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
    return LayerWork(forward, backward, saved_bytes=b * inputs * e + kept_after, working_bytes=working)


def _dense_shape(name: str, kind: str, inputs: int, outputs: int, last: bool) -> LayerShape:
    return LayerShape(
        name=name,
        kind=kind,
        parameter_count=inputs * outputs + outputs,
        shared_group=None,
        shared_parameter_count=0,
        forward_flops_per_sample=2 * inputs * outputs,
        output_elements_per_sample=outputs,
        work=lambda b, d: _dense_work(inputs, outputs, b, d, last),
    )


def mlp_shapes(config: ModelConfig) -> list[LayerShape]:
    inputs = config.input_dim or config.hidden
    classes = config.classes or 10  # as pipectl.models.registry.mlp_layers
    shapes = [_dense_shape("input", "dense", inputs, config.hidden, last=False)]
    shapes += [
        _dense_shape(f"hidden.{i}", "dense", config.hidden, config.hidden, last=False)
        for i in range(config.layers)
    ]
    shapes.append(_dense_shape("classifier", "classifier", config.hidden, classes, last=True))
    return shapes
