"""pipectl launch vs a hand-written DeepSpeed job: throughput ratio and prediction error.

For each layout that fits this machine (p=1 d=1 on one rank; p=2 and d=2 on two ranks; micro-batch
sizes 2 and 8 at a global batch of 16; p=2 also with GPipe and Varuna):

(a) `pipectl plan` pins the layout, `pipectl launch`'s code path trains it (local engine: torchrun,
    pipectl's worker running the planned schedule inside DeepSpeed's engine, metrics every step);
(b) a hand-written DeepSpeed config and `deepspeed.initialize` on the same PipelineModule cut,
    trained with DeepSpeed's own schedule (`engine.train_batch`), started by the same torchrun.

Both use synthetic data and the same model, batch and cut, so the ratio measures what pipectl adds
around DeepSpeed (schedule executor, heartbeat gathering, metrics). Step times are medians over the
steps after `--warmup`, and each layout is run `--repeats` times (the machine is shared: the load
average is recorded next to every run).

Prediction error of (a), per layout: |predicted - measured| / measured, the measured step being the
median over the layout's repeats. Two predictions are reported: the plan's (what `pipectl plan`
wrote, from the search's own cost arithmetic) and the cost model's (`plan.cost_table.stage_costs_for`
re-simulated, what `pipectl simulate` shows). Profiles come from `pipectl profile`, which includes
the engine calibration (`ModelProfile.runtime`). The machine is shared with other jobs whose load
changes from minute to minute (a one-rank step measured 35 ms at a load average of 3 and 63 ms at
5), so by default every layout is profiled, planned and launched in a row, as `scripts/demo.sh`
does (`--profile-once` measures one profile for all layouts; `--profile PATH` reuses a file).

    .venv/bin/python benchmarks/launch_overhead.py --steps 30 --repeats 2
    -> benchmarks/results/launch_overhead.json
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
class LayoutRequest:
    devices: int
    pipeline: int
    micro_batch_size: int
    schedule: str = "1f1b"


LAYOUTS = [
    LayoutRequest(1, 1, 2),
    LayoutRequest(1, 1, 8),
    LayoutRequest(2, 2, 2),
    LayoutRequest(2, 2, 8),
    LayoutRequest(2, 1, 2),
    LayoutRequest(2, 1, 8),
    LayoutRequest(2, 2, 2, "gpipe"),
    LayoutRequest(2, 2, 2, "varuna"),
]


def run_pipectl_cli(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "pipectl.cli.main", *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"pipectl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def make_plan(profile: Path, layout: LayoutRequest, global_batch: int, out: Path) -> dict:
    run_pipectl_cli(
        "plan", "--profile", str(profile), "--cluster", "local", "--global-batch", str(global_batch),
        "--devices", str(layout.devices), "--pipeline-parallel", str(layout.pipeline),
        "--micro-batch-size", str(layout.micro_batch_size), "--schedules", layout.schedule, "--no-morph",
        "-o", str(out),
    )  # fmt: skip
    return json.loads(out.read_text())


def cost_model_step_seconds(plan_path: Path, profile_path: Path) -> float:
    """The chosen candidate re-simulated with `plan.cost_table` (what `pipectl simulate` shows)."""
    from pipectl.artifacts.plan import Plan
    from pipectl.artifacts.profile import ModelProfile
    from pipectl.cluster import local_cluster
    from pipectl.io import load_model
    from pipectl.plan.cost_table import stage_costs_for
    from pipectl.plan.simulate import simulate_step_seconds
    from pipectl.schedule import generate

    chosen = load_model(Plan, plan_path).chosen
    profile = load_model(ModelProfile, profile_path)
    costs = stage_costs_for(chosen, profile, local_cluster(chosen.devices))
    schedule = generate(chosen.schedule, chosen.pipeline_parallel, chosen.micro_batches, chosen.chunks, chosen.recompute)
    return simulate_step_seconds(schedule, costs)


def median_after(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:] if len(values) > warmup else values)


def run_pipectl(plan_path: Path, work: Path, steps: int, warmup: int) -> dict:
    from pipectl.artifacts.plan import Plan
    from pipectl.artifacts.run import DataKind, DataSpec
    from pipectl.io import load_model
    from pipectl.launch import LaunchOptions, prepare_launch, run_engine
    from pipectl.rundir.metrics import read_metrics

    plan = load_model(Plan, plan_path)
    prepared = prepare_launch(
        plan, work / "pipectl_run", LaunchOptions(steps=steps, data=DataSpec(kind=DataKind.SYNTHETIC), force=True),
        plan_dir=plan_path.parent,
    )
    started = time.perf_counter()
    code = run_engine(prepared.command, prepared.run_dir, timeout_seconds=400)
    wall = time.perf_counter() - started
    metrics = read_metrics(prepared.run_dir) if (prepared.run_dir / "metrics.jsonl").exists() else []
    if len(metrics) < steps:
        log = prepared.run_dir / "logs" / "engine.log"
        kept = ROOT / "benchmarks" / "results" / "launch_overhead_failure.log"
        kept.write_text(log.read_text(errors="replace"))
        raise SystemExit(f"pipectl run failed with exit code {code} after {len(metrics)} of {steps} steps; "
                         f"its log is kept in {kept}")  # fmt: skip
    measured = [m.step_seconds for m in metrics]
    return {
        "median_step_seconds": median_after(measured, warmup),
        "first_loss": metrics[0].loss,
        "last_loss": metrics[-1].loss,
        "wall_seconds_including_start": wall,
        # Every step trained; a non-zero code then comes from the ranks' shutdown (recorded, not fatal).
        "launcher_exit_code": code,
    }


def run_baseline(plan_path: Path, work: Path, steps: int, warmup: int) -> dict:
    from pipectl.launch.engines import rank_environment

    plan = json.loads(plan_path.read_text())
    out = work / "baseline.json"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc_per_node", str(plan["chosen"]["devices"]),
        str(Path(__file__).resolve()), "--baseline-worker", str(plan_path), str(out), "--steps", str(steps),
    ]  # fmt: skip
    env = {**os.environ, **rank_environment(gpus=False)}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400, check=False)
    if not out.exists():  # a non-zero code after the result was written is the ranks' shutdown
        raise SystemExit(f"baseline failed with exit code {result.returncode}:\n{result.stderr[-3000:]}")
    data = json.loads(out.read_text())
    return {"median_step_seconds": median_after(data["step_seconds"], warmup), "first_loss": data["losses"][0],
            "last_loss": data["losses"][-1]}  # fmt: skip


def baseline_worker(plan_path: Path, out: Path, steps: int) -> None:
    """One rank of (b): hand-written config, DeepSpeed's own schedule, no pipectl runtime."""
    import torch

    from pipectl.models import build_model
    from pipectl.runtime.engines import dsinit
    from pipectl.runtime.engines.pipeline import build_pipeline_module

    dsinit.init_distributed()  # only the CPU work-arounds (skip the shm-op JIT build)
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    chosen = json.loads(plan_path.read_text())["chosen"]
    p, d, b, m = (chosen[k] for k in ("pipeline_parallel", "data_parallel", "micro_batch_size", "micro_batches"))
    config = {
        "train_batch_size": b * m * d,
        "train_micro_batch_size_per_gpu": b,
        "gradient_accumulation_steps": m,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    model = build_model("gpt-tiny")
    module = build_pipeline_module(
        model, chosen["stage_layers"], topology=PipeDataParallelTopology(num_pp=p, num_dp=d)
    )
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    generator = torch.Generator().manual_seed(0)
    batches = [model.make_batch(b, generator) for _ in range(m * steps)]
    iterator = iter(batches)
    times, losses = [], []
    for _ in range(steps):
        started = time.perf_counter()
        loss = engine.train_batch(data_iter=iterator)
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
    if engine.global_rank == 0:
        out.write_text(json.dumps({"step_seconds": times, "losses": losses}))


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def load_average() -> float:
    return os.getloadavg()[0]


def measure_profile(path: Path) -> Path:
    """`pipectl profile gpt-tiny` (layers + engine calibration), with the load average it ran at."""
    load = load_average()
    run_pipectl_cli("profile", "gpt-tiny", "-o", str(path))
    profile = json.loads(path.read_text())
    profile["notes"].append(f"benchmark: profiled at a load average (1 min) of {load:.2f}")
    path.write_text(json.dumps(profile))
    return path


def measure_layout(layout: LayoutRequest, profile: Path, work: Path, args) -> dict:
    tag = f"t{layout.devices}_p{layout.pipeline}_b{layout.micro_batch_size}_{layout.schedule}"
    plan_path = work / f"plan_{tag}.json"
    chosen = make_plan(profile, layout, args.global_batch, plan_path)["chosen"]
    label = (f"p{chosen['pipeline_parallel']}d{chosen['data_parallel']} {chosen['schedule']}"
             f"{' +R' if chosen['recompute'] else ''} b{chosen['micro_batch_size']} m{chosen['micro_batches']}")  # fmt: skip
    runs = []
    for repeat in range(args.repeats):
        load_before = load_average()
        ours = run_pipectl(plan_path, work / f"{tag}_{repeat}", args.steps, args.warmup)
        theirs = run_baseline(plan_path, work / f"{tag}_{repeat}", args.steps, args.warmup) if args.baseline else None
        runs.append({"pipectl": ours, "deepspeed_baseline": theirs,
                     "load_average_1min": [round(load_before, 2), round(load_average(), 2)]})  # fmt: skip
    measured = statistics.median(r["pipectl"]["median_step_seconds"] for r in runs)
    planned = chosen["predicted_step_seconds"]
    modelled = cost_model_step_seconds(plan_path, profile)
    row = {
        "layout": label,
        "request": asdict(layout),
        "measured_step_seconds": measured,
        "plan_predicted_step_seconds": planned,
        "cost_model_predicted_step_seconds": modelled,
        "plan_abs_error": relative_error(planned, measured),
        "cost_model_abs_error": relative_error(modelled, measured),
        "runs": runs,
    }
    if args.baseline:
        baseline = statistics.median(r["deepspeed_baseline"]["median_step_seconds"] for r in runs)
        row["baseline_step_seconds"] = baseline
        row["throughput_ratio"] = baseline / measured
    print(f"{label}: measured {measured * 1e3:.1f} ms/step, plan {planned * 1e3:.1f} ms "
          f"({100 * row['plan_abs_error']:.0f} %), cost model {modelled * 1e3:.1f} ms "
          f"({100 * row['cost_model_abs_error']:.0f} %)"
          + (f", baseline {row['baseline_step_seconds'] * 1e3:.1f} ms, ratio {row['throughput_ratio']:.3f}"
             if args.baseline else "")
          + f", load {[r['load_average_1min'] for r in runs]}", flush=True)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--layouts", type=str, default=None,
                        help="comma-separated indices into LAYOUTS (default: all)")  # fmt: skip
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the DeepSpeed baseline")
    parser.add_argument("--profile", type=Path, default=None, help="profile.json of gpt-tiny (default: measure)")
    parser.add_argument("--profile-once", action="store_true", help="one profile for all layouts")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "launch_overhead.json")
    parser.add_argument("--baseline-worker", nargs=2, type=Path, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_worker:
        baseline_worker(*args.baseline_worker, steps=args.steps)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    layouts = LAYOUTS if args.layouts is None else [LAYOUTS[int(i)] for i in args.layouts.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="launch_overhead_") as tmp:
        work = Path(tmp)
        shared = args.profile
        if shared is None and args.profile_once:
            shared = measure_profile(work / "profile.json")
        rows = []
        for index, layout in enumerate(layouts):
            profile = shared or measure_profile(work / f"profile_{index}.json")
            row = measure_layout(layout, profile, work, args)
            row["profile_runtime_terms"] = json.loads(profile.read_text()).get("runtime")
            rows.append(row)
    plan_errors = [r["plan_abs_error"] for r in rows]
    model_errors = [r["cost_model_abs_error"] for r in rows]
    summary = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{os.cpu_count()} CPU cores, shared; load average (1 min) is recorded per run",
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup,
        "repeats": args.repeats,
        "global_batch": args.global_batch,
        "profiles": "given" if args.profile else ("one for all layouts" if args.profile_once else "one per layout, right before it"),
        "layouts": rows,
        "plan_prediction_median_abs_error": statistics.median(plan_errors),
        "plan_prediction_max_abs_error": max(plan_errors),
        "cost_model_prediction_median_abs_error": statistics.median(model_errors),
        "cost_model_prediction_max_abs_error": max(model_errors),
        "wall_seconds": time.perf_counter() - started,
    }
    if args.baseline:
        # DeepSpeed's own schedule is 1F1B: on the 1F1B layouts the ratio is what pipectl adds
        # around the engine; on GPipe and Varuna it also holds the schedules' own difference.
        same = [r["throughput_ratio"] for r in rows if r["request"]["schedule"] == "1f1b"]
        summary["throughput_ratio_same_schedule_min"] = min(same) if same else None
        summary["throughput_ratio_same_schedule_median"] = statistics.median(same) if same else None
        summary["throughput_ratio_min"] = min(r["throughput_ratio"] for r in rows)
        summary["throughput_ratio_median"] = statistics.median(r["throughput_ratio"] for r in rows)
        if same:
            print(f"throughput vs DeepSpeed's own schedule on the {len(same)} 1F1B layouts: "
                  f"min {summary['throughput_ratio_same_schedule_min']:.3f}, "
                  f"median {summary['throughput_ratio_same_schedule_median']:.3f}")  # fmt: skip
    print(f"prediction error over {len(rows)} layouts: plan median {100 * summary['plan_prediction_median_abs_error']:.0f} % "
          f"(max {100 * summary['plan_prediction_max_abs_error']:.0f} %), cost model median "
          f"{100 * summary['cost_model_prediction_median_abs_error']:.0f} % "
          f"(max {100 * summary['cost_model_prediction_max_abs_error']:.0f} %)")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
