"""Losses after a live resize against the uninterrupted run, gpt-tiny or gpt-small (issue 21).

For each scenario of `resize_downtime.py` (shrink, grow, p2-to-d2): a job is launched with
`pipectl launch` in the background; after `--steps-before` steps it is moved live by
`pipectl resize RUN --devices N --live`; after `--steps-after` steps on the new layout it is
stopped at a step boundary (the stop file). A second run of the same plan, never resized, trains
as many steps as the first did. Every step's loss must match within `--tolerance` relative (fp32; the
tests' bar is 1e-4), and the steps on the new layout are counted, so a check that compared nothing
fails.

    .venv/bin/python benchmarks/live_resize_losses.py --model gpt-small --scenarios grow,p2-to-d2
    -> benchmarks/results/live_resize_losses_gpt_small.json

gpt-small trains at 25-60 s a step on this 2-core machine: the two scenarios above take about
half an hour.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from resize_downtime import (  # noqa: E402  (a sibling script, not a package)
    MODELS, PIPECTL, ROOT, SCENARIOS, STOP_FILE, _alive, _layout_change, environment, metrics, wait_for, write_plan,
)  # fmt: skip

TIMEOUT_SECONDS = 3600


def losses_by_step(run: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics(run)}


def resized_run(work: Path, model: str, scenario: str, before: int, after: int) -> tuple[Path, int, dict]:
    """A job moved live after `before` steps, trained `after` steps more; (run dir, its last step, resize record)."""
    start, two, devices = SCENARIOS[scenario]
    plan = write_plan(work / f"plan-{model}-{scenario}.json", model, start, two)
    run = work / f"live-{model}-{scenario}"
    launcher = subprocess.Popen(
        [*PIPECTL, "launch", str(plan), "--run-dir", str(run), "--steps", "100000", "--json"],
        env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: len(metrics(run)) >= before, TIMEOUT_SECONDS, "the job's first steps")
        target = metrics(run)[-1]["step"] + 100_000  # far beyond: the job is stopped below
        resizer = subprocess.run(
            [*PIPECTL, "resize", str(run), "--devices", str(devices), "--steps", str(target), "--live", "--json"],
            env=environment(), capture_output=True, text=True, timeout=TIMEOUT_SECONDS,
        )  # fmt: skip
        if resizer.returncode != 0:
            raise RuntimeError(f"pipectl resize failed: {resizer.stderr[-2000:]}")
        joined = json.loads(resizer.stdout).get("joined_pids") or []

        def steps_after() -> int:
            change = _layout_change(run)
            return 0 if change is None else sum(row["step"] >= change[1]["step"] for row in metrics(run))

        wait_for(lambda: steps_after() >= after or launcher.poll() is not None, TIMEOUT_SECONDS, "the steps after")
        (run / STOP_FILE).write_text("enough steps after the resize\n")
        _, stderr = launcher.communicate(timeout=TIMEOUT_SECONDS)
        if launcher.returncode != 0:
            raise RuntimeError(f"pipectl launch exited {launcher.returncode}: {stderr[-2000:]}")
        wait_for(lambda: not any(_alive(pid) for pid in joined), TIMEOUT_SECONDS, "the joined ranks")
    finally:
        if launcher.poll() is None:
            (run / STOP_FILE).write_text("check failed\n")
            launcher.wait(timeout=TIMEOUT_SECONDS)
    record = json.loads((run / "morphs.jsonl").read_text().splitlines()[-1])
    return run, metrics(run)[-1]["step"], record


def reference_run(work: Path, model: str, scenario: str, steps: int) -> Path:
    start, two, _ = SCENARIOS[scenario]
    plan = write_plan(work / f"plan-{model}-{scenario}-reference.json", model, start, two)
    run = work / f"reference-{model}-{scenario}"
    subprocess.run(
        [*PIPECTL, "launch", str(plan), "--run-dir", str(run), "--steps", str(steps), "--json"],
        check=True, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=TIMEOUT_SECONDS,
    )  # fmt: skip
    return run


def check(work: Path, model: str, scenario: str, before: int, after: int, tolerance: float) -> dict:
    started = time.time()
    run, last, record = resized_run(work, model, scenario, before, after)
    change = _layout_change(run)
    if change is None:
        raise RuntimeError(f"{model} {scenario}: the run's metrics never show a new layout")
    old, new = change
    reference = losses_by_step(reference_run(work, model, scenario, last))
    moved = losses_by_step(run)
    steps = []
    for step in sorted(moved):
        expected = reference.get(step)
        relative = abs(moved[step] - expected) / abs(expected) if expected is not None else None
        steps.append({"step": step, "loss": moved[step], "uninterrupted_loss": expected, "relative_difference": relative,
                      "layout": "new" if step >= new["step"] else "old"})  # fmt: skip
    after_resize = [s for s in steps if s["layout"] == "new"]
    worst = max((s["relative_difference"] for s in steps if s["relative_difference"] is not None), default=None)
    passed = (
        all(s["relative_difference"] is not None and s["relative_difference"] <= tolerance for s in steps)
        and len(after_resize) >= after
        and sorted(moved) == list(range(1, last + 1))
    )
    return {
        "model": model,
        "scenario": scenario,
        "from_layout": old["layout"],
        "to_layout": new["layout"],
        "resize_path": record.get("path"),
        "pause_seconds": new["time_unix"] - new["step_seconds"] - old["time_unix"],
        "steps": steps,
        "steps_after_resize": len(after_resize),
        "max_relative_difference": worst,
        "tolerance": tolerance,
        "passed": passed,
        "wall_seconds": time.time() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-small")
    parser.add_argument("--scenarios", default="grow,p2-to-d2", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--steps-before", type=int, default=2)
    parser.add_argument("--steps-after", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    scenarios = [name for name in args.scenarios.split(",") if name]
    unknown = [name for name in scenarios if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}: choose from {', '.join(SCENARIOS)}")
    output = args.output or ROOT / "benchmarks" / "results" / f"live_resize_losses_{args.model.replace('-', '_')}.json"

    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="pipectl-live-losses-") as tmp:
        for scenario in scenarios:
            row = check(Path(tmp), args.model, scenario, args.steps_before, args.steps_after, args.tolerance)
            results.append(row)
            print(
                f"{args.model} {scenario}: {row['from_layout']} -> {row['to_layout']} ({row['resize_path']}), "
                f"{row['steps_after_resize']} steps after, max relative loss difference "
                f"{row['max_relative_difference']:.2e} (tolerance {args.tolerance:g}): "
                f"{'PASS' if row['passed'] else 'FAIL'} [{row['wall_seconds']:.0f} s]",
                flush=True,
            )
    report = {
        "benchmark": "live_resize_losses",
        "command": shlex.join(["python", "benchmarks/live_resize_losses.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},  # fmt: skip
        "time_unix": time.time(),
        "results": results,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    sys.exit(0 if all(row["passed"] for row in results) else 1)


if __name__ == "__main__":
    main()
