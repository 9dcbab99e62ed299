"""An uneven split of the global batch over device kinds against the best homogeneous subset.

(a) Measured on this machine: `configs/clusters/local-mixed.yaml` is one CPU rank as it is and one
    emulating a kind twice as slow (its worker waits out each forward and backward once more).
    gpt-tiny is profiled here (`pipectl profile`), planned at global batch B on local-mixed (the
    planner splits the batch over the two kinds and predicts the gain over the fast kind alone)
    and on the fast kind alone (`local`, one rank), and both plans are launched in turn
    (`pipectl launch --engine local`), `--repeats` times each. Reported: predicted and measured
    step times (medians over the steps after the first), speed-ups, and prediction errors.
(b) Predicted only: the shipped `mixed-v100-p100` cluster (8 V100 + 8 P100) on GPT-2 2.5B,
    profiles derived per kind with the compute model (`pipectl profile --derive`), at several
    global batches: the split's step against the best homogeneous subset, with a profile per kind
    and with the V100 profile alone (the P100 then scaled by the ratio of peak FLOP/s, 6.7x).

    .venv/bin/python benchmarks/hetero_split.py --steps 12 --repeats 3
    -> benchmarks/results/hetero_split.json
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPECTL = [sys.executable, "-m", "pipectl.cli.main"]


def pipectl(*args: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*PIPECTL, *args], cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def measured_step(run_dir: Path) -> float:
    """Median step time over the steps after the first (which includes start-up work)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(m["step_seconds"] for m in lines if m["step"] > 1)


def describe(candidate: dict) -> str:
    if candidate.get("replicas") and candidate["device"] == "mixed":
        return " + ".join(f"{r['device']} {r['micro_batch_size']}x{r['micro_batches']}" for r in candidate["replicas"])
    return (f"t{candidate['tensor_parallel']} p{candidate['pipeline_parallel']} d{candidate['data_parallel']} "
            f"b{candidate['micro_batch_size']} x m{candidate['micro_batches']} on {candidate['device']}")


def emulated(work: Path, global_batch: int, steps: int, repeats: int) -> dict:
    pipectl("profile", "gpt-tiny", "-b", "1,2,4", "-o", "profile.json", cwd=work)
    pipectl("plan", "--profile", "profile.json", "--cluster", "local-mixed", "--global-batch", str(global_batch),
            "--no-morph", "-o", "split/plan.json", cwd=work)
    pipectl("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "1",
            "--global-batch", str(global_batch), "--no-morph", "-o", "alone/plan.json", cwd=work)
    plans = {name: read_json(work / name / "plan.json")["chosen"] for name in ("split", "alone")}
    if plans["split"]["device"] != "mixed":
        raise SystemExit(f"the planner did not split the batch at B = {global_batch}: {describe(plans['split'])} "
                         "(try a larger --global-batch)")
    measured: dict[str, list[float]] = {"split": [], "alone": []}
    loads = []
    for repeat in range(repeats):
        for name in ("split", "alone"):  # in turn, so both see the same load
            run = work / "runs" / f"{name}-{repeat}"
            pipectl("launch", f"{name}/plan.json", "--engine", "local", "--steps", str(steps),
                    "--run-dir", str(run), cwd=work)
            measured[name].append(measured_step(run))
            loads.append(os.getloadavg()[0])
    result = {}
    for name, candidate in plans.items():
        step = statistics.median(measured[name])
        predicted = candidate["predicted_step_seconds"]
        result[name] = {
            "layout": describe(candidate),
            "predicted_step_seconds": predicted,
            "measured_step_seconds": step,
            "measured_per_repeat": measured[name],
            "prediction_error": abs(predicted - step) / step,
        }
    result["predicted_speedup"] = result["alone"]["predicted_step_seconds"] / result["split"]["predicted_step_seconds"]
    result["measured_speedup"] = result["alone"]["measured_step_seconds"] / result["split"]["measured_step_seconds"]
    result["load_average"] = loads
    return result


def shipped_mixed(work: Path, batches: list[int]) -> dict:
    for device in ("v100-16gb", "p100"):
        pipectl("profile", "gpt2-2.5b", "--derive", "--device", device, "-o", f"{device}.json", cwd=work)
    rows = []
    for batch in batches:
        row = {"global_batch": batch}
        for label, profiles in (("per_kind", ["v100-16gb.json", "p100.json"]), ("peak_ratio", ["v100-16gb.json"])):
            out = f"mixed-{label}-{batch}.json"
            args = [arg for path in profiles for arg in ("--profile", path)]
            pipectl("plan", *args, "--cluster", "mixed-v100-p100", "--global-batch", str(batch), "--no-morph",
                    "-o", out, cwd=work)
            plan = read_json(work / out)
            split = next((c for c in [plan["chosen"], *plan["candidates"]] if c["device"] == "mixed"), None)
            best = next(c for c in [plan["chosen"], *plan["candidates"]] if c["device"] != "mixed")
            row[label] = {
                "chosen": describe(plan["chosen"]),
                "homogeneous_step_seconds": best["predicted_step_seconds"],
                "homogeneous": describe(best),
                "split_step_seconds": split["predicted_step_seconds"] if split else None,
                "split": describe(split) if split else None,
                "speedup": best["predicted_step_seconds"] / split["predicted_step_seconds"] if split else None,
            }
        rows.append(row)
    return {"model": "gpt2-2.5b (derived per kind)", "cluster": "mixed-v100-p100", "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="128,512,2048", help="global batches for the shipped mixed cluster")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "hetero_split.json")
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hetero-split-") as folder:
        work = Path(folder)
        result = {
            "machine": f"{os.cpu_count()} cores, {sys.platform}",
            "command": " ".join(["benchmarks/hetero_split.py", *sys.argv[1:]]),
            "emulated": {"cluster": "local-mixed", "model": "gpt-tiny", "global_batch": args.global_batch,
                         "steps": args.steps, "repeats": args.repeats,
                         **emulated(work, args.global_batch, args.steps, args.repeats)},
            "shipped": shipped_mixed(work, [int(b) for b in args.batches.split(",")]),
        }
    result["seconds"] = round(time.time() - started, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    e = result["emulated"]
    print(f"local-mixed, gpt-tiny, B = {args.global_batch}:")
    for name in ("split", "alone"):
        r = e[name]
        print(f"  {name:6} {r['layout']:44} predicted {r['predicted_step_seconds'] * 1e3:7.2f} ms, "
              f"measured {r['measured_step_seconds'] * 1e3:7.2f} ms ({r['prediction_error']:.1%})")
    print(f"  speed-up of the split: predicted {e['predicted_speedup']:.2f}x, measured {e['measured_speedup']:.2f}x")
    print("mixed-v100-p100, gpt2-2.5b (derived), predicted:")
    for row in result["shipped"]["rows"]:
        for label in ("per_kind", "peak_ratio"):
            r = row[label]
            speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "no split fits"
            print(f"  B {row['global_batch']:5} {label:10} homogeneous {r['homogeneous_step_seconds']:7.2f} s, split "
                  f"{r['split_step_seconds'] or float('nan'):7.2f} s: {speedup} ({r['split']})")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
