"""What the measured and published runs say of the memory-bound kernels' speed (issue #45): a what-if.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_kernels.py [--kernel-times FILE] [--no-write]

The compute model prices every element-wise or reduction kernel at 90 % of the datasheet memory
bandwidth (`profile/compute_model.py`, MEMORY_EFFICIENCY, from BabelStream's streaming kernels).
`benchmarks/kernel_times.py` timed each kernel of a Megatron block on a GPU
(`results/kernel_times-h200.json`): the streaming ones reach that (dropout's backward, a multiply by
its mask), but PyTorch's reductions and copies (layer norm, column sums of bias gradients, the
context's permute) and the TorchScript-fused GELU and bias-dropout-add took 1.6-4x the model.

This script predicts vTrain's 1,440 single-node A100 rows and the published large-scale runs
(`published_runs.yaml`, layouts pinned) with each named kernel's time multiplied by the ratio that
GPU measured for it (the median over its shapes), as if every device reached the same fraction of
its bandwidth, for three sets of kernels:

- `torch_native`: kernels that are PyTorch's own in every engine (bias-gradient sums, the context's
  permute, the QKV concatenation, attention dropout and its backward, the residual gradient add);
- `with_layer_norm`: those and the layer norms (engines run apex's or Transformer Engine's instead);
- `all`: every kernel timed, the fused softmax and the JIT-fused GELU and bias-dropout-add too (their
  stand-ins are torch.softmax and TorchScript in the GPU's PyTorch, not the engines' kernels).

A kernel is matched by its name: those the GPU did not time (Megatron-DeepSpeed's bias-dropout-add
backward and bias adds, the losses' and embeddings' kernels) keep the model's time in every reading.

Nothing is fitted: the ratios come from the GPU's timings alone; the rows only say which reading
they agree with. A diagnostic, not a term the predictions use. Writes
benchmarks/results/memory_kernels.json with the command and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import pipectl.profile.compute_model as compute_model  # noqa: E402
import pipectl.profile.layer_shapes as layer_shapes  # noqa: E402
from pipectl.io import write_json_atomic  # noqa: E402
from pipectl.measured.predict import predict_runs  # noqa: E402
from pipectl.measured.runs import load_conditions, read_runs  # noqa: E402
from pipectl.measured.summary import summarise_errors  # noqa: E402
from published_runs import pinned_errors  # noqa: E402

SHARED_RUNS = ROOT.parent / "shared" / "reference" / "vtrain-a100"
KERNEL_TIMES = ROOT / "benchmarks" / "results" / "kernel_times-h200.json"
RESULTS = ROOT / "benchmarks" / "results" / "memory_kernels.json"
SMALLEST_BYTES = 1e7  # smaller kernels are timed at the launch floor, not their bandwidth

TORCH_NATIVE = ("fc1 bias gradient", "fc2 bias gradient", "proj bias gradient", "qkv bias gradient",
                "context transpose", "context transpose backward", "qkv split backward", "attention dropout",
                "attention dropout backward", "residual gradient add")  # fmt: skip
LAYER_NORM = ("layer norm", "layer norm backward", "layer norm weight gradient")


def measured_ratios(path: Path) -> dict[str, float]:
    """Measured over model time per memory-bound kernel name: the median over the shapes timed."""
    ratios: dict[str, list[float]] = {}
    for shape in json.loads(path.read_text())["shapes"]:
        for kernel in shape["kernels"]:
            if not kernel["gemm"] and kernel["measured_over_model"] and kernel["model_bytes"] >= SMALLEST_BYTES:
                ratios.setdefault(kernel["kernel"], []).append(kernel["measured_over_model"])
    return {name: statistics.median(values) for name, values in ratios.items()}


@contextmanager
def memory_kernels_scaled(factors: dict[str, float]):
    """Every memory-bound kernel named in `factors` takes that many times its modelled time."""
    original = compute_model.memory_kernel

    def scaled(name, bytes_moved, device):
        kernel = original(name, bytes_moved, device)
        factor = factors.get(name, 1.0)
        return kernel if factor == 1.0 else compute_model.Kernel(
            kernel.name, kernel.flops, kernel.bytes_moved, kernel.seconds * factor, kernel.blocks_host)

    # Both modules that price memory-bound kernels (layer_shapes: the final norm, embeddings, head, loss).
    compute_model.memory_kernel = layer_shapes.memory_kernel = scaled
    try:
        yield
    finally:
        compute_model.memory_kernel = layer_shapes.memory_kernel = original


def predict_both(runs, conditions) -> dict:
    """The shared rows' errors (by hidden size too) and the published runs' (pinned layouts)."""
    predictions = predict_runs(runs, conditions)
    by_hidden: dict[str, list[float]] = {}
    for p in predictions:
        if p.error is not None:
            by_hidden.setdefault(f"h{p.run.hidden}", []).append(p.error)
    shared = summarise_errors(predictions).to_dict()
    published = pinned_errors(workers=os.cpu_count() or 1)
    worst = sorted((r for r in published["rows"] if r["error"] is not None), key=lambda r: abs(r["error"]))[-5:]
    return {
        "shared_rows": {key: round(value, 4) if isinstance(value, float) else value for key, value in shared.items()}
        | {"signed_median_by_hidden": {h: round(statistics.median(e), 4) for h, e in sorted(by_hidden.items())}},
        "published_runs": published["summary"],
        "published_worst": {r["id"]: r["error"] for r in reversed(worst)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-times", type=Path, default=KERNEL_TIMES, help="benchmarks/kernel_times.py's results")
    parser.add_argument("--no-write", action="store_true", help="do not update the results file")
    args = parser.parse_args()
    ratios = measured_ratios(args.kernel_times)
    runs = read_runs(SHARED_RUNS / "single-node.csv")
    conditions = load_conditions(SHARED_RUNS / "conditions.yaml")
    readings = {
        "as_modelled": {},
        "torch_native": {name: ratios[name] for name in TORCH_NATIVE if name in ratios},
        "with_layer_norm": {name: ratios[name] for name in (*TORCH_NATIVE, *LAYER_NORM) if name in ratios},
        "all": ratios,
    }
    started = time.perf_counter()
    results = {}
    for label, factors in readings.items():
        with memory_kernels_scaled(factors):
            results[label] = {"factors": {name: round(f, 3) for name, f in factors.items()}, **predict_both(runs, conditions)}
        shared, published = results[label]["shared_rows"], results[label]["published_runs"]
        print(f"{label:>16}: shared rows MAPE {shared['mape']:.1%}, signed median {shared['signed_median_error']:+.1%} "
              f"({', '.join(f'{h} {e:+.1%}' for h, e in shared['signed_median_by_hidden'].items())}); published runs "
              f"median {published['median_abs_error']:.1%}, max {published['max_abs_error']:.1%}, "
              f"mean signed {published['mean_signed_error']:+.1%}")
    if args.no_write:
        return
    times = args.kernel_times
    write_readings(RESULTS, started, results, kernel_times=str(times.relative_to(ROOT)) if times.is_relative_to(ROOT) else str(times))


def write_readings(path: Path, started: float, readings: dict, **more: object) -> None:
    """A what-if's readings, with the command that made them (the script's own), the date and machine."""
    write_json_atomic(path, {
        "command": f"OMP_NUM_THREADS=1 .venv/bin/python benchmarks/{Path(sys.argv[0]).name}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        **more,
        "seconds": round(time.perf_counter() - started, 1),
        "readings": readings,
    })  # fmt: skip
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
