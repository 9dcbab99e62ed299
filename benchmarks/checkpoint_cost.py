"""What a checkpoint costs training: the pause, the background write, the bytes (issue 20).

For each model (GPT shapes from gpt-tiny up; `--models`), one rank, B = 8, the same plan twice
through `pipectl launch` as a user runs it:

- with checkpoints every K steps (`--every`, default 4; every one kept, so each can be verified);
- without (only the final checkpoint, after the last metrics line).

Figures, all measured in this run:

- stall: how long the training loop paused per checkpoint (rank 0's `stall_seconds` in
  logs/checkpoints.jsonl: the wait for a previous save, the copy into host memory, the space check);
- extra wall time per checkpoint: (wall time from step 1 to the last step with checkpoints - the
  same without) / checkpoints taken in between. This is what training lost, the background write's
  competition for the cores included; and at each checkpoint step alone (its interval to the next
  step, less the median interval without checkpoints: noisier, one step's jitter included);
- the throughput lost at one checkpoint every 100 steps: extra / (100 x the median step time);
- background write throughput: bytes / write_seconds (write, fsync, sha256, commit);
- bytes per parameter; whether every checkpoint verifies (sha256) and the losses of the two runs
  are equal (checkpointing must not change training).

On paper, from the measured write throughput: the per-rank state and write time of the shipped
GPT-3 175B and 1T layouts (published Megatron layouts; `PAPER_LAYOUTS`).

    .venv/bin/python benchmarks/checkpoint_cost.py                 # gpt-tiny, gpt-38m, gpt-95m
    -> benchmarks/results/checkpoint_cost.json
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
GLOBAL_BATCH, MICRO_BATCH = 8, 2
TARGET_STALL_SECONDS = 1.0
TARGET_LOSS_AT_100 = 0.02

# name: (layers, hidden, heads, seq_len, vocab); gpt-38m is issue 20's model.
MODELS = {
    "gpt-tiny": (6, 64, 4, 32, 256),
    "gpt-38m": (4, 512, 8, 128, 50257),
    "gpt-95m": (8, 768, 12, 128, 50257),
}
# Published layouts (Narayanan et al. 2021, Table 1): parameters, t, p, d.
PAPER_LAYOUTS = {
    "gpt3-175b on 1536 A100s": (174.6e9, 8, 12, 16),
    "gpt-1t on 3072 A100s": (1008.1e9, 8, 64, 6),
}
STATE_BYTES_PER_PARAMETER = 12  # fp32 master + two Adam moments: what a rank file holds


def write_model(folder: Path, name: str) -> Path:
    layers, hidden, heads, seq_len, vocab = MODELS[name]
    path = folder / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nfamily: gpt\nlayers: {layers}\nhidden: {hidden}\nheads: {heads}\n"
        f"seq_len: {seq_len}\nvocab: {vocab}\ntied_embeddings: true\n"
    )
    return path


def write_plan(folder: Path, model: Path) -> tuple[Path, int]:
    """One rank, B = 8 as 4 micro-batches of 2; returns the plan and the model's parameter count."""
    sys.path.insert(0, str(ROOT / "src"))
    from pipectl.artifacts.plan import Candidate, MorphEntry, Plan, PlanRequest
    from pipectl.io import write_json_atomic
    from pipectl.models import build_model
    from pipectl.models.base import shape_of

    built = build_model(str(model))
    shape = shape_of(built)
    candidate = Candidate(
        devices=1, device="cpu", tensor_parallel=1, pipeline_parallel=1, data_parallel=1,
        micro_batch_size=MICRO_BATCH, micro_batches=GLOBAL_BATCH // MICRO_BATCH, schedule="1f1b",
        recompute=False, zero_stage=1, stage_layers=[(0, len(built.layers))], predicted_step_seconds=1.0,
        samples_per_second=8.0, tflops_per_device=0.0, peak_memory_bytes=[1], bubble_fraction=0.0,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip
    plan = Plan(
        model=str(model), model_shape=shape, cluster="local", request=PlanRequest(global_batch=GLOBAL_BATCH),
        chosen=candidate, morph_table=[MorphEntry(devices=1, candidate=candidate)],
    )  # fmt: skip
    path = write_json_atomic(folder / f"{model.stem}.plan.json", plan)
    return path, shape.parameter_count


def launch(plan: Path, run: Path, steps: int, every: int) -> float:
    argv = [*PIPECTL, "launch", str(plan), "--run-dir", str(run), "--steps", str(steps),
            "--checkpoint-every", str(every), "--keep-checkpoints", "1000", "--json"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def read_run(run: Path) -> tuple[list[dict], list[dict]]:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    events_path = run / "logs" / "checkpoints.jsonl"
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line]
    return metrics, events


def measure(name: str, work: Path, steps: int, every: int) -> dict:
    from pipectl.rundir.checkpoints import list_checkpoints

    model = write_model(work, name)
    plan, parameters = write_plan(work, model)
    with_run, without_run = work / f"{name}-every{every}", work / f"{name}-final-only"
    launch(plan, without_run, steps, 0)
    launch(plan, with_run, steps, every)
    (with_metrics, with_events), (without_metrics, _) = read_run(with_run), read_run(without_run)
    span = lambda metrics: metrics[-1]["time_unix"] - metrics[0]["time_unix"]  # noqa: E731 (step 1 .. last)
    inside = [e for e in with_events if e["step"] < steps]  # checkpoints between step 1 and the last
    extra = (span(with_metrics) - span(without_metrics)) / len(inside)
    # Each checkpoint step alone: its interval to the next metrics line, less the median interval
    # of the run without checkpoints (the pause and the next step's competition with the writer).
    times = {m["step"]: m["time_unix"] for m in with_metrics}
    plain = [b["time_unix"] - a["time_unix"] for a, b in zip(without_metrics[1:], without_metrics[2:])]
    at_step = [times[e["step"] + 1] - times[e["step"]] - statistics.median(plain) for e in inside]
    step_seconds = statistics.median(m["step_seconds"] for m in without_metrics[1:])
    committed = [e for e in with_events if e["outcome"] == "committed"]
    checkpoints = list_checkpoints(with_run, hash_files=True)
    write_bytes = statistics.median(e["bytes"] for e in committed)
    write_seconds = statistics.median(e["write_seconds"] for e in committed)
    losses_equal = [m["loss"] for m in with_metrics] == [m["loss"] for m in without_metrics]
    result = {
        "model": name,
        "shape": dict(zip(("layers", "hidden", "heads", "seq_len", "vocab"), MODELS[name])),
        "parameters": parameters,
        "steps": steps,
        "checkpoint_every": every,
        "checkpoints_taken": len(with_events),
        "checkpoints_committed": len(committed),
        "checkpoints_verified": sum(c.verified for c in checkpoints),
        "median_step_seconds": step_seconds,
        "stall_seconds": [round(e["stall_seconds"], 4) for e in inside],
        "max_stall_seconds": max(e["stall_seconds"] for e in inside),
        "extra_wall_seconds_per_checkpoint": extra,
        "extra_wall_seconds_at_each_checkpoint_step": [round(x, 3) for x in at_step],
        "max_extra_wall_seconds_at_a_checkpoint_step": max(at_step),
        "throughput_lost_at_one_per_100_steps": max(0.0, extra) / (100 * step_seconds),
        "bytes": write_bytes,
        "bytes_per_parameter": write_bytes / parameters,
        "write_seconds": write_seconds,
        "write_bytes_per_second": write_bytes / write_seconds,
        "losses_equal": losses_equal,
    }
    result["meets_targets"] = (
        result["max_stall_seconds"] <= TARGET_STALL_SECONDS
        and max(at_step) <= TARGET_STALL_SECONDS
        and result["throughput_lost_at_one_per_100_steps"] <= TARGET_LOSS_AT_100
        and result["checkpoints_verified"] == len(committed) == len(with_events)
        and losses_equal
    )
    return result


def on_paper(write_bytes_per_second: float) -> dict:
    """Per-rank state and background write time of the published large layouts, at the write rate
    measured here (a GPU node's local NVMe writes faster; the stall is a device-to-host copy)."""
    figures = {}
    for name, (parameters, t, p, d) in PAPER_LAYOUTS.items():
        per_rank = STATE_BYTES_PER_PARAMETER * parameters / (t * p * d)
        figures[name] = {
            "layout": f"t{t}p{p}d{d}",
            "ranks": t * p * d,
            "bytes_per_rank": per_rank,
            "checkpoint_bytes": STATE_BYTES_PER_PARAMETER * parameters,
            "write_seconds_per_rank_at_measured_rate": per_rank / write_bytes_per_second,
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "checkpoint_cost.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as folder:
        for name in args.models:
            row = measure(name, Path(folder), args.steps, args.every)
            rows.append(row)
            print(
                f"{name:9s} {row['parameters'] / 1e6:7.1f} M params  step {row['median_step_seconds']:.2f} s  "
                f"stall max {row['max_stall_seconds']:.3f} s  extra/ckpt {row['extra_wall_seconds_per_checkpoint']:+.3f} s "
                f"(max at a step {row['max_extra_wall_seconds_at_a_checkpoint_step']:+.3f} s)  "
                f"lost@100 {100 * row['throughput_lost_at_one_per_100_steps']:.2f} %  "
                f"{row['bytes'] / 2**20:.0f} MiB ({row['bytes_per_parameter']:.1f} B/param)  "
                f"write {row['write_bytes_per_second'] / 2**20:.0f} MiB/s  "
                f"verified {row['checkpoints_verified']}/{row['checkpoints_taken']}  losses equal {row['losses_equal']}",
                flush=True,
            )
    rate = statistics.median(r["write_bytes_per_second"] for r in rows if r["bytes"] > 64 << 20) if any(
        r["bytes"] > 64 << 20 for r in rows) else rows[-1]["write_bytes_per_second"]  # fmt: skip
    paper = on_paper(rate)
    for name, figure in paper.items():
        print(f"on paper: {name} ({figure['layout']}): {figure['bytes_per_rank'] / 2**30:.2f} GiB per rank, "
              f"{figure['write_seconds_per_rank_at_measured_rate']:.1f} s each at {rate / 2**20:.0f} MiB/s, "
              f"all ranks in parallel")  # fmt: skip
    payload = {
        "benchmark": "checkpoint_cost",
        "command": "benchmarks/checkpoint_cost.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "time_unix": time.time(),
        "targets": {"stall_seconds": TARGET_STALL_SECONDS, "throughput_lost_at_one_per_100_steps": TARGET_LOSS_AT_100},
        "models": rows,
        "on_paper": paper,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
