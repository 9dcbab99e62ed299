"""Planner at scale: GPT 1T (global batch 3072) or GPT-3 175B (1536) on 384 x 8 A100-80GB, the default search + morph table.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale.py [--model gpt-1t|gpt3-175b] [--repeats 3] [--workers 1,auto]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale.py --single --workers 1 [--profile-out stats.prof]

Derives the model's profile (1T: 128 blocks, h 25600, s 2048, V 51200; GPT-3: 96 blocks, h 12288,
s 2048; micro-batch sizes 1, 2, 4, 8) and plans for all 3,072 GPUs what `pipectl plan` searches by
default (the schedules 1f1b, gpipe, interleaved (v = 2, 4) and Varuna, the recomputations offered,
the runtime's ZeRO-1) with the morph table over the counts a resize reaches. GPT-3 is the first-hour
plan of issue #40 (target 5 s); its figures go to results/plan_scale_gpt3.json.

Every timing is a cold search in a fresh process (the planner's caches start empty), and the
worker counts asked for are run alternately, `--repeats` times each, so their ratio comes from
one run on one machine. Prints and writes (benchmarks/results/plan_scale.json) the median wall
time per worker count (the derivation excluded) and the CPU time it took (this process and its
forked workers: on a machine shared with other work the wall time waits for a core, the CPU time
much less), specs enumerated per second, simulator actions per second, and the search's figures
from the run with the most workers; every worker count's plan must be the same (its sha256 is
compared).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# model -> (global batch, results file, target wall seconds on two cores)
MODELS = {
    "gpt-1t": (3072, "plan_scale.json", 2.0),
    "gpt3-175b": (1536, "plan_scale_gpt3.json", 5.0),
}


def single(model: str, workers: int | None, profile_out: str | None) -> dict:
    """One cold search in this process: its figures."""
    from pipectl.catalog import get_device
    from pipectl.cluster import load_cluster
    from pipectl.models.registry import load_model_config
    from pipectl.artifacts.plan import PlanRequest
    from pipectl.plan.homogeneous import SearchStats
    from pipectl.plan.search import plan
    from pipectl.plan.workers import available_workers
    from pipectl.profile.derive import derive_profile

    started = time.perf_counter()
    profile = derive_profile(load_model_config(model), get_device("a100-80gb"), [1, 2, 4, 8])
    cluster = load_cluster("a100-384x8")
    derive_seconds = time.perf_counter() - started

    request = PlanRequest(global_batch=MODELS[model][0], workers=workers)
    stats = SearchStats()
    profiler = cProfile.Profile() if profile_out else None
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_started = time.process_time()
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    result = plan(profile, cluster, request, stats=stats)
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile_out)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    children_cpu = (children.ru_utime + children.ru_stime) - (children_before.ru_utime + children_before.ru_stime)

    chosen = result.chosen
    distinct_morph = {id(e.candidate) for e in result.morph_table if e.candidate}
    return {
        "workers": workers or available_workers(),
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(cpu + children_cpu, 3),
        "cpu_seconds_of_this_process": round(cpu, 3),
        "derive_profile_seconds": round(derive_seconds, 3),
        "specs_enumerated": stats.specs,
        "shapes_partitioned": stats.shapes,
        "rejected": stats.rejected,
        "simulations": stats.simulations,
        "simulated_actions": stats.simulated_actions,
        "specs_per_second": round(stats.specs / wall),
        "simulator_actions_per_second_of_wall": round(stats.simulated_actions / wall),
        "phase_seconds": stats.phase_seconds,
        "morph_table_entries": len(result.morph_table),
        "morph_table_distinct_plans": len(distinct_morph),
        "morph_table_first_count": result.morph_table[0].devices if result.morph_table else None,
        "chosen": {
            "devices": chosen.devices,
            "t": chosen.tensor_parallel,
            "p": chosen.pipeline_parallel,
            "d": chosen.data_parallel,
            "b": chosen.micro_batch_size,
            "m": chosen.micro_batches,
            "schedule": chosen.schedule.value,
            "chunks": chosen.chunks,
            "recompute": chosen.recompute,
            "zero_stage": chosen.zero_stage,
            "step_seconds": round(chosen.predicted_step_seconds, 3),
            "tflops_per_device": round(chosen.tflops_per_device, 1),
        },
        "plan_sha256": hashlib.sha256(result.model_dump_json().encode()).hexdigest(),
        "under_cprofile": bool(profile_out),
    }


def _worker_counts(text: str) -> list[int | None]:
    return [None if part.strip() == "auto" else int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-1t", help="the model planned")
    parser.add_argument("--single", action="store_true", help="one cold search in this process, figures as JSON")
    parser.add_argument("--workers", default="1,auto", help="worker counts to compare (auto: the cores available)")
    parser.add_argument("--repeats", type=int, default=3, help="cold runs per worker count, alternating")
    parser.add_argument("--profile-out", help="with --single: write cProfile statistics here")
    parser.add_argument("--no-write", action="store_true", help="do not update the results file")
    args = parser.parse_args()

    counts = _worker_counts(args.workers)
    if args.single:
        print(json.dumps(single(args.model, counts[0], args.profile_out)))
        return

    load_before = os.getloadavg()[0]
    runs: dict[int, list[dict]] = {}
    for _ in range(args.repeats):
        for workers in counts:
            command = [sys.executable, __file__, "--single", "--model", args.model,
                       "--workers", "auto" if workers is None else str(workers)]
            output = subprocess.run(command, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
            figures = json.loads(output)
            runs.setdefault(figures["workers"], []).append(figures)
            print(f"workers={figures['workers']}: {figures['wall_seconds']:.3f} s "
                  f"(CPU {figures['cpu_seconds']:.3f} s, this process {figures['cpu_seconds_of_this_process']:.3f} s)  "
                  f"{figures['phase_seconds']}", flush=True)
    plans = {figures["plan_sha256"] for every in runs.values() for figures in every}
    if len(plans) != 1:
        raise SystemExit(f"the plans differ between worker counts: {sorted(plans)}")
    medians = {workers: statistics.median(f["wall_seconds"] for f in every) for workers, every in runs.items()}
    most = max(runs)
    best = dict(runs[most][0])
    best.pop("under_cprofile")
    wall = medians[most]
    global_batch, results_file, target = MODELS[args.model]
    figures = {
        "model": f"{args.model} (derived, a100-80gb, micro-batch sizes 1,2,4,8)",
        "cluster": "a100-384x8 (3072 x A100-80GB)",
        "global_batch": global_batch,
        **best,
        "wall_seconds": round(wall, 3),
        "specs_per_second": round(best["specs_enumerated"] / wall),
        "simulator_actions_per_second_of_wall": round(best["simulated_actions"] / wall),
        "wall_seconds_by_workers": {str(w): [f["wall_seconds"] for f in every] for w, every in sorted(runs.items())},
        "median_wall_seconds_by_workers": {str(w): round(m, 3) for w, m in sorted(medians.items())},
        "median_cpu_seconds_by_workers": {
            str(w): round(statistics.median(f["cpu_seconds"] for f in every), 3) for w, every in sorted(runs.items())
        },
        "median_cpu_seconds_of_this_process_by_workers": {
            str(w): round(statistics.median(f["cpu_seconds_of_this_process"] for f in every), 3)
            for w, every in sorted(runs.items())
        },
        "one_worker_over_most": round(medians[min(runs)] / wall, 3) if len(runs) > 1 else None,
        "target_wall_seconds": target,
        "cpus": os.cpu_count(),
        "load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "machine": f"{platform.processor() or platform.machine()}, python {platform.python_version()}",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale.py"
        + (f" --model {args.model}" if args.model != "gpt-1t" else "")
        + (f" --workers {args.workers}" if args.workers != "1,auto" else "")
        + (f" --repeats {args.repeats}" if args.repeats != 3 else ""),
    }
    print(json.dumps(figures, indent=2))
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / results_file).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
