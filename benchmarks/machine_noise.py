"""How steady this machine's compute is: the spread of one fixed CPU workload, timed again and again.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/machine_noise.py [--repeats 15]
    -> benchmarks/results/machine_noise.json

The calibration benchmark (`benchmarks/calibration.py`) compares predicted and measured step
times of short training runs; a prediction cannot be checked to a finer figure than the one a
measurement repeats to. This script times the same single-threaded float32 matmul loop (200
products of 512 x 512, about half a second) `--repeats` times:

- alone, the other cores idle;
- beside a twin process running the same loop on another core, as a two-rank job shares the
  machine's two cores.

It reports, per setting, the spread (slowest / fastest - 1), the interquartile ratio (third
quartile / first - 1) and each repeat's seconds, with the load average. Run it before the
calibration benchmark: a median error target below the interquartile ratio cannot be told from
noise on this machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "machine_noise.json"
PRODUCTS = 200
SIZE = 512


def _loop_seconds() -> float:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)
    started = time.perf_counter()
    for _ in range(PRODUCTS):
        a @ b
    return time.perf_counter() - started


def _repeat(repeats: int) -> list[float]:
    _loop_seconds()  # warm-up: first-touch allocations and the thread pool
    return [_loop_seconds() for _ in range(repeats)]


def _twin(stop) -> None:
    while not stop.is_set():
        _loop_seconds()


def _figures(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    quartiles = statistics.quantiles(ordered, n=4)
    return {
        "median_seconds": round(statistics.median(ordered), 4),
        "spread": round(ordered[-1] / ordered[0] - 1, 4),
        "interquartile_ratio": round(quartiles[2] / quartiles[0] - 1, 4),
        "seconds": [round(value, 4) for value in seconds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if args.repeats < 4:
        parser.error(f"--repeats must be at least 4 (quartiles), got {args.repeats}")
    load_before = os.getloadavg()[0]
    alone = _repeat(args.repeats)
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    twin = context.Process(target=_twin, args=(stop,))
    twin.start()
    try:
        time.sleep(2.0)  # the twin past its imports and warm-up
        beside = _repeat(args.repeats)
    finally:
        stop.set()
        twin.join(timeout=30)
    result = {
        "benchmark": "machine_noise",
        "workload": f"{PRODUCTS} float32 matmuls of {SIZE} x {SIZE}, one thread",
        "repeats": args.repeats,
        "alone": _figures(alone),
        "beside_a_twin": _figures(beside),
        "cpus": os.cpu_count(),
        "load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "machine": f"{platform.machine()}, python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/machine_noise.py"
        + (f" --repeats {args.repeats}" if args.repeats != 15 else ""),
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: value for key, value in result.items() if key not in ("alone", "beside_a_twin")}, indent=2))
    for setting in ("alone", "beside_a_twin"):
        figures = result[setting]
        print(f"{setting}: median {figures['median_seconds']} s, spread {figures['spread']:.1%}, "
              f"interquartile {figures['interquartile_ratio']:.1%}")


if __name__ == "__main__":
    main()
