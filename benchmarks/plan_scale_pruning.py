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

- by a tighter bound that needs no cut, with the pipeline's fill and drain (`fill_bound_seconds`),
  for the flush schedules (1F1B, GPipe); the other schedules keep the bound above.

A point whose cut-free bound is no less than the fastest spec already known on as many devices or
fewer can be skipped before its memory is even tested; the counts say how much of the enumeration
a search ordered by that bound could skip. It also counts the feasible points whose cut the memory
limit forced (neither the balanced cut nor the right-filled one: each needs a partition of its own,
the dearest part of the enumeration) and how many of those the cut-free bound leaves.

The enumeration's time is measured per family (t, b, recompute, p, schedule; its points differ in
d and ZeRO) by wrapping `UnitContext.enumerate_family`: the seconds of the families each bound
would skip whole (every d ruled out, infeasible points included, as a search skipping them
could not know they do not fit) is time a bound-driven search would save for certain; a family
it skips in part saves at most its share. The fill bound is checked against every step the
search timed (it must never exceed one).
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
from pipectl.plan import families as families_module  # noqa: E402
from pipectl.plan.candidates import ShapeBuilder  # noqa: E402
from pipectl.plan.costs import hardware_for  # noqa: E402
from pipectl.plan.evaluate import Evaluator  # noqa: E402
from pipectl.plan.morph_table import PrefixMinimum, fastest_per_device_count  # noqa: E402
from pipectl.plan.space import enumerate_specs, search_space  # noqa: E402
from pipectl.profile.derive import derive_profile  # noqa: E402
from pipectl.schedule import ScheduleKind  # noqa: E402

FLUSH_SCHEDULES = (ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE)


def fill_bound_seconds(total: float, micro_batches: int, stages: int) -> float:
    """A lower bound on a flush schedule's step over any cut into `stages` stages whose per-micro-
    batch work (forward + backward) sums to `total`.

    Stage k cannot start its first forward before micro-batch 0 has passed the k stages before it,
    runs m forwards and m backwards, and its last backward precedes the last backward of each
    stage before it: step >= P_k + m w_k, where P_k is the work of the stages before k. With c
    the step, w_k <= (c - P_k) / m, so P_k <= c (1 - (1 - 1/m)^k), and P_p = total gives
    c >= total / (1 - (1 - 1/m)^p): m (total / p) plus about half the bubble, with no cut known.
    """
    return total / (1 - (1 - 1 / micro_batches) ** stages)


def _timed_families():
    """Wrap `UnitContext.enumerate_family`: each call's (family, d tried, seconds, points accepted).
    Families with more stages than layers are rejected before it (and not counted here)."""
    calls = []
    enumerate_family = families_module.UnitContext.enumerate_family

    def timed(self, builder, key, demands, out):
        accepted = len(out.accepted)
        started = time.perf_counter()
        enumerate_family(self, builder, key, demands, out)
        # The d tried: those with ZeRO-0/1 points and those with ZeRO-2/3 points (p = 1).
        ds = sorted({d for d, *_ in demands.per_d} | {d for d, _, _ in demands.gradients_sharded}, reverse=True)
        calls.append((key, ds, time.perf_counter() - started, len(out.accepted) - accepted))

    families_module.UnitContext.enumerate_family = timed
    return calls


def main() -> None:
    started = time.time()
    profile = derive_profile(load_model_config("gpt-1t"), get_device("a100-80gb"), [1, 2, 4, 8])
    cluster = load_cluster("a100-384x8")
    request = PlanRequest(global_batch=3072, workers=1)
    hardware = hardware_for(cluster, profile, memory_headroom=request.memory_headroom)  # as `plan.search.plan`
    space = search_space(request, profile, hardware)
    calls = _timed_families()
    enumerate_started = time.perf_counter()
    enumeration = enumerate_specs(profile, hardware, space, hardware.devices)
    enumerate_seconds = time.perf_counter() - enumerate_started
    specs = enumeration.specs
    evaluator = Evaluator(hardware, request.global_batch, engine=request.target_engine)
    best = fastest_per_device_count(  # every count: the fastest spec on at most n devices, for each n
        specs.take(specs.runs_on(request.target_engine)), evaluator, list(range(1, hardware.devices + 1))
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
    # Every (family, d) the enumeration visited, feasible or not, against both cut-free bounds.
    B = request.global_batch
    by_bound = {"cut_free": Counter(), "with_fill": Counter()}
    for key, ds, seconds, accepted in calls:
        t, b, p, variant = key.tensor_parallel, key.micro_batch_size, key.pipeline_parallel, key.variant
        stages = p * variant.chunks
        outcome = "all_rejected" if not accepted else "some_accepted"
        for name in by_bound:
            by_bound[name][f"{outcome}_families"] += 1
            by_bound[name][f"{outcome}_seconds"] += seconds
            by_bound[name]["points"] += len(ds)
        if stages > builder.layers:
            continue
        weights = Recompute.NONE if key.recompute is Recompute.STAGE else key.recompute
        bottleneck = builder.bottleneck(t, b, weights, stages)
        total = sum(builder.work(t, b, weights))
        flush = variant.kind in FLUSH_SCHEDULES
        ruled_out = {name: 0 for name in by_bound}
        for d in ds:
            m = -(-B // (d * b))
            limit = fastest.minimum(t * p * d)
            cut_free = m * bottleneck
            ruled_out["cut_free"] += cut_free >= limit
            ruled_out["with_fill"] += max(cut_free, fill_bound_seconds(total, m, p) if flush else 0.0) >= limit
        for name, count in ruled_out.items():
            by_bound[name]["points_ruled_out"] += count
            if count == len(ds):
                by_bound[name]["families_ruled_out_whole"] += 1
                by_bound[name]["seconds_of_families_ruled_out_whole"] += seconds
            else:
                by_bound[name]["seconds_pro_rata_of_the_others"] += seconds * count / len(ds)
    # The fill bound never above a step the search timed.
    fill_violations = fill_checked = 0
    steps, _, _ = evaluator.timings()
    for spec in specs:
        step = steps.get(spec.key)
        if step is None or spec.variant.kind not in FLUSH_SCHEDULES:
            continue
        shape = spec.shape
        weights = Recompute.NONE if shape.recompute is Recompute.STAGE else shape.recompute
        total = sum(builder.work(shape.tensor_parallel, shape.micro_batch_size, weights))
        fill_checked += 1
        fill_violations += fill_bound_seconds(total, spec.micro_batches, shape.pipeline_parallel) > step * (1 + 1e-9)
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
        "enumeration_seconds": round(enumerate_seconds, 3),
        "enumeration_by_family": {
            name: {key: round(value, 3) if isinstance(value, float) else value for key, value in sorted(counts.items())}
            for name, counts in by_bound.items()
        },
        "fill_bound_checked_against_timed_steps": fill_checked,
        "fill_bound_above_a_timed_step": fill_violations,
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
