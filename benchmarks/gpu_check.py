"""GPU check: what pipectl predicts against what one GPU host does, in one run, offline.

On a CUDA host with pipectl installed (no network needed), for one GPT shape:

1. measures the model layer by layer (`pipectl profile --device cuda`) and derives it for the
   device's catalog entry (`pipectl profile --derive`): per layer, derived / measured forward,
   backward, saved activations and peak memory;
2. plans for the visible GPUs (`pipectl plan --all` on a one-node cluster of them);
3. launches a few steps of up to three layouts through `pipectl launch` (the user's path): the
   plan's choice, the runnable candidate that the plan says fills memory most, and a one-GPU
   layout (the baseline's); per layout the step-time error (median after warm-up) and the
   memory error (the largest per-rank `torch.cuda.max_memory_reserved` against the plan's peak,
   and the same against `max_memory_allocated`);
   a layout that runs out of memory is recorded as such;
4. runs a hand-written single-GPU training loop on the same layers and batches (autocast bf16,
   fused AdamW, gradient accumulation over the same micro-batches) and reports its step time
   over pipectl's on the one-GPU layout (the baseline ratio: above 1.0, pipectl is faster).

It writes benchmarks/results/gpu-<device kind>.json. `--device cpu` runs the same path on CPU
ranks (gpt-tiny; memory is the ranks' resident set size, not comparable with the plan's device
figure): a check that the script works, not a GPU measurement.

    scripts/gpu-check.sh                              # on the GPU host
    .venv/bin/python benchmarks/gpu_check.py --device cpu --steps 4   # here
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3

# A GPT large enough to keep a GPU busy and small enough to profile in minutes: 8 blocks, hidden
# 2048, 16 heads of 128, sequence 2048, GPT-2's vocabulary rounded to 51200 (0.51 B parameters).
GPU_MODEL = {"family": "gpt", "layers": 8, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 51200,
             "tied_embeddings": True}  # fmt: skip


def pipectl(*args: object, check: bool = True) -> subprocess.CompletedProcess:
    """Run the pipectl CLI as a user would; its output is returned (and printed on failure)."""
    argv = [sys.executable, "-m", "pipectl.cli.main", *[str(a) for a in args]]
    print("$ pipectl", " ".join(str(a) for a in args), flush=True)
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise SystemExit(f"pipectl {args[0]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def device_kind_of(device: str, override: str | None) -> str:
    """The catalog name of this host's accelerator (`--device-kind` wins)."""
    if override:
        return override
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0).lower()
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    for marker, kind in (("h200", "h200"), ("h100", "h100-80gb"), ("a10g", "a10"), ("t4", "t4"), ("p100", "p100")):
        if marker in name:
            return kind
    if "a100" in name:
        return "a100-80gb" if total > 60 else "a100-40gb"
    if "v100" in name:
        return "v100-32gb" if total > 20 else "v100-16gb"
    raise SystemExit(f"no catalog entry known for '{torch.cuda.get_device_name(0)}': pass --device-kind")


def write_model(work: Path, quick: bool, shape: dict | None) -> Path:
    config = dict(shape or GPU_MODEL, name="gpu-check-gpt")
    if quick:
        config["layers"] = 4
    path = work / "model.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_cluster(work: Path, kind: str, gpus: int) -> Path:
    """One node of this host's visible GPUs."""
    path = work / "cluster.yaml"
    path.write_text(
        "schema_version: 1\nname: gpu-check\ndescription: this host's visible GPUs\nnode_types:\n"
        f"  - name: this-host\n    device: {kind}\n    devices_per_node: {gpus}\n    nodes: 1\n"
        "    price_per_device_hour_on_demand: 0.0\n"
    )
    return path


def compare_layers(measured: dict, derived: dict) -> list[dict]:
    """Per layer, tensor-parallel shard (t = 1 for the whole layer) and micro-batch size both
    profiles have: derived / measured of each figure."""
    rows = []
    for mine, theirs in zip(measured["layers"], derived["layers"]):
        pairs = [(1, mine["costs"], theirs["costs"])]
        their_shards = {shard["tensor_parallel"]: shard for shard in theirs.get("shards", [])}
        for shard in mine.get("shards", []):
            if shard["tensor_parallel"] in their_shards:
                pairs.append((shard["tensor_parallel"], shard["costs"], their_shards[shard["tensor_parallel"]]["costs"]))
        for t, mine_costs, their_costs in pairs:
            rows += _ratio_rows(mine, t, mine_costs, their_costs)
    return rows


