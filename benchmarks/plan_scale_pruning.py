"""How much of the planner's search at scale can matter: the case for a bound-driven search.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale_pruning.py
    -> benchmarks/results/plan_scale_pruning.json

The search of benchmarks/plan_scale.py (GPT 1T, 3,072 A100-80GB, global batch 3072) enumerates
every feasible point exhaustively, each with its memory-fitting cut, before ranking and the morph
table prune by bounds; the enumeration is most of its time. This script runs that search once and
counts, against the morph table's final answer (the fastest spec on at most n devices, for every
n; the chosen plan is its entry at 3,072), how many points could have changed it:

- by the spec's own lower bound (`Spec.lower_bound_seconds`, which needs the point's cut);
- by a bound that needs no cut: m micro-batches x the least bottleneck any cut of the p x v
  stages can have (`ShapeBuilder.bottleneck` of the per-layer work; for whole-stage recomputation,
  of the work without it, as the last stage does not recompute). The busiest rank runs at least
  that much work per step. Checked here against every spec's own bound (it must never exceed it).

A point whose cut-free bound is no less than the fastest spec already known on as many devices or
fewer can be skipped before its memory is even tested; the counts say how much of the enumeration
a search ordered by that bound could skip. It also counts the feasible points whose cut the memory
limit forced (neither the balanced cut nor the right-filled one: each needs a partition of its own,
the dearest part of the enumeration) and how many of those the cut-free bound leaves. It prints and
writes the counts; it times nothing.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "plan_scale_pruning.json"
sys.path.insert(0, str(ROOT / "src"))

from pipectl.artifacts.plan import PlanRequest, Recompute  # noqa: E402
from pipectl.catalog import get_device  # noqa: E402
from pipectl.cluster import load_cluster  # noqa: E402
from pipectl.models.registry import load_model_config  # noqa: E402
from pipectl.plan.candidates import ShapeBuilder  # noqa: E402
from pipectl.plan.costs import hardware_for  # noqa: E402
from pipectl.plan.evaluate import Evaluator  # noqa: E402
from pipectl.plan.morph import PrefixMinimum, fastest_per_device_count  # noqa: E402
from pipectl.plan.space import enumerate_specs, search_space  # noqa: E402
from pipectl.profile.derive import derive_profile  # noqa: E402


def main() -> None:
    started = time.time()
    profile = derive_profile(load_model_config("gpt-1t"), get_device("a100-80gb"), [1, 2, 4, 8])
    cluster = load_cluster("a100-384x8")
    request = PlanRequest(global_batch=3072, workers=1)
    hardware = hardware_for(cluster, profile, memory_headroom=request.memory_headroom)  # as `plan.search.plan`
    space = search_space(request, profile, hardware)
    enumeration = enumerate_specs(profile, hardware, space, hardware.devices)
    specs = enumeration.specs
    evaluator = Evaluator(hardware, request.global_batch, engine=request.target_engine)
    best = fastest_per_device_count(
        [s for s in specs if s.runs_on(request.target_engine)], evaluator, hardware.devices
    )
    fastest = PrefixMinimum(hardware.devices)  # the fastest step on at most n devices, as the table's loop asks it
    for n, (step, _) in best.items():
        fastest.lower(n, step)

    builder = ShapeBuilder(profile, hardware)
    by_own_bound = by_cut_free_bound = violations = 0
    families, families_left = set(), set()
    left_by_schedule: Counter = Counter()
    constrained = constrained_left = 0
    for spec in specs:
        shape = spec.shape
        # Is its cut one the memory limit forced (neither the balanced cut nor the right-filled one)?
        placement = spec.variant.kind.v_placement
        free_cuts = {
            builder.shape(shape.tensor_parallel, shape.micro_batch_size, shape.recompute, shape.pipeline_parallel,
                          shape.chunks, from_right=right, v_placement=placement).stage_layers
            for right in (False, True)
        }
        forced = shape.stage_layers not in free_cuts
        constrained += forced
        family = (shape.tensor_parallel, shape.micro_batch_size, shape.recompute, shape.pipeline_parallel,
                  spec.variant.label)
        families.add(family)
        weights = Recompute.NONE if shape.recompute is Recompute.STAGE else shape.recompute
        cut_free = spec.micro_batches * builder.bottleneck(
            shape.tensor_parallel, shape.micro_batch_size, weights, shape.pipeline_parallel * shape.chunks
        )
        violations += cut_free > spec.lower_bound_seconds * (1 + 1e-9)
        limit = fastest.minimum(spec.devices)
        by_own_bound += spec.lower_bound_seconds < limit
        if cut_free < limit:
            by_cut_free_bound += 1
            constrained_left += forced
            families_left.add(family)
            left_by_schedule[spec.variant.label] += 1
    rejected = sum(enumeration.rejections.counts.values())
    result = {
        "benchmark": "plan_scale_pruning",
        "search": "gpt-1t derived on a100-80gb (b 1, 2, 4, 8), cluster a100-384x8 (3,072 devices), global batch "
                  "3072, the plan request's defaults (every schedule DeepSpeed runs, recomputation auto, ZeRO-1, "
                  "uneven replicas, morph table), as benchmarks/plan_scale.py",
        "points_enumerated": len(specs) + rejected,
        "points_feasible": len(specs),
        "points_rejected": rejected,
        "families_feasible": len(families),
        "feasible_points_that_could_change_the_morph_table": {
            "by_their_own_bound": by_own_bound,
            "by_the_cut_free_bound": by_cut_free_bound,
            "families_with_such_a_point_by_the_cut_free_bound": len(families_left),
            "by_schedule_cut_free": dict(left_by_schedule),
        },
        "feasible_points_with_a_cut_the_memory_limit_forced": {
            "all": constrained,
            "that_could_change_the_morph_table_by_the_cut_free_bound": constrained_left,
        },
        "cut_free_bound_above_the_specs_own": violations,
        "morph_table_counts_with_a_spec": len(best),
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale_pruning.py",
        "runtime_seconds": round(time.time() - started, 1),
        "machine": f"{platform.machine()}, python {platform.python_version()}",
        "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
