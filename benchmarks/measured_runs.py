"""pipectl's predictions against training runs measured on real clusters (issue #45).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/measured_runs.py [--runs DIR] [--conditions FILE]
                                                    [--limit N] [--folds K] [--no-calibrate] [--no-write]

Runs what `pipectl validate MEASURED.csv --conditions CONDITIONS.yaml --json` runs, in process, on
vTrain's single-node ground truth (Bang et al., MICRO'24: 1,440 Megatron-DeepSpeed runs of GPT
shapes on 2, 4 and 8 A100s; `--runs` names the folder holding `single-node.csv` and
`conditions.yaml`, by default the shared reference copy beside the checkout). Every row's layout is
pinned; nothing is fitted. Prints the summary, the signed median error per hidden size and GPU count
(where the model runs fast or slow), the memory model's refusals of runs that ran, and the groups
ranked worst, and what one constant cost per block, per micro-batch or per step would explain of
the error (`missing_costs`), and where a step's time goes, measured and predicted (`time_split`):
diagnostics, not terms the predictions use. Then what `pipectl calibrate MEASURED.csv --conditions CONDITIONS.yaml` fits to the
same rows: the terms, the errors on the rows fitted on, and the K-fold cross-validated errors (each
row predicted by terms fitted without it; default K = 5). Writes benchmarks/results/measured_runs.json
with the command, machine and date.

Last, the published large-scale runs of benchmarks/published_runs.yaml (Megatron-LM, Megatron-DeepSpeed,
Megatron-Core, DeepSpeed ZeRO-3 and Llama 3 runs on 32 to 16,384 GPUs), each predicted with its
published layout pinned as `benchmarks/published_runs.py` predicts it (`pinned_errors`), against the
published step: `published_runs` in the results (skip with `--no-published`; `--limit` skips it too).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pipectl.io import write_json_atomic  # noqa: E402
from pipectl.measured.calibrate import calibrate_runs  # noqa: E402
from pipectl.artifacts.calibration import DEFAULT_FOLDS  # noqa: E402
from pipectl.measured.predict import predict_runs  # noqa: E402
from pipectl.measured.runs import load_conditions, read_runs  # noqa: E402
from pipectl.measured.summary import summarise_errors, summarise_groups, time_split  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from published_runs import pinned_errors  # noqa: E402

DEFAULT_RUNS = ROOT.parent / "shared" / "reference" / "vtrain-a100"
RESULTS = ROOT / "benchmarks" / "results" / "measured_runs.json"


def by_slice(predictions, key) -> dict[str, dict]:
    """Signed median and MAPE of the rows sharing `key(run)`."""
    slices: dict[str, list[float]] = {}
    for p in predictions:
        if p.error is not None:
            slices.setdefault(key(p.run), []).append(p.error)
    return {
        name: {"rows": len(errors), "signed_median": round(statistics.median(errors), 4),
               "mape": round(statistics.fmean(abs(e) for e in errors), 4)}
        for name, errors in sorted(slices.items())
    }  # fmt: skip


# Where the uncalibrated model's error could come from: costs it may lack, each as a count of
# occurrences on a 1F1B step's critical path ((m + p - 1) micro-batch slots on the busiest stage).
def _blocks(r, m) -> float:
    """Blocks run on the busiest stage's critical path: (m + p - 1) micro-batch slots of layers / p."""
    return (m + r.pipeline_parallel - 1) * r.layers / r.pipeline_parallel


MISSING_COST_SHAPES = {
    "per block and micro-batch": _blocks,
    "per micro-batch and stage": lambda r, m: m + r.pipeline_parallel - 1,
    "per step": lambda r, m: 1.0,
    # Costs that would grow with a block shard's work: h / t, h^2 / t, its tokens (1024 = 1).
    "per block, x h / t": lambda r, m: _blocks(r, m) * r.hidden / 1024 / r.tensor_parallel,
    "per block, x h^2 / t": lambda r, m: _blocks(r, m) * (r.hidden / 1024) ** 2 / r.tensor_parallel,
    "per block, x tokens": lambda r, m: _blocks(r, m) * r.micro_batch * r.seq_len / 1024,
    # Six tensor-parallel all-reduces per block and micro-batch (two each forward, recomputed forward, backward).
    "per tensor-parallel all-reduce": lambda r, m: _blocks(r, m) * 6 * (r.tensor_parallel > 1),
}


