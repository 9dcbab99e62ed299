"""Each kernel of a derived Megatron block timed alone on this host's GPU, against the kernel model (issue #45).

    python benchmarks/kernel_times.py [--device-kind NAME] [--shape h,heads,s,b,t ...] [--repeats N] [--out DIR]
    python benchmarks/kernel_times.py --device cpu      # a check of the script on small shapes, not a figure

The published A100 runs are predicted too fast by a share that grows with the part of the block
that is not GEMMs (benchmarks/README.md, published_runs): some kernels run slower than the model
says. Which ones is a measurement, not a fit. This builds the kernel list the planner prices for a
block of Megatron's as the published rows ran it (`profile.compute_model.block_forward_kernels` and
`block_backward_kernels`: fused element-wise kernels, dropout, unfused attention), runs the PyTorch
operation behind each kernel on random 16-bit tensors of its shape, timed with CUDA events (median
of `--repeats`), and prints per kernel the model's bytes and time, the measured time, their ratio
and the bandwidth reached, then the totals for GEMMs and for the memory-bound rest. Where Megatron
runs a fused kernel of its own (scale-mask-softmax, bias-GeLU, bias-dropout-add), the stand-in moves
the same bytes: `torch.softmax`, and TorchScript functions as Megatron writes them.

Writes benchmarks/results/kernel_times-<device kind>.json (or `--out DIR`) with the command, the
device and the date; with `--device cpu` it writes nothing unless `--out` is given.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_check import device_kind_of  # noqa: E402
from pipectl.catalog import get_device  # noqa: E402
from pipectl.profile.compute_model import (  # noqa: E402
    Attention, BlockShape, ComputeDevice, Kernel, block_backward_kernels, block_forward_kernels,
)

RESULTS = ROOT / "benchmarks" / "results"
# Narayanan et al. 2021's 1.7B block at its b = 16 (t = 1), and one tensor rank of its 18B block (t = 8, b = 8).
DEFAULT_SHAPES = ("2304,24,2048,16,1", "6144,48,2048,8,8")
CPU_SHAPES = ("256,4,128,2,1", "256,4,128,2,2")
DROPOUT = 0.1


@torch.jit.script
def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Megatron's fused bias-GeLU (megatron/model/fused_bias_gelu.py), tanh approximation."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


@torch.jit.script
def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


@torch.jit.script
def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, prob: float) -> torch.Tensor:
    """Megatron's fused bias-dropout-add (megatron/model/transformer.py, bias_dropout_add_fused_train)."""
    out = torch.nn.functional.dropout(x + bias, p=prob, training=True)
    return residual + out


