"""How fast is the step simulator? Prints simulated actions per second, writes a JSON result.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/simulator_speed.py

An "action" is one timed action of the step: a forward, backward or recompute of one micro-batch on
one (virtual) stage, or a rank's all-reduce or optimizer step. The schedule's compiled dependency
structure is cached, as it is in the planner's search (one schedule shape, many cost tables), so
the timed loop is what the search pays per candidate; the one-off compile cost is reported apart.
"""

from __future__ import annotations

import json
import platform
import random
import sys
import time
from pathlib import Path

from pipectl.plan.stage_costs import StageCosts
from pipectl.plan.simulate import _compiled, simulate, simulate_step_seconds
from pipectl.schedule import ScheduleKind, generate

CASES = [
    (ScheduleKind.ONE_F_ONE_B, 4, 16, 1),
    (ScheduleKind.ONE_F_ONE_B, 8, 64, 1),
    (ScheduleKind.GPIPE, 8, 64, 1),
    (ScheduleKind.INTERLEAVED, 8, 64, 2),
    (ScheduleKind.VARUNA, 8, 64, 1),
    (ScheduleKind.ONE_F_ONE_B, 32, 128, 1),
    (ScheduleKind.INTERLEAVED, 16, 256, 4),
]


def random_costs(stages: int, ranks: int, seed: int) -> StageCosts:
    rng = random.Random(seed)
    return StageCosts(
        forward_seconds=[rng.uniform(0.5, 2.0) for _ in range(stages)],
        backward_seconds=[rng.uniform(1.0, 4.0) for _ in range(stages)],
        recompute_seconds=[rng.uniform(0.5, 2.0) for _ in range(stages)],
        send_forward_seconds=[rng.uniform(0.0, 0.1) for _ in range(stages - 1)],
        send_backward_seconds=[rng.uniform(0.0, 0.1) for _ in range(stages - 1)],
        allreduce_seconds=[rng.uniform(0.0, 1.0) for _ in range(ranks)],
        optimizer_seconds=[rng.uniform(0.0, 0.1) for _ in range(ranks)],
    )


def measure(kind: ScheduleKind, p: int, m: int, v: int, min_seconds: float = 0.5) -> dict:
    schedule = generate(kind, p, m, v)
    started = time.perf_counter()
    compiled = _compiled(schedule)
    compile_seconds = time.perf_counter() - started
    actions = len(compiled.actions)
    costs = [random_costs(p * v, p, seed) for seed in range(16)]
    calls = 0
    started = time.perf_counter()
    while True:
        for c in costs:
            simulate_step_seconds(schedule, c)
        calls += len(costs)
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            break
    full_started = time.perf_counter()
    full_calls = max(calls // 20, 1)
    for k in range(full_calls):
        simulate(schedule, costs[k % len(costs)])
    full_elapsed = time.perf_counter() - full_started
    return {
        "schedule": kind.value,
        "pipeline_parallel": p,
        "micro_batches": m,
        "chunks": v,
        "actions_per_step": actions,
        "compile_seconds": compile_seconds,
        "step_seconds_calls": calls,
        "actions_per_second": actions * calls / elapsed,
        "microseconds_per_call": 1e6 * elapsed / calls,
        "full_timeline_actions_per_second": actions * full_calls / full_elapsed,
    }


def main() -> None:
    rows = [measure(*case) for case in CASES]
    total_actions = sum(r["actions_per_step"] * r["step_seconds_calls"] for r in rows)
    total_seconds = sum(r["microseconds_per_call"] * r["step_seconds_calls"] / 1e6 for r in rows)
    result = {
        "benchmark": "simulator_speed",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "overall_actions_per_second": total_actions / total_seconds,
        "cases": rows,
    }
    for r in rows:
        print(
            f"{r['schedule']:>12} p={r['pipeline_parallel']:<3} m={r['micro_batches']:<4} v={r['chunks']}  "
            f"{r['actions_per_step']:>6} actions  {r['microseconds_per_call']:>9.1f} us/step  "
            f"{r['actions_per_second'] / 1e6:5.2f} M actions/s  "
            f"(full timeline {r['full_timeline_actions_per_second'] / 1e6:4.2f} M/s, "
            f"compile {1e3 * r['compile_seconds']:.1f} ms)"
        )
    print(f"overall: {result['overall_actions_per_second'] / 1e6:.2f} M simulated actions/s")
    out = Path(__file__).parent / "results" / "simulator_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
