"""Planner at scale: GPT 1T on 384 x 8 A100-80GB, global batch 3072, every schedule + morph table.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale.py [--profile-out stats.prof]

Derives the 1T profile (128 blocks, h 25600, s 2048, V 51200; micro-batch sizes 1, 2, 4, 8),
plans for all 3,072 GPUs with the schedules 1f1b, gpipe, interleaved (v = 2, 4) and Varuna,
recomputation on/off, ZeRO 0/1, and the morph table for every count up to 3,072. Prints the wall
time (the derivation excluded), specs enumerated and simulated per second, simulator actions per
second, and writes benchmarks/results/plan_scale.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import time
from pathlib import Path

from pipectl.catalog import get_device
from pipectl.cluster import load_cluster
from pipectl.models.registry import load_model_config
from pipectl.plan.search import PlanRequest, SearchStats, plan
from pipectl.profile.derive import derive_profile

RESULTS = Path(__file__).parent / "results" / "plan_scale.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile-out", help="write cProfile statistics here")
    parser.add_argument("--global-batch", type=int, default=3072)
    parser.add_argument("--no-write", action="store_true", help="do not update the results file")
    args = parser.parse_args()

    started = time.perf_counter()
    profile = derive_profile(load_model_config("gpt-1t"), get_device("a100-80gb"), [1, 2, 4, 8])
    cluster = load_cluster("a100-384x8")
    derive_seconds = time.perf_counter() - started

    request = PlanRequest(global_batch=args.global_batch)
    stats = SearchStats()
    profiler = cProfile.Profile() if args.profile_out else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    result = plan(profile, cluster, request, stats=stats)
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile_out)
    wall = time.perf_counter() - started

    chosen = result.chosen
    distinct_morph = {id(e.candidate) for e in result.morph_table if e.candidate}
    figures = {
        "model": "gpt-1t (derived, a100-80gb, micro-batch sizes 1,2,4,8)",
        "cluster": "a100-384x8 (3072 x A100-80GB)",
        "global_batch": args.global_batch,
        "wall_seconds": round(wall, 3),
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
        "under_cprofile": bool(args.profile_out),
        "machine": f"{platform.processor() or platform.machine()}, python {platform.python_version()}",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale.py"
        + (f" --profile-out {args.profile_out}" if args.profile_out else ""),
    }
    print(json.dumps(figures, indent=2))
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
