"""Resize downtime, both paths (restart and live), against a cold start of the new layout.

Issue 5's target for the restart path: downtime <= 1.5x a cold start. Issue 21's for the live
path: pause <= 2 s median and <= 0.25x a cold start.

Scenarios, gpt-tiny (B = 8, b 2) and gpt-small (B = 4, b 1): shrink 2 ranks p=2 -> 1 rank; grow
1 rank -> 2 ranks p=2; p2 -> d2 (2 ranks, pipeline to data parallel: the morph table says d=2 for
2 devices). For each, a job is launched with `pipectl launch` in the background and, after a few
steps, resized by `pipectl resize RUN --devices N --live|--restart`, a whole CLI command as a user types it:

- pause: training halted, from the end of the last step on the old layout to the start of the
  first on the new one (metrics.jsonl: `time_unix` - `step_seconds`), the same for both paths;
- to first step: the end of the last old step to the end of the first new one (the pause plus
  one step on the new layout);
- request: from starting the resize command to the end of the first new step (on the live path it
  includes a joining rank's start-up, while the job keeps training);
- cold start: `pipectl launch` of a fresh run of the new layout, from the command's start to the
  start of its first step (`cold_to_first_step`: to its end).

Medians over `--repeats` (gpt-small: `--small-repeats`, default 1: a step takes 25-50 s here).

A replica lost without notice (gpt-tiny, d=2, a checkpoint every step): rank 1's process is
killed (SIGKILL, its pid from its heartbeat) after a few steps. In memory (`launch
--recover-in-memory`) the survivor goes on as one rank; on the restart path the launch fails and
`pipectl launch --resume` of the one-rank plan is started at once (an operator or a scheduler that
never hesitates). Both report the pause (last step completed before the kill -> first step begun
after) and the steps trained again; the in-memory run also reports its step time before the kill
against the restart run's (the cost of sending each rank's state to its neighbour every step).

    .venv/bin/python benchmarks/resize_downtime.py --repeats 3
    -> benchmarks/results/resize_downtime.json

`--live-only` runs the live path alone (no cold start, no restart), with the load average before
and after each run: what changes when the hand-over does (`results/resize_downtime_live*.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPECTL = [sys.executable, "-m", "pipectl.cli.main"]
RESTART_TARGET_RATIO = 1.5
LIVE_TARGET_RATIO = 0.25
LIVE_TARGET_SECONDS = 2.0
STOP_FILE = "stop_requested"  # the runtime's stop-at-the-next-step-boundary request

MODELS = {  # layers, the p=2 cut, B, b
    "gpt-tiny": (9, [(0, 4), (4, 9)], 8, 2),
    "gpt-small": (15, [(0, 8), (8, 15)], 4, 1),
}
SCENARIOS = {  # name: start layout, morph table's layout for 2 devices, target devices
    "shrink": ("p2", "p2", 1),
    "grow": ("p1", "p2", 2),
    "p2-to-d2": ("p2", "d2", 2),
}


def write_plan(path: Path, model: str, chosen: str, two: str) -> Path:
    """`model`'s plan choosing `chosen` ('p1', 'p2' or 'd2'); the morph table has p1 for 1 device
    and `two` for 2."""
    from pipectl.artifacts.plan import Candidate, MorphEntry, Plan, PlanRequest
    from pipectl.io import write_json_atomic
    from pipectl.models import build_model
    from pipectl.models.base import shape_of

    layers, cut, batch, b = MODELS[model]

    def candidate(name: str) -> Candidate:
        p, d = {"p1": (1, 1), "p2": (2, 1), "d2": (1, 2)}[name]
        return Candidate(
            devices=p * d, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=d,
            micro_batch_size=b, micro_batches=batch // (b * d), schedule="1f1b", recompute=False, zero_stage=1,
            stage_layers=[(0, layers)] if p == 1 else cut, predicted_step_seconds=0.05,
            samples_per_second=160.0, tflops_per_device=0.0, peak_memory_bytes=[1] * p,
            bubble_fraction=0.0, communication_fraction=0.0, cost_per_million_samples=0.0,
        )  # fmt: skip

    table = {1: candidate("p1"), 2: candidate(two)}
    plan = Plan(
        model=model, model_shape=shape_of(build_model(model)), cluster="local",
        request=PlanRequest(global_batch=batch), chosen=candidate(chosen),
        morph_table=[MorphEntry(devices=n, candidate=c) for n, c in table.items()],
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


def cold_start(work: Path, model: str, scenario: str, index: int) -> dict:
    """From starting `pipectl launch` of a fresh run of the new layout to its first step."""
    start, two, devices = SCENARIOS[scenario]
    plan = write_plan(work / f"plan-{model}-cold-{scenario}.json", model, "p1" if devices == 1 else two, two)
    run = work / f"cold-{model}-{scenario}-{index}"
    started = time.time()
    subprocess.run(
        [*PIPECTL, "launch", str(plan), "--run-dir", str(run), "--steps", "1", "--json"],
        check=True, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900,
    )  # fmt: skip
    first = metrics(run)[0]
    return {
        "cold_seconds": first["time_unix"] - first["step_seconds"] - started,
        "cold_to_first_step_seconds": first["time_unix"] - started,
        "layout": first["layout"],
    }


def _layout_change(run: Path) -> tuple[dict, dict] | None:
    """(last step on the old layout, first on the new one), once metrics show the new one."""
    rows = metrics(run)
    for before, after in zip(rows, rows[1:]):
        if after["layout"] != before["layout"] or after["world_size"] != before["world_size"]:
            return before, after
    return None


def resize(work: Path, model: str, scenario: str, index: int, live: bool) -> dict:
    """A running job resized by `pipectl resize` (restart or --live); see the module's docstring."""
    start, two, devices = SCENARIOS[scenario]
    plan = write_plan(work / f"plan-{model}-{scenario}.json", model, start, two)
    run = work / f"{'live' if live else 'restart'}-{model}-{scenario}-{index}"
    launcher = subprocess.Popen(
        [*PIPECTL, "launch", str(plan), "--run-dir", str(run), "--steps", "100000", "--json"],
        env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    resizer = None
    joined: list[int] = []
    try:
        wait_for(lambda: len(metrics(run)) >= 3, 900, "the job's first steps")
        started = time.time()
        target = metrics(run)[-1]["step"] + 100_000  # far beyond; the job is stopped below
        command = [*PIPECTL, "resize", str(run), "--devices", str(devices), "--steps", str(target), "--json"]
        resizer = subprocess.Popen(
            [*command, "--live" if live else "--restart"],
            env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        wait_for(lambda: _layout_change(run) is not None or resizer.poll() is not None, 900, "the resize")
        if live:  # the command returns once the first step on the new layout is recorded
            stdout, stderr = resizer.communicate(timeout=900)
        (run / STOP_FILE).write_text("benchmark done\n")
        if not live:
            stdout, stderr = resizer.communicate(timeout=900)
        if resizer.returncode != 0:
            raise RuntimeError(f"pipectl resize failed: {stderr[-2000:]}")
        payload = json.loads(stdout)
        joined = payload.get("joined_pids") or []
        launcher.wait(timeout=900)
        wait_for(lambda: not any(_alive(pid) for pid in joined), 900, "the joined ranks")
    finally:
        for proc in (resizer, launcher):
            if proc is not None and proc.poll() is None:
                (run / STOP_FILE).write_text("benchmark failed\n")
                proc.wait(timeout=900)
    before, after = _layout_change(run)
    record = json.loads((run / "morphs.jsonl").read_text().splitlines()[-1])
    return {
        "path": record.get("path", "restart"),
        "pause_seconds": after["time_unix"] - after["step_seconds"] - before["time_unix"],
        "to_first_step_seconds": after["time_unix"] - before["time_unix"],
        "request_seconds": after["time_unix"] - started,
        "first_step_seconds": after["step_seconds"],
        "record": record,
        "from_layout": before["layout"],
        "to_layout": after["layout"],
    }


def replica_loss(work: Path, model: str, index: int, in_memory: bool) -> dict:
    """A d=2 job whose rank 1 is killed after a few steps: recovered in memory, or restarted from
    its checkpoint (see the module's docstring)."""
    import signal

    plan = write_plan(work / f"plan-{model}-loss.json", model, "d2", "d2")
    run = work / f"loss-{'memory' if in_memory else 'restart'}-{model}-{index}"
    argv = [*PIPECTL, "launch", str(plan), "--run-dir", str(run), "--steps", "100000", "--checkpoint-every", "1", "--json"]
    launcher = subprocess.Popen([*argv, *(["--recover-in-memory"] if in_memory else [])], env=environment(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    resumed = None
    try:
        wait_for(lambda: len(metrics(run)) >= 12, 900, "the job's first steps")
        rows = metrics(run)[1:]  # the first step warms up
        steps_before = [b["time_unix"] - a["time_unix"] for a, b in zip(rows, rows[1:])]  # wall: the copy included
        beat = json.loads((run / "logs" / "heartbeat-rank1.json").read_text())
        os.kill(beat["pid"], signal.SIGKILL)
        if not in_memory:
            launcher.wait(timeout=900)  # the job fails; restart it at once on the rank left
            one = write_plan(work / f"plan-{model}-loss-p1.json", model, "p1", "d2")
            resumed = subprocess.Popen(
                [*PIPECTL, "launch", str(one), "--run-dir", str(run), "--resume", "--json"],
                env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        ended = resumed or launcher
        wait_for(lambda: _layout_change(run) is not None or ended.poll() is not None, 900, "the first step after the loss")
        if _layout_change(run) is None:
            raise RuntimeError(f"{run}: the job ended without training after the loss (see its logs/engine.log)")
    finally:
        (run / STOP_FILE).write_text("benchmark done\n")
        for proc in (launcher, resumed):
            if proc is not None:
                proc.wait(timeout=900)
    before, after = _layout_change(run)
    return {
        "path": "memory" if in_memory else "restart",
        "pause_seconds": after["time_unix"] - after["step_seconds"] - before["time_unix"],
        "steps_trained_again": before["step"] - (after["step"] - 1),
        "median_wall_seconds_per_step_before": statistics.median(steps_before),
        "from_layout": before["layout"],
        "to_layout": after["layout"],
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small-repeats", type=int, default=1, help="repeats for gpt-small (0: leave it out)")
    parser.add_argument("--no-replica-loss", dest="replica_loss", action="store_false",
                        help="leave out the kill -9 of a replica (in memory against restart)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="resize scenarios to run (comma-separated; '' for none)")
    parser.add_argument("--live-only", action="store_true",
                        help="only the live path (no cold start, no restart: a gpt-small repeat then takes minutes, not a quarter hour)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "resize_downtime.json")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory(prefix="pipectl-resize-bench-") as tmp:
        work = Path(tmp)
        for model, repeats in (("gpt-tiny", args.repeats), ("gpt-small", args.small_repeats)):
            for scenario in [name for name in args.scenarios.split(",") if name] if repeats else ():
                colds, restarts, lives = [], [], []
                for index in range(repeats):
                    # Interleaved so that the machine's background load affects all three alike.
                    if not args.live_only:
                        colds.append(cold_start(work, model, scenario, index))
                        restarts.append(resize(work, model, scenario, index, live=False))
                    load_before = os.getloadavg()
                    lives.append({**resize(work, model, scenario, index, live=True), "load_average_before": load_before,
                                  "load_average_after": os.getloadavg()})  # fmt: skip
                    print(
                        (f"{model} {scenario} #{index}: cold {colds[-1]['cold_seconds']:.2f} s, "
                         f"restart pause {restarts[-1]['pause_seconds']:.2f} s, " if colds else f"{model} {scenario} #{index}: ")
                        + f"live pause {lives[-1]['pause_seconds']:.2f} s (load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}); "
                        + f"rank 0's phases {lives[-1]['record']['pause_phases']}",
                        flush=True,
                    )  # fmt: skip
                results.append(summary(model, scenario, colds, restarts, lives))
        losses = {"memory": [], "restart": []}
        for index in range(args.repeats if args.replica_loss else 0):
            for path in losses:
                losses[path].append(replica_loss(work, "gpt-tiny", index, in_memory=path == "memory"))
            print(
                f"gpt-tiny replica loss #{index}: in memory pause {losses['memory'][-1]['pause_seconds']:.2f} s, "
                f"restart pause {losses['restart'][-1]['pause_seconds']:.2f} s",
                flush=True,
            )
    report = {
        "benchmark": "resize_downtime",
        "command": shlex.join(["python", "benchmarks/resize_downtime.py", *sys.argv[1:]]),
        "targets": {
            "restart_downtime_over_cold_start": RESTART_TARGET_RATIO,
            "live_pause_seconds": LIVE_TARGET_SECONDS,
            "live_pause_over_cold_start": LIVE_TARGET_RATIO,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_after": os.getloadavg(),
        },
        "time_unix": time.time(),
        "scenarios": results,
        "replica_loss": loss_summary(losses) if losses["memory"] else None,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    if report["replica_loss"]:
        loss = report["replica_loss"]
        print(
            f"gpt-tiny replica loss: in memory pause {loss['memory']['median_pause_seconds']:.2f} s, "
            f"{loss['memory']['median_steps_trained_again']} steps again; restart pause "
            f"{loss['restart']['median_pause_seconds']:.2f} s, {loss['restart']['median_steps_trained_again']} steps again; "
            f"step time with the peer copy {loss['step_time_ratio']:.3f}x"
        )
    for row in results:
        if row["restart"] is None:
            print(f"{row['model']} {row['scenario']}: {row['from']} -> {row['to']}: live pause {row['live']['median_pause_seconds']:.2f} s")
            continue
        print(
            f"{row['model']} {row['scenario']}: {row['from']} -> {row['to']}: cold start {row['median_cold_seconds']:.2f} s; "
            f"restart pause {row['restart']['median_pause_seconds']:.2f} s ({row['restart']['pause_over_cold']:.2f}x); "
            f"live pause {row['live']['median_pause_seconds']:.2f} s ({row['live']['pause_over_cold']:.3f}x)"
        )


def loss_summary(losses: dict[str, list[dict]]) -> dict:
    def path(runs: list[dict]) -> dict:
        return {
            "pause_seconds": [r["pause_seconds"] for r in runs],
            "median_pause_seconds": statistics.median(r["pause_seconds"] for r in runs),
            "median_steps_trained_again": statistics.median(r["steps_trained_again"] for r in runs),
            "median_wall_seconds_per_step_before": statistics.median(r["median_wall_seconds_per_step_before"] for r in runs),
            "runs": runs,
        }

    memory, restart = path(losses["memory"]), path(losses["restart"])
    return {
        "memory": memory,
        "restart": restart,
        "pause_ratio": memory["median_pause_seconds"] / restart["median_pause_seconds"],
        "step_time_ratio": memory["median_wall_seconds_per_step_before"] / restart["median_wall_seconds_per_step_before"],
    }


def summary(model: str, scenario: str, colds: list[dict], restarts: list[dict], lives: list[dict]) -> dict:
    """Medians per path; with `--live-only` (no cold start, no restart) the live path alone."""
    cold = statistics.median(c["cold_seconds"] for c in colds) if colds else None

    def path(runs: list[dict]) -> dict:
        pause = statistics.median(r["pause_seconds"] for r in runs)
        return {
            "pause_seconds": [r["pause_seconds"] for r in runs],
            "median_pause_seconds": pause,
            "median_to_first_step_seconds": statistics.median(r["to_first_step_seconds"] for r in runs),
            "median_request_seconds": statistics.median(r["request_seconds"] for r in runs),
            "pause_over_cold": pause / cold if cold else None,
            "runs": runs,
        }

    if not colds:
        live = path(lives)
        live["meets_target"] = live["median_pause_seconds"] <= LIVE_TARGET_SECONDS
        return {"model": model, "scenario": scenario, "from": lives[0]["from_layout"], "to": lives[0]["to_layout"],
                "cold_start": [], "median_cold_seconds": None, "restart": None, "live": live}  # fmt: skip

    restart, live = path(restarts), path(lives)
    restart["meets_target"] = restart["median_request_seconds"] / statistics.median(
        c["cold_to_first_step_seconds"] for c in colds
    ) <= RESTART_TARGET_RATIO
    live["meets_target"] = live["median_pause_seconds"] <= LIVE_TARGET_SECONDS and live["pause_over_cold"] <= LIVE_TARGET_RATIO
    return {
        "model": model,
        "scenario": scenario,
        "from": restarts[0]["from_layout"],
        "to": restarts[0]["to_layout"],
        "cold_start": colds,
        "median_cold_seconds": cold,
        "median_cold_to_first_step_seconds": statistics.median(c["cold_to_first_step_seconds"] for c in colds),
        "restart": restart,
        "live": live,
    }


if __name__ == "__main__":
    main()