def missing_costs(predictions) -> dict[str, dict]:
    """Per shape of `MISSING_COST_SHAPES`: the one constant that, added that many times to every
    prediction, best explains the measured steps (least squares of the relative errors), and the
    errors it would leave. A diagnostic of the model's bias, not a term the predictions use."""
    rows = [p for p in predictions if p.predicted_seconds is not None]
    out = {}
    for name, occurrences in MISSING_COST_SHAPES.items():
        xs, ys = [], []
        for p in rows:
            m = -(-p.run.global_batch // (p.run.micro_batch * p.run.data_parallel))
            xs.append(occurrences(p.run, m) / p.run.measured_seconds)
            ys.append(1.0 - p.predicted_seconds / p.run.measured_seconds)
        constant = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        left = [constant * x - y for x, y in zip(xs, ys)]
        out[name] = {"seconds": round(constant, 7), "mape": round(statistics.fmean(abs(e) for e in left), 4),
                     "signed_median": round(statistics.median(left), 4)}
    return out


def time_split_ms(predictions) -> list[dict]:
    """`pipectl.measured.summary.time_split` in milliseconds, as this file's JSON has it."""
    def ms(parts) -> dict:
        return {"block_micro_batch_ms": round(parts.block_micro_batch * 1e3, 3),
                "micro_batch_ms": round(parts.micro_batch * 1e3, 3),
                "block_step_ms": {f"d{d}": round(v * 1e3, 3) for d, v in parts.block_step.items()},
                "step_ms": {f"d{d}": round(v * 1e3, 3) for d, v in parts.step.items()}}

    return [{"key": g.key, "rows": g.rows, "measured": ms(g.measured), "predicted": ms(g.predicted),
             "largest_residual": round(g.largest_residual, 6)}
            for g in time_split(predictions)]  # fmt: skip


def zero_stage_readings(runs, conditions, predictions) -> dict[str, dict]:
    """The rows predicted as if run with ZeRO stage 0 and with stage 1 (the conditions file only
    assumes its stage; `predictions` are the rows under it): the summary, and the per block and
    step time at t = 1 (the optimizer's share and the gradient reduction), where the two stages
    differ in how it changes with d: under stage 0 the optimizer's share is the same at every d and
    the reduction grows with it; under stage 1 the optimizer's share falls as 1/d."""
    out = {}
    for stage in (0, 1):
        read = predictions if stage == conditions.zero_stage else predict_runs(
            runs, conditions.model_copy(update={"zero_stage": stage}))
        t1 = [g for g in time_split_ms(read) if " t1 b1" in g["key"]]
        out[str(stage)] = {
            "summary": summarise_errors(read).to_dict(),
            "block_step_ms_t1": [{"key": g["key"], "measured": g["measured"]["block_step_ms"],
                                  "predicted": g["predicted"]["block_step_ms"]} for g in t1],
        }  # fmt: skip
    return out


def _abs_summary(errors: list[float]) -> dict:
    """MAPE, max |error| and mean signed error of relative errors."""
    return {"rows": len(errors), "mape": round(statistics.mean(map(abs, errors)), 4),
            "max_abs_error": round(max(map(abs, errors)), 4), "mean_signed_error": round(statistics.mean(errors), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="folder with single-node.csv and conditions.yaml")
    parser.add_argument("--conditions", type=Path, help="another conditions file for the rows (default: the folder's)")
    parser.add_argument("--limit", type=int, help="the first N rows only (a quick look)")
    parser.add_argument("--folds", type=int, default=DEFAULT_FOLDS, help="cross-validation folds of the calibration")
    parser.add_argument("--no-calibrate", action="store_true", help="the uncalibrated predictions only")
    parser.add_argument("--no-published", action="store_true", help="leave out the published large-scale runs")
    parser.add_argument("--no-write", action="store_true", help="do not update the results file")
    args = parser.parse_args()

    runs = read_runs(args.runs / "single-node.csv")
    if args.limit:
        runs = runs[: args.limit]
    conditions_file = args.conditions or args.runs / "conditions.yaml"
    conditions = load_conditions(conditions_file)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    predictions = predict_runs(runs, conditions)
    seconds = time.perf_counter() - started
    errors, groups = summarise_errors(predictions), summarise_groups(predictions)
    ranked = [g for g in groups if g.spearman is not None]
    refused = [p for p in predictions if p.memory_refused]
    unpredicted = [p for p in predictions if p.predicted_seconds is None]
    summary = {
        **errors.to_dict(),
        "groups_ranked": len(ranked),
        "spearman_median": statistics.median(g.spearman for g in ranked) if ranked else None,
        "spearman_min": min(g.spearman for g in ranked) if ranked else None,
        "regret_max": max(g.regret for g in groups) if groups else None,
        "regret_median": statistics.median(g.regret for g in groups) if groups else None,
        "memory_refused_rows": len(refused),
        "unpredicted_rows": len(unpredicted),
    }
    print(f"{len(runs)} rows in {seconds:.1f} s")
    for name, value in summary.items():
        print(f"  {name:<22} {value:.4f}" if isinstance(value, float) else f"  {name:<22} {value}")
    slices = {
        "hidden": by_slice(predictions, lambda r: f"h{r.hidden}"),
        "gpus": by_slice(predictions, lambda r: f"{r.gpus} GPUs"),
        "tensor_parallel": by_slice(predictions, lambda r: f"t{r.tensor_parallel}"),
        "pipeline_parallel": by_slice(predictions, lambda r: f"p{r.pipeline_parallel}"),
        "micro_batch": by_slice(predictions, lambda r: f"b{r.micro_batch}"),
    }
    for kind, rows in slices.items():
        print(f"  by {kind}: " + ", ".join(f"{name} {s['signed_median']:+.1%} ({s['rows']})" for name, s in rows.items()))
    missing = missing_costs(predictions)
    for name, figures in missing.items():
        print(f"  one constant {name}: {figures['seconds'] * 1e3:.3g} ms would leave MAPE {figures['mape']:.1%}, "
              f"signed median {figures['signed_median']:+.1%}")
    split = time_split_ms(predictions)
    print("  time per block and micro-batch | per micro-batch outside the blocks | per block and step, ms "
          "(measured / predicted):")
    for g in split:
        measured, predicted = g["measured"], g["predicted"]
        per_layer = ", ".join(f"{d} {measured['block_step_ms'][d]:.2f}/{predicted['block_step_ms'][d]:.2f}"
                              for d in measured["block_step_ms"])
        print(f"    {g['key']}: {measured['block_micro_batch_ms']:.2f}/{predicted['block_micro_batch_ms']:.2f}"
              f" | {measured['micro_batch_ms']:.2f}/{predicted['micro_batch_ms']:.2f} | {per_layer}")
    readings = zero_stage_readings(runs, conditions, predictions)
    for stage, reading in readings.items():
        e = reading["summary"]
        print(f"  read as ZeRO stage {stage}: MAPE {e['mape']:.1%}, signed median {e['signed_median_error']:+.1%}; "
              "per block and step at t1, ms (measured / predicted): " + "; ".join(
                  f"{g['key'].split(' t1 ')[0]} " + ", ".join(f"{d} {m:.2f}/{g['predicted'][d]:.2f}"
                                                         for d, m in g["measured"].items())
                  for g in reading["block_step_ms_t1"]))
    worst = sorted(ranked, key=lambda g: g.spearman)[:5]
    for g in worst:
        print(f"  worst-ranked group: {g.key}: rows {g.rows}, Spearman {g.spearman:.2f}, regret {g.regret:.1%}")
    calibrated = None
    if not args.no_calibrate:
        started = time.perf_counter()
        calibration = calibrate_runs(
            runs, conditions, rows_file=args.runs / "single-node.csv", conditions_file=conditions_file,
            folds=args.folds, workers=os.cpu_count() or 1, progress=lambda line: print("  " + line),
        )  # fmt: skip
        calibrated = {
            "seconds": round(time.perf_counter() - started, 1),
            **calibration.model_dump(mode="json", include={"uncalibrated", "terms", "before", "after", "folds",
                                                             "cross_validated"}),
        }  # fmt: skip
        for label, e in (("fitted on", calibration.after), (f"{args.folds}-fold CV", calibration.cross_validated)):
            if e is not None:
                print(f"  calibrated, {label}: median {e.median_abs_error:.1%}, MAPE {e.mape:.1%}, "
                      f"max {e.max_abs_error:.1%}, signed median {e.signed_median_error:+.1%}")  # fmt: skip
        print("  terms: " + ", ".join(f"{name} {value:.4g}" for name, value in calibration.terms))
    published = None
    if not args.no_published and not args.limit:  # --limit: a quick look at the measured rows only
        started = time.perf_counter()
        published = pinned_errors(workers=os.cpu_count() or 1)
        published["seconds"] = round(time.perf_counter() - started, 1)
        e = published["summary"]
        print(f"  published runs ({e['rows']}, layouts pinned): median {e['median_abs_error']:.1%} (target 10 %), "
              f"max {e['max_abs_error']:.1%} (target 20 %), mean signed {e['mean_signed_error']:+.1%}")
        if calibrated is not None:
            # The calibration's device figures on the published runs of its device (larger shapes,
            # other engines, not fitted on): how far it carries beyond the rows it was fitted to.
            device = calibration.device
            carried = pinned_errors(workers=os.cpu_count() or 1, calibration=calibration)
            alone = [r["error"] for r in published["rows"] if r["device"] == device and r["error"] is not None]
            calibrated["published_runs_of_its_device"] = {
                "device": device, "uncalibrated": _abs_summary(alone),
                "with_its_device_figures": _abs_summary([r["error"] for r in carried["rows"] if r["error"] is not None]),
            }  # fmt: skip
            for label, e in calibrated["published_runs_of_its_device"].items():
                if isinstance(e, dict):
                    print(f"  published {device} runs, {label.replace('_', ' ')}: MAPE {e['mape']:.1%}, "
                          f"max {e['max_abs_error']:.1%}, mean signed {e['mean_signed_error']:+.1%} ({e['rows']} rows)")
    if args.no_write:
        return
    write_json_atomic(RESULTS, {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/measured_runs.py"
                   + (f" --limit {args.limit}" if args.limit else "")
                   + (f" --folds {args.folds}" if args.folds != DEFAULT_FOLDS else "")
                   + (" --no-calibrate" if args.no_calibrate else "")
                   + (" --no-published" if args.no_published else "")
                   + (f" --conditions {args.conditions}" if args.conditions else ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {load_before:.2f}",
        "rows_file": "vTrain data/ground_truth_single.csv (shared reference copy)",
        "conditions": conditions.model_dump(mode="json"),
        "seconds": round(seconds, 1),
        "summary": summary,
        "slices": slices,
        "missing_costs": missing,
        "time_split": split,
        "zero_stage_readings": readings,
        "groups": [g.to_dict() for g in groups],
        "memory_refused_examples": [
            {"line": p.run.line, "layout": p.run.layout_label, "group": p.run.group, "why": p.memory_refused}
            for p in refused[:10]
        ],
        "unpredicted": [{"line": p.run.line, "problem": p.problem} for p in unpredicted[:10]],
        "calibrated": calibrated,
        "published_runs": published,
    })  # fmt: skip
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
