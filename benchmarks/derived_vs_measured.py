"""Derived vs measured block shards on the reference device: per-row ratios, before and after.

Reads a reference file of measured tensor-parallel block shards (default:
tests/profile/data/h100-block-shards.json, one H100 80GB, bf16, flash attention through torch SDPA)
and derives each row with `pipectl.profile.compute_model` on the catalog device the file was
measured on. Prints derived/measured forward, backward and saved-activation ratios per row, and the
median and max |ratio - 1| of each (also apart for the phases above and near the launch floor,
and for the launch-bound rows the least max error any one figure could reach), for:

- after: the kernel model (compute_model: GEMM shapes and waves, flash attention, element-wise
  bytes, host overhead per kernel; saved bytes tensor by tensor);
- before: what the derived profile and the planner gave until this model (commit 50e10a7):
  24 b s h^2 + 4 b s^2 h FLOPs / t at peak x efficiency(b) from the catalog's curve, times the
  planner's tensor-parallel slowdown efficiency(b) / efficiency(b / t); backward 2 x forward;
  saved bytes Korthikanti et al. 2022 eq. 1 divided by t (plan/memory.py).

    .venv/bin/python benchmarks/derived_vs_measured.py
    -> benchmarks/results/derived_vs_measured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pipectl.catalog import DeviceSpec, get_device  # noqa: E402
from pipectl.io import write_json_atomic  # noqa: E402
from pipectl.plan.costs import tensor_parallel_slowdown  # noqa: E402
from pipectl.profile.compute_model import (  # noqa: E402
    BlockShape,
    ComputeDevice,
    block_backward_kernels,
    block_forward_kernels,
    phase_seconds,
)
from pipectl.profile.block_memory import block_saved_bytes  # noqa: E402

DEFAULT_REFERENCE = ROOT / "tests" / "profile" / "data" / "h100-block-shards.json"
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "derived_vs_measured.json"
MIB = 2**20
# The reference's device string -> catalog name.
CATALOG_NAMES = {"H100 80GB": "h100-80gb"}


def catalog_name(device_description: str) -> str:
    for marker, name in CATALOG_NAMES.items():
        if marker in device_description:
            return name
    raise SystemExit(f"no catalog device for '{device_description}'")


def block_of(row: dict) -> BlockShape:
    return BlockShape(hidden=row["h"], heads=row["heads"], seq_len=row["s"], micro_batch_size=row["b"],
                      tensor_parallel=row["t"])


def after(row: dict, device: ComputeDevice) -> dict[str, float]:
    shape = block_of(row)
    return {
        "fwd_ms": phase_seconds(block_forward_kernels(shape, device), device) * 1e3,
        "bwd_ms": phase_seconds(block_backward_kernels(shape, device), device) * 1e3,
        "saved_mib": block_saved_bytes(shape, device.bytes_per_element) / MIB,
    }


def bound(row: dict, device: ComputeDevice) -> dict[str, str]:
    """Per phase, where the model puts it: 'near' the launch floor when the kernels' GPU
    time is under twice the host's issue time (n x overhead), where the host's own spread shows;
    'above' otherwise (the split tests/profile/test_compute_model.py holds the model to); and
    whether it is launch-bound (GPU time under the issue time: the model's figure is the host's)."""
    shape = block_of(row)
    result = {}
    for column, kernels in (("fwd_ms", block_forward_kernels(shape, device)),
                            ("bwd_ms", block_backward_kernels(shape, device))):
        issue = len(kernels) * device.kernel_overhead_seconds
        gpu = sum(k.seconds for k in kernels)
        result[column] = "above" if gpu >= 2 * issue else "near"
        result[f"{column} launch-bound"] = gpu < issue
    return result


def launch_floor(measured_ms: list[float]) -> dict[str, float]:
    """The measured spread of the launch-bound rows, and the least max |error| any one figure
    could reach over them: the model issues the same kernels for each and gives them nearly one
    figure (the host's issue time), and any x errs by at least (m2 - m1) / (m2 + m1) against the smallest m1
    or the largest m2."""
    low, high = min(measured_ms), max(measured_ms)
    return {"rows": len(measured_ms), "min_ms": low, "max_ms": high,
            "least_max_abs_error": round((high - low) / (high + low), 4)}


def before(row: dict, device: DeviceSpec) -> dict[str, float]:
    b, s, h, t, a = row["b"], row["s"], row["h"], row["t"], row["heads"]
    flops = (24 * b * s * h * h + 4 * b * s * s * h) / t
    forward = flops / device.achievable_flops_per_second("bfloat16", b) * tensor_parallel_slowdown(device, b, t)
    saved = s * b * h * 34 + a * s * s * b * 5  # Korthikanti et al. 2022 eq. 1, 16-bit
    return {"fwd_ms": forward * 1e3, "bwd_ms": 2 * forward * 1e3, "saved_mib": saved / t / MIB}


def summary(ratios: list[float]) -> dict[str, float]:
    errors = [abs(r - 1) for r in ratios]
    return {
        "median_abs_error": round(statistics.median(errors), 4),
        "max_abs_error": round(max(errors), 4),
        "min_ratio": round(min(ratios), 3),
        "max_ratio": round(max(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    reference = json.loads(args.reference.read_text())
    spec = get_device(catalog_name(reference["device"]))
    device = ComputeDevice.of(spec, "bfloat16")
    if device is None:
        raise SystemExit(f"catalog device '{spec.name}' has no compute constants")
    columns = ("fwd_ms", "bwd_ms", "saved_mib")
    rows = []
    print(f"{'h':>6} {'t':>2} {'b':>2}   {'fwd':>6} {'bwd':>6} {'saved':>6}   (derived / measured; before in brackets)")
    for row in reference["rows"]:
        new, old = after(row, device), before(row, spec)
        ratios = {c: new[c] / row[c] for c in columns}
        old_ratios = {c: old[c] / row[c] for c in columns}
        rows.append({
            "h": row["h"], "t": row["t"], "b": row["b"], "s": row["s"], "bound": bound(row, device),
            "measured": {c: row[c] for c in columns},
            "derived": {c: round(new[c], 4) for c in columns},
            "ratio": {c: round(ratios[c], 4) for c in columns},
            "ratio_before": {c: round(old_ratios[c], 4) for c in columns},
        })
        print(f"{row['h']:>6} {row['t']:>2} {row['b']:>2}   "
              + " ".join(f"{ratios[c]:>6.2f}" for c in columns) + "   ["
              + " ".join(f"{old_ratios[c]:.2f}" for c in columns) + "]")
    result = {
        "reference": str(args.reference.relative_to(ROOT)) if args.reference.is_relative_to(ROOT) else str(args.reference),
        "device": reference["device"],
        "catalog_device": spec.name,
        "constants": {
            "peak_tflops_bf16": spec.peak_tflops_bf16,
            "memory_bandwidth_gbytes_per_second": spec.memory_bandwidth_gbytes_per_second,
            "multiprocessors": spec.multiprocessors,
            "gemm_efficiency": spec.gemm_efficiency,
            "attention_efficiency": spec.attention_efficiency,
            "kernel_overhead_us": spec.kernel_overhead_us,
        },
        "after": {c: summary([r["ratio"][c] for r in rows]) for c in columns},
        "before": {c: summary([r["ratio_before"][c] for r in rows]) for c in columns},
        # Phases near the launch floor (host overhead) apart from those above it, and the least
        # max error any model that gives the floor's rows one figure could reach on them.
        "after_by_bound": {
            c: {
                kind: summary([r["ratio"][c] for r in rows if r["bound"][c] == kind])
                for kind in ("above", "near") if any(r["bound"][c] == kind for r in rows)
            }
            for c in ("fwd_ms", "bwd_ms")
        },
        "launch_floor": {
            c: launch_floor([r["measured"][c] for r in rows if r["bound"][f"{c} launch-bound"]])
            for c in ("fwd_ms", "bwd_ms") if any(r["bound"][f"{c} launch-bound"] for r in rows)
        },
        "rows": rows,
    }
    print()
    for label in ("before", "after"):
        print(f"{label:>6}: " + "  ".join(
            f"{c} median {result[label][c]['median_abs_error']:.1%} max {result[label][c]['max_abs_error']:.1%}"
            for c in columns))
    for c, by_bound in result["after_by_bound"].items():
        print(f"{c}, " + "  ".join(
            f"{kind} the launch floor: median {figures['median_abs_error']:.1%} max {figures['max_abs_error']:.1%}"
            for kind, figures in by_bound.items()))
    for c, floor in result["launch_floor"].items():
        print(f"{c}: {floor['rows']} launch-bound rows measured {floor['min_ms']}-{floor['max_ms']} ms for "
              f"the same kernels: no one figure is within {floor['least_max_abs_error']:.1%} of all of them")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.output, result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
