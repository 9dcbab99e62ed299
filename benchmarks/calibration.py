"""Calibrate on two short runs, predict the layouts not run: `pipectl calibrate` against the
measured profile alone, on this machine.

1. `pipectl profile MODEL` (the engine calibration included), once.
2. Every layout (the two calibration layouts and the predicted ones) is planned (pinned) from
   that profile and launched `--repeats` times for `--steps` steps: every layout once, then every
   layout again, so that a slow spell of the shared machine falls on different layouts in each
   round. A launch's step is the median of its steps after the first `--warmup`; a layout's, the
   mean over its launches, and its noise the spread of its launches (largest - smallest) / mean.
3. `pipectl calibrate` fits the profile on the runs of the two calibration layouts (every launch
   of them), and every other layout's step is compared with the step its plan's candidate
   simulates to under the measured profile and under the calibrated one (`plan.phases`).

Reported: per layout the three figures, its launches and its noise; median and max absolute error
before and after calibration over the predicted layouts, Spearman's rank correlation between
predicted and measured step times (tied values share their mean rank), the noise's median and max
(a floor under any prediction error), and the load average around every launch. The machine has
2 cores: layouts of 3 and 4 ranks over-subscribe it, and are reported apart from those of 1 and 2.
`--keep DIR` keeps the profile, plans and runs; `--reuse DIR` launches nothing and fits and
predicts again from them.

    .venv/bin/python benchmarks/calibration.py
    -> benchmarks/results/calibration.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Layout:
    pipeline: int
    data: int
    micro_batch_size: int
    schedule: str = "1f1b"
    recompute: bool = False

    @property
    def ranks(self) -> int:
        return self.pipeline * self.data

    def name(self) -> str:
        return f"p{self.pipeline}d{self.data} b{self.micro_batch_size} {self.schedule}" + (" +R" if self.recompute else "")


CALIBRATION = [Layout(1, 1, 4), Layout(2, 1, 4)]
PREDICTED = [
    Layout(1, 1, 1), Layout(1, 1, 2), Layout(1, 1, 8), Layout(2, 1, 1), Layout(2, 1, 2), Layout(2, 1, 8),
    Layout(2, 1, 2, "gpipe"), Layout(2, 1, 4, "gpipe"), Layout(2, 1, 4, "varuna", True),
    Layout(1, 2, 2), Layout(1, 2, 4), Layout(1, 2, 8),
    Layout(1, 3, 2), Layout(2, 2, 2), Layout(4, 1, 2), Layout(1, 4, 2),
]  # fmt: skip


def pipectl(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pipectl.cli.main", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pipectl {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def plan_layout(profile: Path, layout: Layout, global_batch: int, out: Path) -> Path:
    pipectl(
        "plan", "--profile", str(profile), "--cluster", "local", "--global-batch", str(global_batch),
        "--devices", str(layout.ranks), "--pipeline-parallel", str(layout.pipeline), "--data-parallel", str(layout.data),
        "--micro-batch-size", str(layout.micro_batch_size), "--schedule", layout.schedule, "--no-morph",
        *([] if layout.recompute else ["--no-recompute"]), "-o", str(out),
    )  # fmt: skip
    return out


def launch(plan: Path, run: Path, steps: int) -> Path:
    pipectl("launch", str(plan), "--run-dir", str(run), "--steps", str(steps), "--data", "synthetic", "--force")
    return run


def measured_step(run: Path, warmup: int) -> float:
    from pipectl.rundir.metrics import read_metrics

    steps = [m.step_seconds for m in read_metrics(run)]
    return statistics.median(steps[warmup:] if len(steps) > warmup else steps)


def simulated_step(plan_path: Path, profile_path: Path) -> float:
    from pipectl.artifacts.plan import Plan
    from pipectl.artifacts.profile import ModelProfile
    from pipectl.cluster import plan_cluster_spec
    from pipectl.io import load_model
    from pipectl.plan.phases import simulated_phases

    plan = load_model(Plan, plan_path)
    return simulated_phases(plan.chosen, load_model(ModelProfile, profile_path), plan_cluster_spec(plan))[1]


def planned_label(plan_path: Path) -> str:
    from pipectl.artifacts.layout import layout_label
    from pipectl.artifacts.plan import Plan
    from pipectl.io import load_model

    return layout_label(load_model(Plan, plan_path).chosen)


def summary(rows: list[dict]) -> dict:
    from pipectl.measured.summary import spearman

    if not rows:
        return {}
    before = [r["error_before"] for r in rows]
    after = [r["error_after"] for r in rows]
    measured = [r["measured_step_seconds"] for r in rows]
    return {
        "layouts": len(rows),
        "median_error_before": statistics.median(before), "max_error_before": max(before),
        "median_error_after": statistics.median(after), "max_error_after": max(after),
        "spearman_before": spearman([r["predicted_before"] for r in rows], measured) if len(rows) > 2 else None,
        "spearman_after": spearman([r["predicted_after"] for r in rows], measured) if len(rows) > 2 else None,
    }  # fmt: skip


def load_now() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="launches of every layout, in turn over all layouts")
    parser.add_argument(
        "--estimate", choices=("mean", "min"), default="mean",
        help="a layout's step from its launches: the least disturbed (other jobs only add time), or their mean",
    )  # fmt: skip
    parser.add_argument("--keep", type=Path, help="keep the profile, plans and runs in this folder")
    parser.add_argument("--reuse", type=Path, help="launch nothing: re-fit and re-predict from a --keep folder")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "calibration.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="pipectl-calibration-") as folder:
        work = args.reuse or args.keep or Path(folder)
        work.mkdir(parents=True, exist_ok=True)
        layouts = [("cal", i, layout) for i, layout in enumerate(CALIBRATION)] + [
            ("layout", i, layout) for i, layout in enumerate(PREDICTED)
        ]
        profile = work / "profile.json"
        loads: dict[str, list[float]] = {}
        if args.reuse is None:
            loads["profile"] = [load_now()]
            pipectl("profile", args.model, "-o", str(profile))
            for kind, i, layout in layouts:
                plan_layout(profile, layout, args.global_batch, work / f"{kind}-{i}" / "plan.json")
            # Every layout once, then every layout again: a slow spell of the machine falls on
            # different layouts in each round, and each layout's rounds differ by the noise.
            for repeat in range(args.repeats):
                for kind, i, layout in layouts:
                    folder_i = work / f"{kind}-{i}"
                    before = load_now()
                    launch(folder_i / "plan.json", folder_i / f"run-{repeat}", args.steps)
                    loads.setdefault(f"{kind}-{i}", []).extend([before, load_now()])
                    print(f"{repeat} {layout.name():28s} {measured_step(folder_i / f'run-{repeat}', args.warmup) * 1e3:8.2f} ms  load {load_now():.2f}", flush=True)
            (work / "loads.json").write_text(json.dumps(loads))
        else:
            loads = json.loads((work / "loads.json").read_text()) if (work / "loads.json").is_file() else {}

        def runs_of(kind: str, i: int) -> list[Path]:
            return sorted((work / f"{kind}-{i}").glob("run-*"))

        def measured_of(kind: str, i: int) -> tuple[float, list[float]]:
            medians = [measured_step(run, args.warmup) for run in runs_of(kind, i)]
            return (min(medians) if args.estimate == "min" else statistics.mean(medians)), medians

        def calibration_runs_of(i: int) -> list[Path]:
            runs = runs_of("cal", i)
            if args.estimate == "min":  # the least disturbed launch, as the layouts predicted are measured
                return [min(runs, key=lambda run: measured_step(run, args.warmup))]
            return runs

        calibration_runs = [run for i in range(len(CALIBRATION)) for run in calibration_runs_of(i)]
        calibrated = work / "calibrated.json"
        report = json.loads(pipectl("calibrate", *map(str, calibration_runs), "-o", str(calibrated), "--json"))

        def row(kind: str, i: int, layout: Layout) -> dict:
            plan = work / f"{kind}-{i}" / "plan.json"
            measured, medians = measured_of(kind, i)
            before, after = simulated_step(plan, profile), simulated_step(plan, calibrated)
            noise = (max(medians) - min(medians)) / measured if len(medians) > 1 else None
            lo = loads.get(f"{kind}-{i}", [])
            return {
                **asdict(layout), "layout": planned_label(plan), "ranks": layout.ranks, "measured_step_seconds": measured,
                "launch_medians": medians, "noise": noise,
                "predicted_before": before, "predicted_after": after,
                "error_before": abs(before - measured) / measured, "error_after": abs(after - measured) / measured,
                "load_average": statistics.mean(lo) if lo else None, "load_average_max": max(lo) if lo else None,
            }  # fmt: skip

        calibration_rows = [row("cal", i, layout) for i, layout in enumerate(CALIBRATION)]
        rows = [row("layout", i, layout) for i, layout in enumerate(PREDICTED)]
        for r in calibration_rows + rows:
            print(f"{r['layout']:28s} measured {r['measured_step_seconds'] * 1e3:8.2f} ms (noise {r['noise'] or 0:5.1%})"
                  f"  before {r['predicted_before'] * 1e3:8.2f} ({r['error_before']:5.1%})"
                  f"  after {r['predicted_after'] * 1e3:8.2f} ({r['error_after']:5.1%})")  # fmt: skip
    fitting = [r for r in rows if r["ranks"] <= 2]
    noises = [r["noise"] for r in calibration_rows + rows if r["noise"] is not None]
    all_loads = [x for values in loads.values() for x in values]
    result = {
        "machine": f"{os.cpu_count()} cores, {sys.platform}",
        "command": "benchmarks/calibration.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "runtime_seconds": time.time() - started,
        "model": args.model,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "repeats": args.repeats,
        "estimate": args.estimate,
        "load_average": {"mean": statistics.mean(all_loads), "max": max(all_loads)} if all_loads else None,
        "calibrated_on": [r["layout"] for r in calibration_rows],
        "calibration": report,
        "calibration_layouts": calibration_rows,
        "noise": {"median": statistics.median(noises), "max": max(noises)} if noises else None,
        "layouts": rows,
        "up_to_two_ranks": summary(fitting),
        "all": summary(rows),
        "time_unix": time.time(),
    }
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for name in ("noise", "up_to_two_ranks", "all"):
        print(name, json.dumps(result[name]))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