@torch.jit.script
def dropout_add_back(grad: torch.Tensor, residual_grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The residual's gradient plus the dropped branch's: the gradient, its 1-byte mask and the residual
    read, the sum written (the bytes the model counts for the residual gradient add with dropout)."""
    return residual_grad + grad * mask * scale


class Block:
    """Random tensors of one block shard's shapes, and the operation behind each model kernel."""

    def __init__(self, shape: BlockShape, device: str, dtype: torch.dtype) -> None:
        self.shape = shape
        b, s, h = shape.micro_batch_size, shape.seq_len, shape.hidden
        hl, f, heads, d = shape.local_hidden, shape.local_ffn, shape.local_heads, shape.head_dim
        tokens, batch = b * s, b * heads

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, dtype=dtype)

        self.x, self.residual, self.grad_h = rand(tokens, h), rand(tokens, h), rand(tokens, h)
        self.residual_mask = torch.rand(tokens, h, device=device) > DROPOUT
        self.norm_weight, self.norm_bias = rand(h), rand(h)
        _, self.mean, self.rstd = torch.native_layer_norm(self.x, [h], self.norm_weight, self.norm_bias, 1e-5)
        self.weights = {"qkv": rand(h, 3 * hl), "proj": rand(hl, h), "fc1": rand(h, f), "fc2": rand(f, h)}
        self.inputs = {"qkv": self.x, "proj": rand(tokens, hl), "fc1": self.x, "fc2": rand(tokens, f)}
        self.outputs = {"qkv": rand(tokens, 3 * hl), "proj": self.grad_h, "fc1": rand(tokens, f), "fc2": self.grad_h}
        self.qkv_bias, self.ffn_bias, self.h_bias = rand(3 * hl), rand(f), rand(h)
        self.q, self.k, self.v = rand(batch, s, d), rand(batch, s, d), rand(batch, s, d)
        self.scores, self.scores_grad = rand(batch, s, s), rand(batch, s, s)
        self.scores_out = torch.empty_like(self.scores)
        self.probs = torch.softmax(self.scores.float(), dim=-1).to(dtype)
        # Megatron's fp32 softmax path, where its fused kernel does not run (`BlockShape.softmax_fallback`)
        self.scores32, self.probs32 = self.scores.float(), self.probs.float()
        self.causal = torch.ones(1, s, s, device=device, dtype=torch.bool).triu(1)
        self.dropped, self.mask = torch.native_dropout(self.probs, DROPOUT, True)
        self.context = rand(b, heads, s, d)
        self.qkv_parts = [rand(tokens, hl) for _ in range(3)]
        self.accumulated = {n: torch.zeros(n, device=device, dtype=dtype) for n in set(shape.parameter_tensors())}
        self.new_grads = {n: rand(n) for n in self.accumulated}

    def operation(self, kernel: str) -> Callable[[], object] | None:
        """The PyTorch call behind one kernel of the model, or None where there is none to time."""
        s = self
        linear = kernel.split(" ")[0]
        if kernel == "layer norm":
            return lambda: F.layer_norm(s.x, (s.shape.hidden,), s.norm_weight, s.norm_bias)
        if kernel in ("layer norm backward", "layer norm weight gradient"):
            mask = [True, False, False] if kernel == "layer norm backward" else [False, True, True]
            return lambda: torch.ops.aten.native_layer_norm_backward(
                s.grad_h, s.x, [s.shape.hidden], s.mean, s.rstd, s.norm_weight, s.norm_bias, mask)
        if kernel == "qkv":  # the bias in the GEMM's epilogue
            return lambda: torch.addmm(s.qkv_bias, s.x, s.weights["qkv"])
        if kernel in ("proj", "fc1", "fc2"):  # bias added by the fused element-wise kernel after it
            return lambda: torch.mm(s.inputs[kernel], s.weights[kernel])
        if kernel.endswith(" input gradient"):
            return lambda: torch.mm(s.outputs[linear], s.weights[linear].t())
        if kernel.endswith(" weight gradient") and linear in s.weights:
            return lambda: torch.mm(s.inputs[linear].t(), s.outputs[linear])
        if kernel.endswith(" bias gradient"):
            return lambda: s.outputs[linear].sum(dim=0)
        if kernel == "scores QK^T":
            scale = 1.0 / s.shape.head_dim**0.5
            return lambda: torch.baddbmm(s.scores_out, s.q, s.k.transpose(1, 2), beta=0.0, alpha=scale)
        if kernel == "scale, mask and softmax":
            return lambda: torch.softmax(s.scores, dim=-1)
        fp32_path = {
            "scores to fp32": lambda: s.scores.float(),
            "scale": lambda: s.scores32 * 0.125,
            "mask": lambda: s.scores32.masked_fill(s.causal, -10000.0),
            "softmax (fp32)": lambda: torch.softmax(s.scores32, dim=-1),
            "probabilities to 16-bit": lambda: s.probs32.to(s.probs.dtype),
            "gradient to fp32": lambda: s.scores_grad.float(),
            "softmax backward (fp32)": lambda: torch.ops.aten._softmax_backward_data(s.probs32, s.probs32, -1, torch.float32),
            "mask backward": lambda: s.probs32.masked_fill(s.causal, 0.0),
            "scale backward": lambda: s.probs32 * 0.125,
            "gradient to 16-bit": lambda: s.probs32.to(s.probs.dtype),
        }
        if kernel in fp32_path:
            return fp32_path[kernel]
        if kernel == "attention dropout":
            return lambda: torch.native_dropout(s.probs, DROPOUT, True)
        if kernel == "attention dropout backward":
            return lambda: torch.ops.aten.native_dropout_backward(s.scores_grad, s.mask, 1.0 / (1.0 - DROPOUT))
        if kernel == "softmax backward":
            return lambda: torch.ops.aten._softmax_backward_data(s.scores_grad, s.probs, -1, s.probs.dtype)
        if kernel == "probabilities x V":
            return lambda: torch.bmm(s.dropped, s.v)
        if kernel == "dP = dO V^T":
            return lambda: torch.bmm(s.q, s.v.transpose(1, 2))
        if kernel == "dV = P^T dO":
            return lambda: torch.bmm(s.dropped.transpose(1, 2), s.q)
        if kernel == "dQ = dS K":
            return lambda: torch.bmm(s.scores_grad, s.k)
        if kernel == "dK = dS^T Q":
            return lambda: torch.bmm(s.scores_grad.transpose(1, 2), s.q)
        if kernel in ("context transpose", "context transpose backward"):
            return lambda: s.context.permute(2, 0, 1, 3).contiguous()
        if kernel == "residual add":
            return lambda: bias_dropout_add(s.grad_h, s.h_bias, s.residual, DROPOUT)
        if kernel == "residual gradient add":
            if s.shape.dropout:
                return lambda: dropout_add_back(s.grad_h, s.residual, s.residual_mask, 1.0 / (1.0 - DROPOUT))
            return lambda: s.grad_h + s.residual
        if kernel == "gelu":
            return lambda: bias_gelu(s.ffn_bias, s.outputs["fc1"])
        if kernel == "gelu backward":
            return lambda: bias_gelu_back(s.outputs["fc1"], s.ffn_bias, s.outputs["fc1"])
        if kernel == "qkv split backward":
            return lambda: torch.cat(s.qkv_parts, dim=-1)
        return None

    def accumulation(self, elements: int) -> Callable[[], object]:
        return lambda: self.accumulated[elements].add_(self.new_grads[elements])