def _ratio_rows(layer: dict, t: int, measured_costs: list, derived_costs: list) -> list[dict]:
    rows = []
    by_size = {cost["micro_batch_size"]: cost for cost in derived_costs}
    for cost in measured_costs:
        other = by_size.get(cost["micro_batch_size"])
        if other is None:
            continue
        row = {"layer": layer["name"], "kind": layer["kind"], "tensor_parallel": t,
               "micro_batch_size": cost["micro_batch_size"]}  # fmt: skip
        for field in ("forward_seconds", "backward_seconds", "saved_activation_bytes", "peak_memory_bytes"):
            name = field.replace("_seconds", "").replace("_bytes", "") + "_ratio"
            row[name] = other[field] / cost[field] if cost[field] else None
        rows.append(row)
    return rows


def summarise_ratios(rows: list[dict], kind: str) -> dict:
    """Median and worst |ratio - 1| per figure over the rows of one layer kind."""
    summary = {}
    for figure in ("forward_ratio", "backward_ratio", "saved_activation_ratio", "peak_memory_ratio"):
        errors = [abs(row[figure] - 1) for row in rows if row["kind"] == kind and row[figure] is not None]
        if errors:
            summary[figure.replace("_ratio", "")] = {"median_error": statistics.median(errors), "max_error": max(errors)}
    return summary


def layouts_to_run(plan: dict, limit: int) -> list[tuple[str, dict]]:
    """The plan's choice, the other runnable candidate nearest to full memory, and a one-GPU layout
    (unless the choice is one)."""
    runnable = [c for c in plan["candidates"] if c.get("deepspeed_runnable", True) and c != plan["chosen"]]
    chosen = [("chosen", plan["chosen"])]
    fullest = max(runnable, key=lambda c: max(c["peak_memory_bytes"]), default=None)
    single = None if plan["chosen"]["devices"] == 1 else next((c for c in runnable if c["devices"] == 1), None)
    picked = chosen
    for label, candidate in (("fills-memory", fullest), ("one-gpu", single)):
        if candidate is not None and all(candidate != c for _, c in picked):
            picked.append((label, candidate))
    return picked[:limit]


def checkpoint_figures(run_dir: Path, metrics: list, warmup: int) -> dict:
    """What the run's checkpoints cost (issue #46): the longest pause (training stopped for the
    copy to host memory), the longest wait of an optimizer step for a checkpoint's copies (on a GPU
    they overlap the step after the checkpoint), each step right after a checkpoint over the median
    of the steps not after one, and the background write rate (bytes over write + hash + commit
    seconds)."""
    from pipectl.rundir.checkpoints import read_events

    events = [e for e in read_events(run_dir) if e.outcome.value == "committed"]
    if not events:
        return {"checkpoints": 0}
    saved = {e.step for e in events}
    by_step = {m.step: m.step_seconds for m in metrics if m.step > warmup}
    plain = [seconds for step, seconds in by_step.items() if step - 1 not in saved]
    median = statistics.median(plain) if plain else None
    after = [by_step[step + 1] / median for step in saved if median and step + 1 in by_step]
    written = [e for e in events if e.write_seconds > 0]
    waits = [rank.checkpoint_seconds for m in metrics for rank in m.ranks if rank.checkpoint_seconds is not None]
    return {
        "checkpoints": len(events),
        "checkpoint_pause_seconds": max(e.stall_seconds for e in events),
        "checkpoint_copy_wait_seconds": max(waits, default=None),
        "step_after_checkpoint_ratio": max(after) if after else None,
        "checkpoint_write_gbytes_per_second": (statistics.median(e.bytes / e.write_seconds for e in written) / 1e9
                                               if written else None),
        "checkpoint_bytes": max(e.bytes for e in events),
    }  # fmt: skip


