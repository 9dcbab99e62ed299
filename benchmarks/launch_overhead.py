"""pipectl launch vs a hand-written DeepSpeed job: throughput ratio and prediction error.

For each layout that fits this machine (p=1 d=1 on one rank; p=2 and d=2 on two ranks):

(a) `pipectl plan` pins the layout, `pipectl launch`'s code path trains it (local engine: torchrun,
    pipectl's worker running the planned schedule inside DeepSpeed's engine, metrics every step);
(b) a hand-written DeepSpeed config and `deepspeed.initialize` on the same PipelineModule cut,
    trained with DeepSpeed's own schedule (`engine.train_batch`), started by the same torchrun.

Both use synthetic data and the same model, batch and cut, so the ratio measures what pipectl adds
around DeepSpeed (schedule executor, heartbeat gathering, metrics). Step times are medians over the
steps after `--warmup`. The prediction error compares (a)'s measured step time with the plan's
predicted step time, step by step.

    .venv/bin/python benchmarks/launch_overhead.py --steps 30
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [  # (devices, pinned pipeline degree)
    (1, 1),
    (2, 2),
    (2, 1),
]


def run_pipectl_cli(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "pipectl.cli.main", *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"pipectl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def make_plan(profile: Path, devices: int, pipeline: int, global_batch: int, out: Path) -> dict:
    run_pipectl_cli(
        "plan", "--profile", str(profile), "--cluster", "local", "--global-batch", str(global_batch),
        "--devices", str(devices), "--pipeline-parallel", str(pipeline), "--schedules", "1f1b", "-o", str(out),
    )  # fmt: skip
    return json.loads(out.read_text())


def median_after(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:] if len(values) > warmup else values)


def run_pipectl(plan_path: Path, work: Path, steps: int, warmup: int) -> dict:
    from pipectl.artifacts.plan import Plan
    from pipectl.artifacts.run import DataKind, DataSpec
    from pipectl.io import load_model
    from pipectl.launch import LaunchOptions, prepare_launch, run_engine
    from pipectl.runtime.metrics import read_metrics

    plan = load_model(Plan, plan_path)
    prepared = prepare_launch(
        plan, work / "pipectl_run", LaunchOptions(steps=steps, data=DataSpec(kind=DataKind.SYNTHETIC), force=True)
    )
    started = time.perf_counter()
    code = run_engine(prepared.command, prepared.run_dir, timeout_seconds=400)
    wall = time.perf_counter() - started
    if code != 0:
        log = prepared.run_dir / "logs" / "engine.log"
        kept = ROOT / "benchmarks" / "results" / "launch_overhead_failure.log"
        kept.write_text(log.read_text(errors="replace"))
        raise SystemExit(f"pipectl run failed with exit code {code}; its log is kept in {kept}")
    metrics = read_metrics(prepared.run_dir)
    measured = [m.step_seconds for m in metrics]
    predicted = plan.chosen.predicted_step_seconds
    errors = [abs(m - predicted) / m for m in measured[warmup:]]
    return {
        "median_step_seconds": median_after(measured, warmup),
        "predicted_step_seconds": predicted,
        "prediction_median_abs_error": statistics.median(errors),
        "prediction_max_abs_error": max(errors),
        "first_loss": metrics[0].loss,
        "last_loss": metrics[-1].loss,
        "wall_seconds_including_start": wall,
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
    if result.returncode != 0:
        raise SystemExit(f"baseline failed:\n{result.stderr[-3000:]}")
    data = json.loads(out.read_text())
    return {"median_step_seconds": median_after(data["step_seconds"], warmup), "first_loss": data["losses"][0],
            "last_loss": data["losses"][-1]}  # fmt: skip


def baseline_worker(plan_path: Path, out: Path, steps: int) -> None:
    """One rank of (b): hand-written config, DeepSpeed's own schedule, no pipectl runtime."""
    import torch

    from pipectl.models import build_model
    from pipectl.runtime import dsinit
    from pipectl.runtime.pipeline import build_pipeline_module

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--profile", type=Path, default=None, help="profile.json of gpt-tiny (default: measure)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "launch_overhead.json")
    parser.add_argument("--baseline-worker", nargs=2, type=Path, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_worker:
        baseline_worker(*args.baseline_worker, steps=args.steps)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="launch_overhead_") as tmp:
        work = Path(tmp)
        profile = args.profile
        if profile is None:
            profile = work / "profile.json"
            run_pipectl_cli("profile", "gpt-tiny", "-o", str(profile))
        rows = []
        for devices, pipeline in LAYOUTS:
            plan_path = work / f"plan_{devices}_{pipeline}.json"
            chosen = make_plan(profile, devices, pipeline, args.global_batch, plan_path)["chosen"]
            layout = (f"p{chosen['pipeline_parallel']}d{chosen['data_parallel']} "
                      f"b{chosen['micro_batch_size']} m{chosen['micro_batches']}")  # fmt: skip
            ours = run_pipectl(plan_path, work / layout.replace(" ", "_"), args.steps, args.warmup)
            theirs = run_baseline(plan_path, work / layout.replace(" ", "_"), args.steps, args.warmup)
            ratio = theirs["median_step_seconds"] / ours["median_step_seconds"]
            rows.append({"layout": layout, "pipectl": ours, "deepspeed_baseline": theirs, "throughput_ratio": ratio})
            print(f"{layout}: pipectl {ours['median_step_seconds'] * 1e3:.1f} ms/step, "
                  f"baseline {theirs['median_step_seconds'] * 1e3:.1f} ms/step, ratio {ratio:.3f}, "
                  f"predicted {ours['predicted_step_seconds'] * 1e3:.1f} ms "
                  f"(median abs error {100 * ours['prediction_median_abs_error']:.0f} %)")  # fmt: skip
    errors = [r["pipectl"]["prediction_median_abs_error"] for r in rows]
    summary = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup,
        "global_batch": args.global_batch,
        "layouts": rows,
        "throughput_ratio_min": min(r["throughput_ratio"] for r in rows),
        "prediction_median_abs_error_over_layouts": statistics.median(errors),
        "prediction_max_abs_error_over_layouts": max(r["pipectl"]["prediction_max_abs_error"] for r in rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
