"""Layer profiling, one instance of each distinct layer (`--once`) vs every layer: time and agreement.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_once.py [--models gpt-small,gpt-tiny] [--sizes 1]
        [--warmup 1] [--repeats 3] [--rounds 2]
    -> benchmarks/results/profile_once.json

Profiles each model's layers (`profile_model(..., runtime=False)`: the engine calibration is the
same in both modes and left out) on this CPU with one thread, as `pipectl profile` does, in the two
modes alternately, `--rounds` times each, in this one process. Records the wall time of each run,
the median per mode and their ratio; how many layers each mode measured; and how far the modes'
per-layer costs are apart: the largest relative difference of forward and of backward seconds over
every (layer, micro-batch size), next to the same figure between two every-layer runs (the
machine's own run-to-run noise, which the reused costs cannot be expected to beat). Byte counts
(output, saved, peak) and FLOPs must agree exactly: their largest absolute difference is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from pipectl.artifacts.profile import ModelProfile  # noqa: E402
from pipectl.models import build_model  # noqa: E402
from pipectl.profile.measure import profile_model  # noqa: E402


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare(first: ModelProfile, second: ModelProfile) -> dict:
    """Largest relative time differences (and where) and largest absolute byte/FLOP differences."""
    worst = {"forward": (0.0, ""), "backward": (0.0, "")}
    bytes_difference = 0.0
    for a_layer, b_layer in zip(first.layers, second.layers):
        for a, b in zip(a_layer.costs, b_layer.costs):
            where = f"{a_layer.name} b={a.micro_batch_size}"
            for key, x, y in (("forward", a.forward_seconds, b.forward_seconds),
                              ("backward", a.backward_seconds, b.backward_seconds)):  # fmt: skip
                if _relative(x, y) > worst[key][0]:
                    worst[key] = (_relative(x, y), where)
            for field in ("output_activation_bytes", "saved_activation_bytes", "peak_memory_bytes", "forward_flops"):
                bytes_difference = max(bytes_difference, abs(getattr(a, field) - getattr(b, field)))
    return {
        "max_relative_forward_difference": round(worst["forward"][0], 4),
        "at_forward": worst["forward"][1],
        "max_relative_backward_difference": round(worst["backward"][0], 4),
        "at_backward": worst["backward"][1],
        "max_absolute_bytes_or_flops_difference": bytes_difference,
    }


def run(name: str, sizes: list[int], args: argparse.Namespace) -> dict:
    model = build_model(name)

    seconds: dict[str, list[float]] = {"every_layer": [], "once": []}
    profiles: dict[str, list[ModelProfile]] = {"every_layer": [], "once": []}
    load = []
    for round_index in range(args.rounds):
        for mode in ("every_layer", "once"):
            load.append(os.getloadavg()[0])
            start = time.perf_counter()
            profile = profile_model(model, sizes, warmup=args.warmup, repeats=args.repeats, runtime=False,
                                    once=mode == "once")  # fmt: skip
            seconds[mode].append(round(time.perf_counter() - start, 2))
            profiles[mode].append(profile)
            print(f"{name} round {round_index}: {mode} {seconds[mode][-1]:.1f} s", flush=True)

    every, once = profiles["every_layer"][0], profiles["once"][0]
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    return {
        "model": name,
        "layers": len(model.layers),
        "micro_batch_sizes": sizes,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "threads": 1,
        "seconds": seconds,
        "median_seconds": median,
        "speedup": round(median["every_layer"] / median["once"], 2),
        "layers_measured": {
            "every_layer": len(every.layers),
            "once": sum(layer.costs_from is None for layer in once.layers),
        },
        "once_vs_every_layer": compare(every, once),
        "every_layer_vs_every_layer": compare(*profiles["every_layer"][:2]) if args.rounds > 1 else None,
        "load_average_1min": [round(value, 2) for value in load],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-small,gpt-tiny", help="comma-separated model names")
    parser.add_argument("--sizes", default="1", help="comma-separated micro-batch sizes")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "profile_once.json")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    result = {
        "runs": [run(name, sizes, args) for name in args.models.split(",")],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_once.py " + " ".join(sys.argv[1:]),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