def run_layout(label: str, candidate: dict, plan_path: Path, work: Path, steps: int, warmup: int, gpu: bool,
               checkpoint_every: int | None = None) -> dict:  # fmt: skip
    from pipectl.artifacts.plan import Candidate, Plan
    from pipectl.io import load_model
    from pipectl.planfile import copy_plan
    from pipectl.rundir.analysis import analyse
    from pipectl.rundir.metrics import read_metrics

    plan = load_model(Plan, plan_path)
    layout_plan = work / f"plan-{label}.json"
    copy_plan(plan.model_copy(update={"chosen": Candidate.model_validate(candidate)}), plan_path.parent, layout_plan)
    run_dir = work / f"run-{label}"
    started = time.perf_counter()
    checkpoints = ["--checkpoint-every", checkpoint_every] if checkpoint_every else []
    result = pipectl("launch", layout_plan, "--run-dir", run_dir, "--steps", steps, "--data", "synthetic", "--force",
                     *checkpoints, check=False)  # fmt: skip
    metrics = read_metrics(run_dir)
    record = {
        "label": label,
        "layout": {key: candidate[key] for key in ("devices", "tensor_parallel", "pipeline_parallel", "data_parallel",
                                                     "micro_batch_size", "micro_batches", "schedule", "recompute")},
        "exit_code": result.returncode,
        "wall_seconds": time.perf_counter() - started,
        "steps_done": len(metrics),
        "out_of_memory": "out of memory" in (result.stdout + result.stderr).lower(),
        "predicted_step_seconds": candidate["predicted_step_seconds"],
        "predicted_peak_bytes": max(candidate["peak_memory_bytes"]),
    }  # fmt: skip
    if result.returncode != 0:
        record["terminal"] = (result.stdout + result.stderr)[-2000:]
    timed = [m for m in metrics[warmup:] if m.step_seconds > 0]
    if timed:
        measured = statistics.median(m.step_seconds for m in timed)
        record["measured_step_seconds"] = measured
        record["step_error"] = abs(candidate["predicted_step_seconds"] - measured) / measured
    measures = {"": "peak_reserved_bytes", "_allocated": "peak_allocated_bytes"} if gpu else {"": "peak_rss_bytes"}
    for suffix, field in measures.items():
        peaks = [value for m in metrics for rank in m.ranks if (value := getattr(rank, field))]
        if peaks:  # the largest per-rank peak any step recorded
            record[f"measured_peak{suffix}_bytes"] = max(peaks)
            record[f"memory_error{suffix}"] = abs(record["predicted_peak_bytes"] - max(peaks)) / max(peaks)
    record["memory_measure"] = "max_memory_reserved (and allocated)" if gpu else "resident set size"
    if timed:
        report = analyse(run_dir)
        measured_mfu = report.utilisation.measured
        record["measured_mfu"] = measured_mfu.mfu if measured_mfu is not None else None
        # Where the step goes per stage, predicted and measured (CUDA events on a GPU): forward,
        # backward, pipeline waits, gradient reductions, optimizer.
        record["phases"] = report.phases.to_dict() if report.phases is not None else report.phases_unavailable
    if checkpoint_every:
        record.update(checkpoint_figures(run_dir, metrics, warmup))
    return record


