"""Kernel-level time and memory of transformer layers on a catalog device, from shapes alone.

A layer's forward (or backward) is the list of kernels eager PyTorch runs for it: matrix products
(GEMMs) with their m, n, k after the tensor-parallel split, attention (fused flash-style, or
unfused with the b x heads x s x s scores materialised), and memory-bound element-wise work (layer
norms, GELU, residual adds, bias gradients, gradient accumulation). Each kernel's GPU time is a
roofline (Williams et al. 2009):

    gemm:        max(2mnk / (peak x gemm_efficiency x waves(m, n)^q), bytes / bandwidth)
    attention:   FLOPs / (peak x attention_efficiency), stretched when too few tiles fill the SMs
    element-wise: bytes / (bandwidth x MEMORY_EFFICIENCY)

(q = 1 unless a calibration fitted the device's `gemm_wave_quantization`), and the host issues
one kernel every `kernel_overhead_seconds` (PyTorch's eager dispatch and the CUDA launch), so a
phase lasts as the queue of host issues and GPU runs says (`phase_seconds`): small shards are
launch-bound, large ones GEMM-bound, the same formula for both.

The device constants (configs/devices.yaml, each with its source there): the dense 16-bit peak and
memory bandwidth (datasheets), the streaming-multiprocessor count (datasheet), the fraction of the
peak a large GEMM sustains (`gemm_efficiency`: the clock a GPU holds at its power limit under
tensor-core load), the fraction fused attention reaches (`attention_efficiency`, from the
FlashAttention papers) and the host's per-kernel overhead.

Worked example, one forward of the h=4096, t=1, b=1, s=2048 block on an H100 (989 TFLOP/s,
3.35 TB/s): 10 kernels; the four GEMMs hold 0.82 TFLOP (1.16 ms at 0.74 of peak and 97 % wave
efficiency), flash attention 34 GFLOP (0.10 ms), element-wise work 0.10 ms; measured on an H100,
1.23 ms (`benchmarks/derived_vs_measured.py`):

    >>> from pipectl.catalog import get_device
    >>> device = ComputeDevice.of(get_device("h100-80gb"), "bfloat16")
    >>> block = BlockShape(hidden=4096, heads=32, seq_len=2048, micro_batch_size=1)
    >>> round(phase_seconds(block_forward_kernels(block, device), device) * 1e3, 2)
    1.43
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from pipectl.catalog import DTYPE_BYTES, DeviceSpec

FP32_BYTES = 4
TOKEN_ID_BYTES = 8  # int64 token ids

# Streaming kernels (copies, element-wise ops) reach about 90 % of the HBM datasheet bandwidth
# (BabelStream: Deakin et al. 2018, "Evaluating attainable memory bandwidth of parallel programming
# models via BabelStream"; on H100 SXM about 3.0 of 3.35 TB/s).
MEMORY_EFFICIENCY = 0.9

# GEMM output tiles cuBLAS chooses among for 16-bit tensor-core products (CUTLASS's large tiles on
# Ampere and Hopper): a product of fewer tiles than one wave of SMs leaves SMs idle, and a partial
# last wave costs a whole one (NVIDIA, "Matrix Multiplication Background User's Guide", tile and
# wave quantization). The library picks the tile per shape; we take the one that wastes least.
GEMM_TILES = ((128, 256), (256, 128), (128, 128))

# Flash attention works on 128-row query blocks (FlashAttention-2, Dao 2023, head dimension 128):
# one thread block per (sample, head, query block); with a causal mask block i visits i+1 key blocks.
ATTENTION_BLOCK_ROWS = 128

# Flash attention backward: 5 matrix products of the forward's size against the forward's 2
# (recomputing the scores and softmax; Dao 2023, §3.2), i.e. 2.5 x the forward FLOPs.
FLASH_BACKWARD_PER_FORWARD = 2.5


class Attention(str, Enum):
    """How a block computes attention: fused (flash, scores never stored) or unfused (s x s stored)."""

    FLASH = "flash"
    UNFUSED = "unfused"


@dataclass(frozen=True)
class ComputeDevice:
    """The constants the compute model reads from a catalog entry, in SI units, for one dtype."""

    name: str
    peak_flops_per_second: float
    memory_bytes_per_second: float  # attainable: datasheet x MEMORY_EFFICIENCY
    gemm_efficiency: float
    attention_efficiency: float
    kernel_overhead_seconds: float
    multiprocessors: int
    bytes_per_element: int
    # Exponent on a GEMM's useful wave fraction (`DeviceSpec.gemm_wave_quantization`): 1 as modelled.
    wave_quantization: float = 1.0
    # Every launch waits for its kernel to end (CUDA_LAUNCH_BLOCKING=1; `EngineFeatures.launch_blocking`).
    launch_blocking: bool = False

    @classmethod
    def of(cls, device: DeviceSpec, dtype: str) -> ComputeDevice | None:
        """The device's compute constants, or None when its catalog entry lacks one of them."""
        if not device.has_compute_model() or device.memory_bandwidth_gbytes_per_second is None:
            return None
        return cls(
            name=device.name,
            peak_flops_per_second=device.peak_flops_per_second(dtype),
            memory_bytes_per_second=device.memory_bandwidth_gbytes_per_second * 1e9 * MEMORY_EFFICIENCY,
            gemm_efficiency=float(device.gemm_efficiency or 0),
            attention_efficiency=float(device.attention_efficiency or 0),
            kernel_overhead_seconds=float(device.kernel_overhead_us or 0) * 1e-6,
            multiprocessors=int(device.multiprocessors or 0),
            bytes_per_element=DTYPE_BYTES[dtype],
            wave_quantization=device.gemm_wave_quantization,
        )


