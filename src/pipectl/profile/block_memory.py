"""What a transformer block shard keeps for its backward and holds while it runs it, from shapes
alone: the memory side of `compute_model`'s kernels (the same `BlockShape`).

- `block_saved_bytes`: what autograd's saved-tensor hooks count for one block (held to the byte
  against pipectl's own block on a CPU by tests/profile/test_compute_model.py);
- `attention_core_saved_bytes`: what selective recomputation frees of it;
- `block_working_bytes`: the backward's transient tensors.
"""

from __future__ import annotations

from pipectl.profile.compute_model import FP32_BYTES, Attention, BlockShape, DROPOUT_MASK_BYTES, scores_elements


def block_saved_bytes(shape: BlockShape, bytes_per_element: int) -> int:
    """Bytes one block shard keeps for its backward (what autograd's saved-tensor hooks count).

    Whole (replicated over the t ranks): the block input and the first LayerNorm's output, the
    residual sum and the second LayerNorm's output: 4 b s h elements. Split: the QKV output (q, k
    and v are views of it) 3h/t, the attention output h/t (flash lays it out (b, s, heads, d), so
    proj's input is a view of it, not a copy), fc1's output (GELU's input) fh/t and GELU's output
    (fc2's input) fh/t. In 16-bit at f = 4:

        2 (4h + 12h/t) = 8 + 24/t bytes per token and hidden unit (32 at t = 1)

    plus fp32 per token: the two LayerNorms' mean and reciprocal std., flash's log-sum-exp per local
    head. Unfused attention keeps the softmax output (b x heads/t x s x s) instead of the
    log-sum-exp (Korthikanti et al. 2022, §4.2, without dropout); its context is kept once, as the
    (b, s, h/t) copy proj reads, since P·V saves its inputs, not its output (measured with
    saved-tensor hooks on a CPU block under PyTorch's math attention: exact, as for flash).

    A Llama block keeps instead: per RMSNorm its fp32 input copy and its 16-bit output (and an fp32
    reciprocal root per token); attention's inputs, q and k after the rotary embeddings and v
    (h/t + 2 kv/t, the same count as the fused QKV output); the SwiGLU MLP's gate output, SiLU
    output, up output and their product (4 f h/t). GPT-2's eager tanh GELU keeps its input, the tanh,
    and the two factors of its last product besides fc2's input (5 f h/t with fc1's output).
    """
    e, T, h, hl, il = bytes_per_element, shape.tokens, shape.hidden, shape.local_hidden, shape.local_ffn
    Tn = shape.norm_tokens  # sequence parallelism: the norms' tensors are 1/t of the sequence
    if shape.rms_norm and not shape.fused:
        norms = 2 * (Tn * h * (FP32_BYTES + e) + Tn * FP32_BYTES)
    elif shape.rms_norm:  # a fused RMSNorm keeps its 16-bit input and one fp32 figure per token
        norms = 4 * Tn * h * e + 2 * Tn * FP32_BYTES
    else:
        norms = 4 * Tn * h * e + 2 * 2 * Tn * FP32_BYTES
    # A fused SwiGLU keeps the gate/up GEMM's output (2 f h/t) and its own (down's input): 3 f h/t.
    mlp = ({"swiglu": 3} if shape.fused else {}).get(shape.activation) or {"swiglu": 4, "gelu_python": 5}.get(shape.activation, 2)
    mlp *= T * il
    split = (shape.qkv_width + hl) * T + mlp
    if shape.attention is Attention.FLASH:
        extra = T * shape.local_heads * FP32_BYTES  # log-sum-exp
    else:
        extra = scores_elements(shape) * e
        if shape.dropout:  # the dropped probabilities (PV's input) and their mask (Korthikanti: 5 a s / h)
            extra += scores_elements(shape) * (e + DROPOUT_MASK_BYTES)
        if shape.softmax_fallback:  # softmax's backward keeps its fp32 output too
            extra += scores_elements(shape) * FP32_BYTES
    if shape.dropout:  # the two hidden dropouts' masks
        norms += 2 * Tn * h * DROPOUT_MASK_BYTES
    return norms + split * e + extra


def attention_core_saved_bytes(shape: BlockShape, bytes_per_element: int) -> int:
    """What selective recomputation (Korthikanti et al. 2022, §5) frees of `block_saved_bytes`:
    the attention core's saved tensors beyond its inputs q, k, v (views of the QKV output, kept
    for the QKV backward and as the recomputation's inputs) and its output (proj's input).

    Unfused: the softmax output (b x heads/t x s x s), with dropout also the dropped probabilities
    and their 1-byte mask: 5 a s^2 b bytes in 16-bit, the s^2 term of Korthikanti's per-layer
    s b h (34 + 5 a s / h), which drops to 34 s b h. Flash: only the log-sum-exp (4 bytes per token
    and local head), the scores being never stored: a small saving.

        >>> shape = BlockShape(hidden=1024, heads=16, seq_len=2048, micro_batch_size=1)
        >>> attention_core_saved_bytes(shape, 2)  # flash: 2048 x 16 x 4
        131072
        >>> attention_core_saved_bytes(BlockShape(1024, 16, 2048, 1, attention=Attention.UNFUSED, dropout=True), 2)
        335544320
    """
    if shape.attention is Attention.FLASH:
        return shape.tokens * shape.local_heads * FP32_BYTES
    scores = scores_elements(shape)
    kept = scores * bytes_per_element  # the softmax output
    if shape.dropout:
        kept += scores * (bytes_per_element + DROPOUT_MASK_BYTES)
    if shape.softmax_fallback:  # and its fp32 copy, which softmax's backward keeps
        kept += scores * FP32_BYTES
    return kept


def block_working_bytes(shape: BlockShape, bytes_per_element: int) -> int:
    """Transient bytes of a block shard's backward beyond saved, output and parameter bytes.

    While the MLP's backward runs: the incoming gradient (b s h), the gradient it passes on (b s h)
    and the gradients of GELU's output and input (2 b s fh/t). Unfused attention's backward holds
    two b x heads/t x s x s gradients (of the probabilities and of the scores) instead, if larger.
    """
    e, T, h, il = bytes_per_element, shape.tokens, shape.hidden, shape.local_ffn
    mlp = (2 * T * h + (3 if shape.activation == "swiglu" else 2) * T * il) * e
    if shape.attention is Attention.UNFUSED:  # Megatron's fallback: the two gradients in fp32
        scores = 2 * scores_elements(shape) * (FP32_BYTES if shape.softmax_fallback else e)
        return max(mlp, 2 * T * h * e + scores)
    return mlp