def baseline(model_ref: str, candidate: dict, steps: int, warmup: int, device: str, dtype: str) -> dict:
    """A hand-written single-device loop on the same layers, batches and accumulation."""
    import torch

    from pipectl.models import build_model

    torch.manual_seed(0)
    model = build_model(model_ref)
    target = torch.device(device)
    modules = []
    holders: dict[str, torch.nn.Module] = {}
    for layer in model.layers:
        if layer.tie_key is not None and layer.tie_key in holders:
            modules.append((layer, holders[layer.tie_key]))  # the tied head uses the embedding's module
            continue
        module = layer.build().to(target)
        if layer.tie_key is not None:
            holders[layer.tie_key] = module
        modules.append((layer, module))
    parameters = list({id(p): p for _, m in modules for p in m.parameters()}.values())
    fused = device == "cuda"
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=fused) if fused else torch.optim.AdamW(parameters, lr=1e-4)
    b, m = candidate["micro_batch_size"], candidate["micro_batches"]
    generator = torch.Generator().manual_seed(0)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    times = []
    for _ in range(steps):
        batches = [model.make_batch(b, generator) for _ in range(m)]
        batches = [(x.to(target), y.to(target)) for x, y in batches]
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for x, y in batches:
            with autocast:
                for layer, module in modules:
                    x = layer.forward(module, x)
                loss = model.loss_fn(x, y) / m
            loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = times[warmup:] or times
    return {"micro_batch_size": b, "micro_batches": m, "step_seconds": statistics.median(timed),
            "autocast_bf16": dtype == "bfloat16", "fused_adamw": fused}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when visible")
    parser.add_argument("--device-kind", default=None, help="catalog name (default: from the GPU's name)")
    parser.add_argument("--global-batch", type=int, default=None, help="default: 64 on GPU, 8 on CPU")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a 4-block model and sizes 1,2,4 (minutes less)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a GPT shape as YAML (family, layers, hidden, heads, seq_len, vocab) instead of the built-in one")
    parser.add_argument("--sizes", default=None, help="micro-batch sizes to profile (default 1,2,4,8 on GPU)")
    parser.add_argument("--tensor-parallel", default="1,2,4,8", help="blocks' tensor-parallel shards to measure on GPU")
    parser.add_argument("--layouts", type=int, default=3, help="how many layouts to launch (chosen first)")
    parser.add_argument("--checkpoint-every", type=int, default=4,
                        help="the chosen layout checkpoints every N steps (0: never): the pause and the next step")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="skip the hand-written loop (the result is written after each layout either way)")
    parser.add_argument("--work", type=Path, default=None, help="folder for profiles, plans and runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    kind = device_kind_of(device, args.device_kind)
    work = args.work or (ROOT / "runs" / f"gpu-check-{kind}")
    work.mkdir(parents=True, exist_ok=True)
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu-{kind}.json"
    dtype = "bfloat16" if gpu else "float32"
    sizes = args.sizes or ("1,2,4" if args.quick or not gpu else "1,2,4,8")
    global_batch = args.global_batch or (64 if gpu else 8)
    shape = yaml.safe_load(args.model.read_text()) if args.model else None
    model = str(write_model(work, args.quick, shape)) if gpu else "gpt-tiny"
    gpus = torch.cuda.device_count() if gpu else 2

    measured_path, derived_path, plan_path = work / "measured.json", work / "derived.json", work / "plan.json"
    # On a GPU the blocks' tensor-parallel shards too (16 heads: t = 2, 4, 8), one instance each.
    measure_args = ["--device", device, "--device-kind", kind, "--tensor-parallel", args.tensor_parallel] if gpu else ["--device", "cpu"]
    started = time.perf_counter()
    pipectl("profile", model, *measure_args, "--dtype", dtype, "-b", sizes, "-o", measured_path)
    profile_seconds = time.perf_counter() - started
    pipectl("profile", model, "--derive", "--device", kind, "--dtype", dtype, "-b", sizes, "-o", derived_path)
    measured, derived = json.loads(measured_path.read_text()), json.loads(derived_path.read_text())
    layer_rows = compare_layers(measured, derived)

    cluster = write_cluster(work, kind, gpus) if gpu else "local"
    device_args = [] if gpu else ["--devices", str(gpus)]
    pipectl("plan", "--profile", measured_path, "--cluster", cluster, *device_args, "--global-batch", global_batch,
            "--all", "--no-morph", "-o", plan_path)  # fmt: skip
    plan = json.loads(plan_path.read_text())
    facts = {
        "device": torch.cuda.get_device_name(0) if gpu else platform.processor() or "cpu",
        "device_kind": kind,
        "visible_devices": gpus,
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "pipectl": _version("pipectl"),
        "measured": time.strftime("%Y-%m-%d"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": (shape or GPU_MODEL) if gpu else model,
        "global_batch": global_batch,
        "dtype": dtype,
        "profile_seconds": profile_seconds,
        "derived_vs_measured": {"rows": layer_rows, "transformer_block": summarise_ratios(layer_rows, "transformer_block")},
    }  # fmt: skip
    layouts: list[dict] = []
    for index, (label, candidate) in enumerate(layouts_to_run(plan, args.layouts)):
        # The plan's choice checkpoints every few steps: the pause and the next step's slowdown.
        every = args.checkpoint_every if index == 0 else None
        layouts.append(run_layout(label, candidate, plan_path, work, args.steps, args.warmup, gpu, every))
        print(json.dumps(layouts[-1], indent=1), flush=True)
        write_result(out, facts, layouts, None)  # what ran so far, should a later layout or the baseline be cut short
    one_gpu = next((r for r in layouts if r["layout"]["devices"] == 1 and "measured_step_seconds" in r), None)
    reference = None
    if one_gpu is not None and args.baseline:
        reference = baseline(model, {**one_gpu["layout"]}, args.steps, args.warmup, device, dtype)
        reference["pipectl_step_seconds"] = one_gpu["measured_step_seconds"]
        reference["ratio"] = reference["step_seconds"] / one_gpu["measured_step_seconds"]
    result = write_result(out, facts, layouts, reference)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")


def write_result(out: Path, facts: dict, layouts: list[dict], reference: dict | None) -> dict:
    """The run's JSON with its summary, as far as it has come (`baseline` None until it ran)."""
    ran = [r for r in layouts if "step_error" in r]
    first = layouts[0] if layouts else {}
    result = {
        **facts,
        "layouts": layouts,
        "baseline": reference,
        "summary": {
            "max_step_error": max((r["step_error"] for r in ran), default=None),
            "max_memory_error": max((r["memory_error"] for r in ran if "memory_error" in r), default=None),
            "max_memory_error_allocated": max((r["memory_error_allocated"] for r in ran if "memory_error_allocated" in r),
                                              default=None),
            "baseline_ratio": reference["ratio"] if reference else None,
            "measured_mfu": max((r["measured_mfu"] for r in ran if r.get("measured_mfu") is not None), default=None),
            "checkpoint_pause_seconds": first.get("checkpoint_pause_seconds"),
            "checkpoint_copy_wait_seconds": first.get("checkpoint_copy_wait_seconds"),
            "step_after_checkpoint_ratio": first.get("step_after_checkpoint_ratio"),
            "checkpoint_write_gbytes_per_second": first.get("checkpoint_write_gbytes_per_second"),
            "out_of_memory": [r["label"] for r in layouts if r["out_of_memory"]],
            "failed": [r["label"] for r in layouts if r["exit_code"] != 0],
        },
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