@dataclass(frozen=True)
class Kernel:
    """One kernel: what it is, its FLOPs and bytes moved, and its GPU seconds on the device."""

    name: str
    flops: float
    bytes_moved: float
    seconds: float
    # A blocking copy to the device (a pageable host tensor, `non_blocking=False`): the host issues
    # it only once the GPU has run everything before it, so it cannot run ahead past it.
    blocks_host: bool = False


def phase_seconds(kernels: Sequence[Kernel], device: ComputeDevice) -> float:
    """Wall time of a phase (a forward or a backward) from its first kernel's issue to its last's end.

    The host issues kernel i at (i+1) x overhead; the GPU runs it once issued and once the previous
    one ended (one stream). Launch-bound phases last n x overhead, GPU-bound ones the sum of the
    kernels (plus one overhead). A blocking copy (`Kernel.blocks_host`), and every kernel where each
    launch blocks (`ComputeDevice.launch_blocking`), is issued only once the GPU has caught up, and
    the host's issues count on from there:

        >>> d = ComputeDevice("x", 1e12, 1e12, 1.0, 1.0, 1e-5, 1, 2)
        >>> round(phase_seconds([Kernel("a", 0, 0, 1e-6)] * 3, d) * 1e6, 1)   # 3 x 10 µs + 1 µs
        31.0
        >>> round(phase_seconds([Kernel("a", 0, 0, 1e-3)] * 3, d) * 1e3, 2)   # 10 µs + 3 ms
        3.01
        >>> copy = Kernel("copy", 0, 0, 0.0, blocks_host=True)
        >>> round(phase_seconds([Kernel("a", 0, 0, 1e-3), copy, Kernel("a", 0, 0, 1e-3)], d) * 1e3, 2)
        2.03
    """
    issued = gpu_free = 0.0
    for kernel in kernels:
        if kernel.blocks_host or device.launch_blocking:
            issued = max(issued, gpu_free)
        issued += device.kernel_overhead_seconds
        gpu_free = max(gpu_free, issued) + kernel.seconds
    return gpu_free


def memory_kernel(name: str, bytes_moved: float, device: ComputeDevice) -> Kernel:
    """An element-wise or reduction kernel: bound by memory traffic."""
    return Kernel(name, 0.0, bytes_moved, bytes_moved / device.memory_bytes_per_second)


def wave_efficiency(rows: int, columns: int, multiprocessors: int) -> float:
    """Useful fraction of the SM-time a GEMM's output tiles occupy (tile and wave quantization).

    Tiles run one per SM per wave; the best of GEMM_TILES:

        >>> round(wave_efficiency(2048, 3072, 132), 3)     # 128x128: 16 x 24 = 384 tiles, 3 waves
        0.97
        >>> round(wave_efficiency(2048, 1024, 132), 3)     # 128x128: 128 tiles, one wave of 132
        0.97
        >>> round(wave_efficiency(256, 256, 132), 3)       # 4 tiles on 132 SMs
        0.03
    """
    best = 0.0
    for tile_rows, tile_columns in GEMM_TILES:
        tiles = math.ceil(rows / tile_rows) * math.ceil(columns / tile_columns)
        waves = math.ceil(tiles / multiprocessors)
        best = max(best, rows * columns / (waves * multiprocessors * tile_rows * tile_columns))
    return best


