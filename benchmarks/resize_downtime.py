"""Resize downtime vs a cold start of the same job on the new layout (issue 5; target ratio <= 1.5).

For each scenario (shrink: 2 ranks p=2 -> 1 rank; grow: 1 rank -> 2 ranks p=2), gpt-tiny, B = 8:

- resize: `pipectl launch` trains the starting layout in the background; once it has done a few
  steps, `pipectl resize RUN --devices N` is started. Downtime = from starting that command to the
  first step completed on the new layout (its `time_unix` in metrics.jsonl). It covers the CLI's
  start, the stop at a step boundary (finish the step, checkpoint, convert to a universal
  checkpoint, exit), the rewrite of the run, and the relaunch: ranks start, load the re-cut
  checkpoint, train one step.
- cold start: `pipectl launch` of a fresh run on the new layout. Time from starting that command
  to its first completed step.

Both are whole CLI commands started as a user would, timed the same way; medians over `--repeats`.
The morph record's own breakdown (stop, rewrite, relaunch to first step) is reported as well.

    .venv/bin/python benchmarks/resize_downtime.py --repeats 3
    -> benchmarks/results/resize_downtime.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPECTL = [sys.executable, "-m", "pipectl.cli.main"]
TARGET_RATIO = 1.5
STEPS_BEFORE_RESIZE = 5
STOP_FILE = "stop_requested"  # the runtime's stop-at-the-next-step-boundary request


def write_plan(path: Path, chosen_devices: int) -> Path:
    """gpt-tiny, B = 8: 1 rank p=1 (m 4) and 2 ranks p=2 (m 4); `chosen_devices` picks the start."""
    from pipectl.artifacts.plan import Candidate, MorphEntry, Plan, PlanRequest
    from pipectl.io import write_json_atomic
    from pipectl.models import build_model
    from pipectl.models.base import shape_of

    def candidate(p: int) -> Candidate:
        return Candidate(
            devices=p, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=1,
            micro_batch_size=2, micro_batches=4, schedule="1f1b", recompute=False, zero_stage=1,
            stage_layers=[(0, 9)] if p == 1 else [(0, 4), (4, 9)], predicted_step_seconds=0.05,
            samples_per_second=160.0, tflops_per_device=0.0, peak_memory_bytes=[1] * p,
            bubble_fraction=0.0, communication_fraction=0.0, cost_per_million_samples=0.0,
        )  # fmt: skip

    table = {1: candidate(1), 2: candidate(2)}
    plan = Plan(
        model="gpt-tiny", model_shape=shape_of(build_model("gpt-tiny")), cluster="local",
        request=PlanRequest(global_batch=8), chosen=table[chosen_devices], morph_table=[MorphEntry(devices=n, candidate=c) for n, c in table.items()],
    )  # fmt: skip
    return write_json_atomic(path, plan)


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def cold_start(work: Path, devices: int, index: int) -> float:
    """Seconds from starting `pipectl launch` to the first completed step of a fresh run."""
    plan = write_plan(work / f"plan-cold-{devices}.json", devices)
    run = work / f"cold-{devices}-{index}"
    started = time.time()
    subprocess.run(
        [*PIPECTL, "launch", str(plan), "--run-dir", str(run), "--steps", "3", "--json"],
        check=True, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip
    return metrics(run)[0]["time_unix"] - started


def _first_step_on_new_layout(run: Path) -> dict | None:
    """The first metrics line written after the relaunch recorded in morphs.jsonl."""
    path = run / "morphs.jsonl"
    if not path.is_file():
        return None
    record = json.loads(path.read_text().splitlines()[-1])
    if record.get("relaunched_unix") is None:
        return None
    later = [m for m in metrics(run) if m["step"] > record["resume_step"] and m["time_unix"] >= record["relaunched_unix"]]
    return min(later, key=lambda m: m["time_unix"]) if later else None


def resize_downtime(work: Path, start_devices: int, target_devices: int, index: int) -> dict:
    """Seconds from starting `pipectl resize` on a running job to its first step on the new layout."""
    plan = write_plan(work / f"plan-start-{start_devices}.json", start_devices)
    run = work / f"resize-{start_devices}-{target_devices}-{index}"
    launcher = subprocess.Popen(
        [*PIPECTL, "launch", str(plan), "--run-dir", str(run), "--steps", "100000", "--json"],
        env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    resizer = None
    try:
        wait_for(lambda: len(metrics(run)) >= STEPS_BEFORE_RESIZE, 300, "the job's first steps")
        started = time.time()
        # Far beyond where the old job will stop; the new job is stopped once it has done a step.
        target = metrics(run)[-1]["step"] + 100_000
        resizer = subprocess.Popen(
            [*PIPECTL, "resize", str(run), "--devices", str(target_devices), "--steps", str(target), "--json"],
            env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        wait_for(lambda: _first_step_on_new_layout(run) is not None or resizer.poll() is not None, 600, "the resize")
        (run / STOP_FILE).write_text("benchmark done\n")
        stdout, stderr = resizer.communicate(timeout=300)
        if resizer.returncode != 0:
            raise RuntimeError(f"pipectl resize failed: {stderr[-2000:]}")
        payload = json.loads(stdout)
        launcher.wait(timeout=60)
    finally:
        for proc in (resizer, launcher):
            if proc is not None and proc.poll() is None:
                (run / STOP_FILE).write_text("benchmark failed\n")
                proc.wait(timeout=120)
    record = json.loads((run / "morphs.jsonl").read_text().splitlines()[-1])
    first_new = _first_step_on_new_layout(run)
    return {
        "downtime_seconds": first_new["time_unix"] - started,
        "record_downtime_seconds": record["downtime_seconds"],
        "stop_seconds": record["stop_seconds"],
        "request_to_relaunch_seconds": record["relaunched_unix"] - record["requested_unix"],
        "relaunch_to_first_step_seconds": record["first_step_unix"] - record["relaunched_unix"],
        "resume_step": record["resume_step"],
        "from_layout": payload["from_layout"],
        "to_layout": payload["to_layout"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "resize_downtime.json")
    args = parser.parse_args()

    scenarios = [("shrink", 2, 1), ("grow", 1, 2)]
    results = []
    with tempfile.TemporaryDirectory(prefix="pipectl-resize-bench-") as tmp:
        work = Path(tmp)
        for name, start, target in scenarios:
            colds, resizes = [], []
            for index in range(args.repeats):
                # Interleaved so that the machine's background load affects both alike.
                colds.append(cold_start(work, target, index))
                resizes.append(resize_downtime(work, start, target, index))
                print(f"{name} #{index}: cold {colds[-1]:.2f} s, resize {resizes[-1]['downtime_seconds']:.2f} s", flush=True)
            cold = statistics.median(colds)
            downtime = statistics.median(r["downtime_seconds"] for r in resizes)
            results.append(
                {
                    "scenario": name,
                    "from": resizes[0]["from_layout"],
                    "to": resizes[0]["to_layout"],
                    "cold_start_seconds": colds,
                    "resize_downtime_seconds": [r["downtime_seconds"] for r in resizes],
                    "median_cold_start_seconds": cold,
                    "median_resize_downtime_seconds": downtime,
                    "ratio": downtime / cold,
                    "meets_target": downtime / cold <= TARGET_RATIO,
                    "median_stop_seconds": statistics.median(r["stop_seconds"] for r in resizes),
                    "median_request_to_relaunch_seconds": statistics.median(
                        r["request_to_relaunch_seconds"] for r in resizes
                    ),
                    "median_relaunch_to_first_step_seconds": statistics.median(
                        r["relaunch_to_first_step_seconds"] for r in resizes
                    ),
                    "runs": resizes,
                }
            )
    report = {
        "benchmark": "resize_downtime",
        "command": f"{Path(sys.executable).name} benchmarks/resize_downtime.py --repeats {args.repeats}",
        "model": "gpt-tiny",
        "global_batch": 8,
        "target_ratio": TARGET_RATIO,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_after": os.getloadavg(),
        },
        "time_unix": time.time(),
        "scenarios": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for row in results:
        print(
            f"{row['scenario']}: {row['from']} -> {row['to']}: resize {row['median_resize_downtime_seconds']:.2f} s, "
            f"cold start {row['median_cold_start_seconds']:.2f} s, ratio {row['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
