"""Calibrate on two short runs, predict the layouts not run: `pipectl calibrate` against the
measured profile alone, on this machine.

1. `pipectl profile MODEL` (the engine calibration included), once.
2. Two calibration layouts are planned (pinned), launched for `--steps` steps and calibrated
   from (`pipectl calibrate`).
3. Every other layout is planned from the measured profile, launched, and its measured step
   (median after the first `--warmup` steps) compared with the step the chosen candidate
   simulates to under the measured profile and under the calibrated one (`plan.phases`).

Reported: per layout the three figures; median and max absolute error before and after
calibration over the predicted layouts, and Spearman's rank correlation between predicted and
measured step times. The machine has 2 cores: layouts of 3 and 4 ranks over-subscribe it, and are
reported apart from those of 1 and 2. The load average is recorded next to every run, and one
calibration layout is launched a second time: the difference between its two measured steps is
the machine's own noise, a floor under any prediction error.

    .venv/bin/python benchmarks/calibration.py --steps 12
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
    Layout(1, 2, 2), Layout(1, 2, 4), Layout(1, 3, 2), Layout(2, 2, 2), Layout(4, 1, 2),
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
    from pipectl.runtime.metrics import read_metrics

    steps = [m.step_seconds for m in read_metrics(run)]
    return statistics.median(steps[warmup:] if len(steps) > warmup else steps)


def simulated_step(plan_path: Path, profile_path: Path) -> float:
    from pipectl.artifacts.plan import Plan
    from pipectl.artifacts.profile import ModelProfile
    from pipectl.cluster import load_cluster
    from pipectl.io import load_model
    from pipectl.plan.phases import simulated_phases

    plan = load_model(Plan, plan_path)
    return simulated_phases(plan.chosen, load_model(ModelProfile, profile_path), load_cluster(plan.cluster))[1]


def planned_label(plan_path: Path) -> str:
    from pipectl.artifacts.layout import layout_label
    from pipectl.artifacts.plan import Plan
    from pipectl.io import load_model

    return layout_label(load_model(Plan, plan_path).chosen)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def summary(rows: list[dict]) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "calibration.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="pipectl-calibration-") as folder:
        work = Path(folder)
        profile = work / "profile.json"
        pipectl("profile", args.model, "-o", str(profile))
        calibration_runs = []
        for i, layout in enumerate(CALIBRATION):
            plan = plan_layout(profile, layout, args.global_batch, work / f"cal-{i}" / "plan.json")
            calibration_runs.append(launch(plan, work / f"cal-{i}" / "run", args.steps))
        calibrated = work / "calibrated.json"
        report = json.loads(pipectl("calibrate", *map(str, calibration_runs), "-o", str(calibrated), "--json"))
        # The machine's own noise: the last calibration layout launched again, its step against the first time's.
        again = launch(work / f"cal-{len(CALIBRATION) - 1}" / "plan.json", work / "repeat" / "run", args.steps)
        first, second = measured_step(calibration_runs[-1], args.warmup), measured_step(again, args.warmup)
        repeat = {"layout": planned_label(work / f"cal-{len(CALIBRATION) - 1}" / "plan.json"),
                  "first_seconds": first, "second_seconds": second, "difference": abs(second - first) / first}  # fmt: skip
        rows = []
        for i, layout in enumerate(PREDICTED):
            plan = plan_layout(profile, layout, args.global_batch, work / f"layout-{i}" / "plan.json")
            run = launch(plan, work / f"layout-{i}" / "run", args.steps)
            measured = measured_step(run, args.warmup)
            before, after = simulated_step(plan, profile), simulated_step(plan, calibrated)
            rows.append({
                **asdict(layout), "layout": planned_label(plan), "ranks": layout.ranks, "measured_step_seconds": measured,
                "predicted_before": before, "predicted_after": after,
                "error_before": abs(before - measured) / measured, "error_after": abs(after - measured) / measured,
                "load_average": os.getloadavg()[0],
            })  # fmt: skip
            print(f"{planned_label(plan):28s} measured {measured * 1e3:7.2f} ms  before {before * 1e3:7.2f}  after {after * 1e3:7.2f}")
    fitting = [r for r in rows if r["ranks"] <= 2]
    result = {
        "machine": f"{os.cpu_count()} cores, {sys.platform}",
        "command": "benchmarks/calibration.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "global_batch": args.global_batch,
        "calibrated_on": [run["layout"] for run in report["runs"]],
        "calibration": report,
        "repeat": repeat,
        "layouts": rows,
        "up_to_two_ranks": summary(fitting),
        "all": summary(rows),
        "time_unix": time.time(),
    }
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for name in ("up_to_two_ranks", "all"):
        print(name, json.dumps(result[name]))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