def _wave_fill(rows: int, columns: int, device: ComputeDevice) -> float:
    """The share of the SMs' time a product's tiles use, as the device pays it: `wave_efficiency`
    raised to the device's (calibrated) wave quantization share."""
    return wave_efficiency(rows, columns, device.multiprocessors) ** device.wave_quantization


def gemm_kernel(name: str, m: int, n: int, k: int, device: ComputeDevice) -> Kernel:
    """C[m, n] = A[m, k] B[k, n] in the device's dtype: the roofline of its FLOPs and its bytes."""
    flops = 2.0 * m * n * k
    bytes_moved = float(device.bytes_per_element * (m * k + k * n + m * n))
    # The output tile grid is the larger dimension by the smaller one, as cuBLAS lays it out.
    efficiency = device.gemm_efficiency * _wave_fill(max(m, n), min(m, n), device)
    compute = flops / (device.peak_flops_per_second * efficiency)
    return Kernel(name, flops, bytes_moved, max(compute, bytes_moved / device.memory_bytes_per_second))


@dataclass(frozen=True)
class BlockShape:
    """One tensor-parallel shard of a pre-LN transformer block (Megatron's split, Shoeybi et al. 2019).

    QKV and fc1 are column-parallel (h x 3h/t, h x fh/t), proj and fc2 row-parallel (h/t x h,
    fh/t x h); heads/t local heads. No communication (the planner adds the all-reduces).
    """

    hidden: int
    heads: int
    seq_len: int
    micro_batch_size: int
    tensor_parallel: int = 1
    ffn_multiplier: int = 4
    causal: bool = True
    attention: Attention = Attention.FLASH
    # A Hugging Face decoder's block (`ModelConfig`'s fields of the same names; defaults: GPT-2's):
    kv_heads: int | None = None  # grouped-query attention: separate q, k, v projections
    ffn_hidden: int | None = None  # the MLP's inner width (default ffn_multiplier x hidden)
    activation: str = "gelu"  # gelu (fused), gelu_python (eager tanh GELU), swiglu
    rms_norm: bool = False  # transformers' eager RMSNorm (fp32 upcast) instead of LayerNorm
    bias: bool = True
    rotary: bool = False  # rotary embeddings applied to q and k in eager element-wise ops
    # Another engine's block (`artifacts.profile.EngineFeatures`): sequence parallelism (norms and
    # residual adds on s/t tokens, their saved tensors 1/t) and fused element-wise kernels
    # (one-kernel RMSNorm, fused rotary and SwiGLU, fused QKV and gate/up GEMMs, gradient
    # accumulation inside the weight-gradient GEMM).
    sequence_parallel: bool = False
    fused: bool = False
    # Attention and hidden dropout as Megatron-LM runs them (`EngineFeatures.dropout`).
    dropout: bool = False
    # Weight gradients accumulated by the weight-gradient GEMM into fp32 main gradients
    # (`EngineFeatures.gradient_accumulation_fusion`): no separate accumulation pass.
    accumulation_fused: bool = False
    # The layer as Megatron-DeepSpeed issues it (`EngineFeatures.megatron_deepspeed_layer`).
    megatron_deepspeed: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def softmax_fallback(self) -> bool:
        """Megatron's fused softmax (`fused` unfused attention) falling back to torch's path.

        FusedScaleMaskSoftmax runs its kernel only for keys 17-4096 long (2048 in 2021's code) and
        a multiple of 4, and, causal, for b x heads/t a multiple of the rows one 128-thread block
        takes (`is_kernel_available` in megatron/model/fused_softmax.py, `get_batch_per_block` in
        its scaled_upper_triang_masked_softmax.h: 4, or 8 for keys of at most 128). Otherwise it
        casts the scores to fp32, scales, masks and softmaxes them and casts back: five kernels
        each way instead of one. At 16 heads and t = 8, b = 1 (two rows) falls back; vTrain's
        A100 rows there (`benchmarks/measured_runs.py`) measured ~25 % over the fused prediction,
        their t = 8, b >= 2 siblings within 9 %.
        """
        if not self.fused or self.attention is not Attention.UNFUSED:
            return False
        s = self.seq_len
        if not (16 < s <= 4096 and s % 4 == 0):
            return True
        warp = min(1 << (s - 1).bit_length(), 32)
        rows_per_block = (128 // warp) * (2 if s <= 128 else 1)
        return (self.micro_batch_size * self.local_heads if self.causal else s) % rows_per_block != 0

    @property
    def norm_tokens(self) -> int:
        """Tokens the norms and residual adds of one rank run on: b s, or b s / t (rounded up) with
        sequence parallelism (Korthikanti et al. 2022, §4.2.2)."""
        if self.sequence_parallel and self.tensor_parallel > 1:
            return -(-self.tokens // self.tensor_parallel)
        return self.tokens

    @property
    def local_hidden(self) -> int:
        """h / t: the width of a column-parallel output (rounded up when t does not divide h)."""
        return -(-self.hidden // self.tensor_parallel)

    @property
    def local_heads(self) -> int:
        return max(1, self.heads // self.tensor_parallel)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def local_kv(self) -> int:
        """The width of k (and of v) on one rank: kv_heads x head_dim / t."""
        if self.kv_heads is None:
            return self.local_hidden
        return -(-self.kv_heads * self.head_dim // self.tensor_parallel)

    @property
    def local_ffn(self) -> int:
        """The MLP's inner width on one rank."""
        return -(-(self.ffn_hidden or self.ffn_multiplier * self.hidden) // self.tensor_parallel)

    @property
    def qkv_width(self) -> int:
        return self.local_hidden + 2 * self.local_kv

    def parameter_tensors(self) -> list[int]:
        """Element counts of the shard's parameter tensors (weights and biases, norms whole).

        GPT-2 (the defaults): 12 tensors, one fused QKV; with kv_heads q, k and v apart; swiglu has
        gate, up and down; RMSNorm only a weight; without `bias` no linear biases.
        """
        h, hl, kvl, il, bias = self.hidden, self.local_hidden, self.local_kv, self.local_ffn, self.bias
        norm = [h] if self.rms_norm else [h, h]
        if self.kv_heads is None:
            attention = [self.qkv_width * h] + ([self.qkv_width] if bias else [])
        else:
            attention = [hl * h, kvl * h, kvl * h] + ([hl, kvl, kvl] if bias else [])
        attention += [hl * h] + ([h] if bias else [])  # proj (its bias whole: added once after the all-reduce)
        if self.activation == "swiglu":
            mlp = [il * h, il * h, il * h] + ([il, il, h] if bias else [])
        else:
            mlp = [il * h, il * h] + ([il, h] if bias else [])
        return [*norm, *attention, *norm, *mlp]


def _attention_blocks(shape: BlockShape) -> tuple[float, int]:
    """(query-block x key-block pairs of the whole attention, the most pairs one thread block runs)."""
    blocks = math.ceil(shape.seq_len / ATTENTION_BLOCK_ROWS)
    per_head = blocks * (blocks + 1) / 2 if shape.causal else blocks * blocks
    return shape.micro_batch_size * shape.local_heads * per_head, blocks


def flash_attention_kernel(name: str, shape: BlockShape, flops: float, device: ComputeDevice) -> Kernel:
    """Fused attention: FLOPs at the attention efficiency, or the longest thread block if longer.

    One thread block per (sample, local head, query block), each visiting its key blocks; with fewer
    blocks than SMs the longest one sets the time (LPT bound: max(total / SMs, longest)).
    """
    pairs, longest = _attention_blocks(shape)
    pair_seconds = flops / pairs / (device.peak_flops_per_second * device.attention_efficiency / device.multiprocessors)
    seconds = max(pairs / device.multiprocessors, longest) * pair_seconds
    q_k_v_out = (2 * shape.local_hidden + 2 * shape.local_kv) * shape.tokens * device.bytes_per_element
    return Kernel(name, flops, q_k_v_out, max(seconds, q_k_v_out / device.memory_bytes_per_second))


def attention_flops(shape: BlockShape) -> float:
    """Forward matrix-product FLOPs of attention: QK^T and PV, 4 b s^2 h/t, half of it when causal
    (the FLOPs a flash kernel does; Narayanan et al. 2021 count the full 4 b s^2 h)."""
    full = 4.0 * shape.micro_batch_size * shape.seq_len**2 * shape.local_hidden
    return full / 2 if shape.causal else full


def scores_elements(shape: BlockShape) -> int:
    return shape.micro_batch_size * shape.local_heads * shape.seq_len**2


def _unfused_attention_forward(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    """Scores = QK^T (batched), scale and mask, softmax, probabilities x V: the s x s matrix stored."""
    e, s, d = device.bytes_per_element, shape.seq_len, shape.head_dim
    batch = shape.micro_batch_size * shape.local_heads
    scores = scores_elements(shape)
    if shape.softmax_fallback:  # Megatron's torch path in fp32: cast, scale, mask, softmax, cast back
        f = FP32_BYTES
        softmax = [memory_kernel("scores to fp32", scores * (e + f), device), memory_kernel("scale", 2 * scores * f, device),
                   memory_kernel("mask", scores * (2 * f + 1), device), memory_kernel("softmax (fp32)", 2 * scores * f, device),
                   memory_kernel("probabilities to 16-bit", scores * (f + e), device)]  # fmt: skip
    elif shape.fused:  # Megatron's FusedScaleMaskSoftmax: one pass
        softmax = [memory_kernel("scale, mask and softmax", 2 * scores * e, device)]
    else:  # eager: scale and mask, then softmax
        softmax = [memory_kernel("scale and mask", 2 * scores * e, device), memory_kernel("softmax", 2 * scores * e, device)]
    return [
        _batched_gemm("scores QK^T", batch, s, s, d, device),
        *softmax,
        *([memory_kernel("attention dropout", scores * (2 * e + DROPOUT_MASK_BYTES), device)] if shape.dropout else []),
        _batched_gemm("probabilities x V", batch, s, d, s, device),
        # The context [b, heads, s, d] back to [b, s, h/t] for proj: a copy.
        memory_kernel("context transpose", 2 * shape.tokens * shape.local_hidden * e, device),
    ]


def _unfused_attention_backward(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    e, s, d = device.bytes_per_element, shape.seq_len, shape.head_dim
    batch = shape.micro_batch_size * shape.local_heads
    scores = scores_elements(shape)
    megatron_deepspeed = shape.megatron_deepspeed
    context = 2 * shape.tokens * shape.local_hidden * e  # bytes of a pass over the context (or q, or k)
    # Megatron-DeepSpeed: the context's permute stays a view in the backward (no copy), and
    # baddbmm's backward multiplies dQ and dK by its scale alpha, one kernel each (torch's
    # `maybe_multiply`): QK^T is scaled there, not in the softmax.
    scaled = [memory_kernel(f"{name} x alpha", context, device) for name in ("dQ", "dK")] if megatron_deepspeed else []
    return [
        *([] if megatron_deepspeed else [memory_kernel("context transpose backward", context, device)]),
        _batched_gemm("dP = dO V^T", batch, s, s, d, device),
        _batched_gemm("dV = P^T dO", batch, s, d, s, device),
        *([memory_kernel("attention dropout backward", scores * (2 * e + DROPOUT_MASK_BYTES), device)]
          if shape.dropout else []),
        *_softmax_backward(shape, scores, device),
        _batched_gemm("dQ = dS K", batch, s, d, s, device),
        _batched_gemm("dK = dS^T Q", batch, s, d, s, device),
        *scaled,
    ]


def _softmax_backward(shape: BlockShape, scores: int, device: ComputeDevice) -> list[Kernel]:
    e, f = device.bytes_per_element, FP32_BYTES
    if shape.softmax_fallback:  # autograd back through the fp32 path: five kernels
        return [memory_kernel("gradient to fp32", scores * (e + f), device),
                memory_kernel("softmax backward (fp32)", 3 * scores * f, device),
                memory_kernel("mask backward", scores * (2 * f + 1), device),
                memory_kernel("scale backward", 2 * scores * f, device),
                memory_kernel("gradient to 16-bit", scores * (f + e), device)]  # fmt: skip
    fused = [memory_kernel("softmax backward", 3 * scores * e, device)]
    return fused if shape.fused else [*fused, memory_kernel("scale and mask backward", 2 * scores * e, device)]


def _batched_gemm(name: str, batch: int, m: int, n: int, k: int, device: ComputeDevice) -> Kernel:
    """`batch` independent m x n x k products in one kernel: their tiles share the waves."""
    flops = 2.0 * batch * m * n * k
    bytes_moved = float(batch * device.bytes_per_element * (m * k + k * n + m * n))
    fill = _wave_fill(batch * max(m, n), min(m, n), device)
    compute = flops / (device.peak_flops_per_second * device.gemm_efficiency * fill)
    return Kernel(name, flops, bytes_moved, max(compute, bytes_moved / device.memory_bytes_per_second))


# transformers' eager RMSNorm: x.float(), pow(2), mean, x * rsqrt(var + eps), .to(dtype), weight *:
# bytes per element of the input, in order (e the 16-bit element size).
def rms_norm_forward_kernels(tokens: int, hidden: int, device: ComputeDevice) -> list[Kernel]:
    e, n = device.bytes_per_element, tokens * hidden
    return [
        memory_kernel("rms norm: to fp32", n * (e + FP32_BYTES), device),
        memory_kernel("rms norm: square", 2 * n * FP32_BYTES, device),
        memory_kernel("rms norm: mean", n * FP32_BYTES, device),
        memory_kernel("rms norm: scale", 2 * n * FP32_BYTES, device),
        memory_kernel("rms norm: to dtype", n * (FP32_BYTES + e), device),
        memory_kernel("rms norm: weight", 2 * n * e, device),
    ]


def rms_norm_backward_kernels(tokens: int, hidden: int, device: ComputeDevice) -> list[Kernel]:
    """Autograd through the same ops: about twice the forward's bytes."""
    e, n = device.bytes_per_element, tokens * hidden
    return [
        memory_kernel("rms norm backward: weight", 3 * n * e, device),
        memory_kernel("rms norm weight gradient", 2 * n * e, device),
        memory_kernel("rms norm backward: to fp32", n * (e + FP32_BYTES), device),
        memory_kernel("rms norm backward: scale", 3 * n * FP32_BYTES, device),
        memory_kernel("rms norm backward: rsqrt gradient", 2 * n * FP32_BYTES, device),
        memory_kernel("rms norm backward: square", 3 * n * FP32_BYTES, device),
        memory_kernel("rms norm backward: sum", 3 * n * FP32_BYTES, device),
        memory_kernel("rms norm backward: to dtype", n * (FP32_BYTES + e), device),
    ]


def _norm_forward(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    """A norm on `norm_tokens`: eager RMSNorm's passes, or one kernel (LayerNorm, fused RMSNorm)
    reading and writing b s h."""
    if shape.rms_norm and not shape.fused:
        return rms_norm_forward_kernels(shape.norm_tokens, shape.hidden, device)
    name = "rms norm" if shape.rms_norm else "layer norm"
    return [memory_kernel(name, 2 * shape.norm_tokens * shape.hidden * device.bytes_per_element, device)]


def _norm_backward(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    if shape.rms_norm and not shape.fused:
        return rms_norm_backward_kernels(shape.norm_tokens, shape.hidden, device)
    e, T, h = device.bytes_per_element, shape.norm_tokens, shape.hidden
    kernels = [
        memory_kernel("layer norm backward", 3 * T * h * e, device),
        memory_kernel("layer norm weight gradient", 2 * T * h * e, device),
    ]
    if shape.megatron_deepspeed:
        # Apex's fused LayerNorm backward is three kernels: partial weight and bias gradients per
        # block of rows (counted above), their sum over the blocks (this one: small), the input's
        # gradient (apex/csrc/layer_norm_cuda_kernel.cu, cuComputeGradGammaBeta).
        kernels.append(memory_kernel("layer norm weight gradient sum", 2 * h * FP32_BYTES, device))
    return kernels


# Rotary embeddings as transformers applies them to q and to k: rotate_half (a copy), x * cos,
# rotate_half(x) * sin, their sum: 11 element passes of each.
ROTARY_PASSES = 11
# A dropout mask element (torch's fused dropout keeps a bool per element).
DROPOUT_MASK_BYTES = 1
# A fused rotary kernel (Transformer Engine's, Apex's) reads q and k once and writes them once.
FUSED_ROTARY_PASSES = 2
# GPT-2's tanh GELU as eager ops (transformers' NewGELUActivation): pow, two scalings, add, tanh,
# add, two products: 17 element passes forward, about twice that backward.
GELU_PYTHON_PASSES = 17


def _rotary_passes(shape: BlockShape) -> int:
    return FUSED_ROTARY_PASSES if shape.fused else ROTARY_PASSES


def _qkv_forward(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    T, h, hl, kvl = shape.tokens, shape.hidden, shape.local_hidden, shape.local_kv
    if shape.kv_heads is None or shape.fused:  # one GEMM of width (h + 2 kv) / t (Megatron's linear_qkv)
        kernels = [gemm_kernel("qkv", T, shape.qkv_width, h, device)]
    else:
        kernels = [gemm_kernel("q", T, hl, h, device), gemm_kernel("k", T, kvl, h, device), gemm_kernel("v", T, kvl, h, device)]
    if shape.rotary:
        kernels.append(memory_kernel("rotary q, k", _rotary_passes(shape) * T * (hl + kvl) * device.bytes_per_element, device))
    return kernels


def _qkv_backward(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    e, T, h, hl, kvl = device.bytes_per_element, shape.tokens, shape.hidden, shape.local_hidden, shape.local_kv
    kernels = []
    if shape.rotary:
        kernels.append(memory_kernel("rotary q, k backward", _rotary_passes(shape) * T * (hl + kvl) * e, device))
    if shape.kv_heads is None or shape.fused:
        # q, k and v are views of one tensor: their gradients are concatenated into one.
        kernels += [memory_kernel("qkv split backward", 2 * T * shape.qkv_width * e, device)]
        kernels += _linear_backward("qkv", T, h, shape.qkv_width, device, shape.bias)
    else:
        for name, width in (("q", hl), ("k", kvl), ("v", kvl)):
            kernels += _linear_backward(name, T, h, width, device, shape.bias)
        kernels += [memory_kernel("q, k, v input gradient sum", 2 * 3 * T * h * e, device)]
    return kernels


def _mlp_forward(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    e, T, h, il = device.bytes_per_element, shape.tokens, shape.hidden, shape.local_ffn
    if shape.activation == "swiglu" and shape.fused:  # one gate/up GEMM, SiLU x up in one kernel
        return [
            gemm_kernel("gate, up", T, 2 * il, h, device),
            memory_kernel("swiglu", 3 * T * il * e, device),
            gemm_kernel("down", T, h, il, device),
        ]
    if shape.activation == "swiglu":
        return [
            gemm_kernel("gate", T, il, h, device),
            gemm_kernel("up", T, il, h, device),
            memory_kernel("silu", 2 * T * il * e, device),
            memory_kernel("silu x up", 3 * T * il * e, device),
            gemm_kernel("down", T, h, il, device),
        ]
    passes = GELU_PYTHON_PASSES if shape.activation == "gelu_python" else 2
    return [
        gemm_kernel("fc1", T, il, h, device),
        memory_kernel("gelu", passes * T * il * e, device),
        gemm_kernel("fc2", T, h, il, device),
    ]


def _mlp_backward(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    e, T, h, il = device.bytes_per_element, shape.tokens, shape.hidden, shape.local_ffn
    if shape.activation == "swiglu" and shape.fused:
        return [
            *_linear_backward("down", T, il, h, device, shape.bias),
            memory_kernel("swiglu backward", 5 * T * il * e, device),  # read dy, gate, up; write both
            *_linear_backward("gate, up", T, h, 2 * il, device, shape.bias),
        ]
    if shape.activation == "swiglu":
        return [
            *_linear_backward("down", T, il, h, device, shape.bias),
            memory_kernel("silu x up backward", 2 * 3 * T * il * e, device),
            memory_kernel("silu backward", 3 * T * il * e, device),
            *_linear_backward("up", T, h, il, device, shape.bias),
            *_linear_backward("gate", T, h, il, device, shape.bias),
            memory_kernel("gate, up input gradient sum", 3 * T * h * e, device),
        ]
    passes = 2 * GELU_PYTHON_PASSES if shape.activation == "gelu_python" else 3
    return [
        *_linear_backward("fc2", T, il, h, device, shape.bias),
        memory_kernel("gelu backward", passes * T * il * e, device),
        *_linear_backward("fc1", T, h, il, device, shape.bias),
    ]


def block_forward_kernels(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    """The kernels of one block shard's forward, in the order eager PyTorch issues them.

    Norm, QKV (bias in the GEMM's epilogue; three GEMMs and rotary embeddings for a Llama block),
    attention, proj, residual add, norm, the MLP (fc1, GELU, fc2; or gate, up, SiLU x up, down),
    residual add. Element-wise bytes: a LayerNorm reads and writes b s h, an add reads two and
    writes one, fused GELU reads and writes b s fh/t.
    """
    e, T, h, hl = device.bytes_per_element, shape.tokens, shape.hidden, shape.local_hidden
    if shape.attention is Attention.FLASH:
        attention = [flash_attention_kernel("flash attention", shape, attention_flops(shape), device)]
    else:
        attention = _unfused_attention_forward(shape, device)
    megatron_deepspeed = shape.megatron_deepspeed
    return [
        *_norm_forward(shape, device),
        *_qkv_forward(shape, device),
        *([memory_kernel("qkv bias add", 2 * T * shape.qkv_width * e, device)] if megatron_deepspeed else []),
        *attention,
        gemm_kernel("proj", T, h, hl, device),
        memory_kernel("residual add", _residual_bytes(shape, e), device),
        *_norm_forward(shape, device),
        *(_scalars_to_device() if megatron_deepspeed else []),
        *_mlp_forward(shape, device),
        *([memory_kernel("fc2 bias add", 2 * T * h * e, device)] if megatron_deepspeed else []),
        memory_kernel("residual add", _residual_bytes(shape, e), device),
    ]


def _scalars_to_device() -> list[Kernel]:
    """Megatron-DeepSpeed's layer makes `moe_loss` and `mlp_bias` as `torch.tensor(0.0,
    device=...)` in every forward (megatron/model/transformer.py, ParallelTransformerLayer.forward):
    each a copy from pageable host memory, which the host waits on."""
    return [Kernel("scalar to device (blocking)", 0.0, 4.0, 0.0, blocks_host=True)] * 2


def _residual_bytes(shape: BlockShape, e: int) -> int:
    """A residual add (forward) or its gradient's (backward): read two, write one b s h (s/t with
    sequence parallelism); with dropout the fused bias-dropout-add writes (reads) its mask too."""
    return (3 * e + (DROPOUT_MASK_BYTES if shape.dropout else 0)) * shape.norm_tokens * shape.hidden


def _linear_backward(
    name: str, tokens: int, inputs: int, outputs: int, device: ComputeDevice, bias: bool = True
) -> list[Kernel]:
    """Input gradient (T x in = dY[T x out] W), weight gradient (out x in = dY^T X, k = T), bias
    gradient (a column sum of dY): 2 x the forward's FLOPs (Narayanan et al. 2021, §3.3)."""
    e = device.bytes_per_element
    kernels = [
        gemm_kernel(f"{name} input gradient", tokens, inputs, outputs, device),
        gemm_kernel(f"{name} weight gradient", outputs, inputs, tokens, device),
    ]
    if bias:
        kernels.append(memory_kernel(f"{name} bias gradient", tokens * outputs * e, device))
    return kernels


def block_backward_kernels(shape: BlockShape, device: ComputeDevice, accumulate_gradients: bool = True) -> list[Kernel]:
    """The kernels of one block shard's backward, in autograd's order.

    With `accumulate_gradients` (every micro-batch of a step but the first, and a profiler's repeated
    runs) each parameter's gradient is added into its `.grad`: read both, write one.
    """
    e, T, h, hl = device.bytes_per_element, shape.tokens, shape.hidden, shape.local_hidden
    if shape.attention is Attention.FLASH:
        flops = FLASH_BACKWARD_PER_FORWARD * attention_flops(shape)
        attention = [
            memory_kernel("flash backward: dO . O", 2 * T * hl * e, device),
            flash_attention_kernel("flash attention backward", shape, flops, device),
            # dQ is accumulated in fp32 (zeroed first), then converted.
            memory_kernel("flash backward: dQ fp32 -> dtype", T * hl * (2 * FP32_BYTES + e), device),
        ]
    else:
        attention = _unfused_attention_backward(shape, device)
    # Megatron-DeepSpeed (`EngineFeatures.megatron_deepspeed_layer`): the backward of each fused
    # bias-dropout-add is a kernel of its own (its mask applied to the gradient).
    dropout_add = ([memory_kernel("bias-dropout-add backward", _residual_bytes(shape, e), device)]
                   if shape.megatron_deepspeed else [])  # fmt: skip
    kernels = [
        *dropout_add,
        *_mlp_backward(shape, device),
        *_norm_backward(shape, device),
        memory_kernel("residual gradient add", _residual_bytes(shape, e), device),
        *dropout_add,
        *_linear_backward("proj", T, hl, h, device, shape.bias),
        *attention,
        *_qkv_backward(shape, device),
        *_norm_backward(shape, device),
        memory_kernel("residual gradient add", _residual_bytes(shape, e), device),
    ]
    if accumulate_gradients and not shape.accumulation_fused:  # else the weight-gradient GEMM accumulates
        kernels += [memory_kernel("gradient accumulation", 3 * n * e, device) for n in shape.parameter_tensors()]
    return kernels


def attention_core_forward_kernels(shape: BlockShape, device: ComputeDevice) -> list[Kernel]:
    """The attention core's forward kernels (what selective recomputation runs again in the
    backward): the flash kernel, or unfused attention's scores, softmax, dropout and
    probabilities x V (not the context's transpose for proj, which is outside the core)."""
    if shape.attention is Attention.FLASH:
        return [flash_attention_kernel("flash attention", shape, attention_flops(shape), device)]
    return [kernel for kernel in _unfused_attention_forward(shape, device) if kernel.name != "context transpose"]