def timed(call: Callable[[], object], device: str, repeats: int) -> float:
    """Median seconds of one call (after three warm-ups: TorchScript fuses on its second run)."""
    for _ in range(3):
        call()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            call()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def is_gemm(kernel: Kernel) -> bool:
    return kernel.flops > 0


def measure_shape(shape: BlockShape, model_device: ComputeDevice, device: str, repeats: int) -> dict:
    dtype = torch.float16
    block = Block(shape, device, dtype)
    parameter_tensors = iter(shape.parameter_tensors())
    rows = []
    for phase, kernels in (("forward", block_forward_kernels(shape, model_device)),
                           ("backward", block_backward_kernels(shape, model_device))):
        for kernel in kernels:
            if kernel.name == "gradient accumulation":
                call = block.accumulation(next(parameter_tensors))
            else:
                call = block.operation(kernel.name)
            measured = timed(call, device, repeats) if call is not None else None
            rows.append({
                "phase": phase, "kernel": kernel.name, "gemm": is_gemm(kernel),
                "model_bytes": kernel.bytes_moved, "model_flops": kernel.flops,
                "model_us": round(kernel.seconds * 1e6, 2),
                "measured_us": round(measured * 1e6, 2) if measured is not None else None,
                "measured_over_model": round(measured / kernel.seconds, 3) if measured and kernel.seconds else None,
                "achieved_gbytes_per_second": round(kernel.bytes_moved / measured / 1e9, 1) if measured else None,
            })
    del block
    if device == "cuda":
        torch.cuda.empty_cache()
    totals = {}
    for label, pick in (("gemm", lambda r: r["gemm"]), ("memory_bound", lambda r: not r["gemm"]), ("all", lambda r: True)):
        chosen = [r for r in rows if pick(r) and r["measured_us"] is not None]
        model = sum(r["model_us"] for r in chosen)
        measured = sum(r["measured_us"] for r in chosen)
        totals[label] = {"kernels": len(chosen), "model_ms": round(model / 1e3, 3), "measured_ms": round(measured / 1e3, 3),
                         "measured_over_model": round(measured / model, 3) if model else None}
    return {"shape": {"hidden": shape.hidden, "heads": shape.heads, "seq_len": shape.seq_len,
                      "micro_batch_size": shape.micro_batch_size, "tensor_parallel": shape.tensor_parallel},
            "kernels": rows, "totals": totals}


def parse_shape(text: str) -> BlockShape:
    try:
        hidden, heads, seq_len, b, t = (int(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--shape {text!r}: expected h,heads,s,b,t (five integers)") from None
    return BlockShape(hidden=hidden, heads=heads, seq_len=seq_len, micro_batch_size=b, tensor_parallel=t,
                      attention=Attention.UNFUSED, fused=True, dropout=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--device-kind", help="the catalog entry whose constants the model reads (default: detected)")
    parser.add_argument("--shape", action="append", help="h,heads,s,b,t of a block shard (repeatable)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, help="folder for the JSON (default benchmarks/results; cpu: none)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kernel_times: no CUDA device visible (use --device cpu for a check of the script)")
    kind = device_kind_of(args.device, args.device_kind)
    model_device = ComputeDevice.of(get_device("a100-80gb" if kind == "cpu" else kind), "float16")
    if model_device is None:
        raise SystemExit(f"kernel_times: the catalog entry {kind!r} has no compute constants")
    shapes = [parse_shape(text) for text in (args.shape or (CPU_SHAPES if args.device == "cpu" else DEFAULT_SHAPES))]
    results = []
    for shape in shapes:
        result = measure_shape(shape, model_device, args.device, args.repeats)
        results.append(result)
        label = ", ".join(f"{k} {v}" for k, v in result["shape"].items())
        print(f"{label}: model priced as {model_device.name}")
        print(f"  {'phase':<9} {'kernel':<28} {'model us':>10} {'measured':>10} {'ratio':>6} {'GB/s':>8}")
        for row in result["kernels"]:
            measured = f"{row['measured_us']:.1f}" if row["measured_us"] is not None else "-"
            ratio = f"{row['measured_over_model']:.2f}" if row["measured_over_model"] is not None else "-"
            rate = f"{row['achieved_gbytes_per_second']:.0f}" if row["achieved_gbytes_per_second"] is not None else "-"
            print(f"  {row['phase']:<9} {row['kernel']:<28} {row['model_us']:>10.1f} {measured:>10} {ratio:>6} {rate:>8}")
        for label, total in result["totals"].items():
            print(f"  {label}: {total['kernels']} kernels, model {total['model_ms']} ms, measured {total['measured_ms']} ms, "
                  f"ratio {total['measured_over_model']}")
    out = args.out or (None if args.device == "cpu" else RESULTS)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernel_times-{kind}.json"
    path.write_text(json.dumps({
        "benchmark": "each kernel of a derived Megatron block (fused, dropout, unfused attention) timed alone",
        "command": "python benchmarks/kernel_times.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "device_kind": kind,
        "model_constants_of": model_device.name,
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "repeats": args.repeats,
        "shapes": results,
    }, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
