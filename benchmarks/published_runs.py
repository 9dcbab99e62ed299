"""Published large-scale training runs against pipectl's predictions (issue #15).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/published_runs.py [--only ID,ID] [--workers N] [--no-write]

Reads benchmarks/published_runs.yaml (shape, devices, layout, global batch, measured throughput and
the source of each published run) and, for every row:

1. turns the published throughput into a step time: the step time itself where the source gives
   it (a training log, the paper), else FLOPs per step / (TFLOP/s per GPU x GPUs) with the FLOP count
   the source used (`flops_formulas` in the YAML);
2. derives pipectl's profile of the shape on the catalog device (`pipectl.profile.derive`, the
   kernel model, with the attention the run computed: unfused before 2022, flash after), builds a
   cluster of the published size (the catalog's links, or the source's network where it differs);
3. derives the profile as the run's engine ran the model (`engine` in the YAML: vocabulary-parallel
   embedding and head, sequence parallelism, fused kernels, dropout, the even split of the blocks,
   tensor-parallel and data-parallel overlap, gradients reduced in fp32;
   `pipectl.artifacts.profile.EngineFeatures`) and
   plans with the published layout pinned: t, p, d, micro-batch, schedule (interleaved with the
   published chunks v), ZeRO stage and, where published, full recomputation (Megatron-LM's
   per-layer activation checkpointing, `checkpoint_layers`); fields the source
   does not give (null in the YAML) are left to the planner, which takes its fastest choice for
   them. Schedules DeepSpeed cannot run and ZeRO-0 are allowed here (Megatron ran them);
4. plans again with nothing pinned but the devices and the global batch (`pipectl plan`'s own
   search, DeepSpeed-runnable schedules, ZeRO-1, the profile without the engine's features: what
   pipectl would launch) and reports its predicted step against the pinned prediction;
5. plans a third time on the pinned prediction's profile, nothing pinned but the devices and the
   global batch, with what the run's engine runs (1F1B, and interleaving unless its transfers are
   DeepSpeed's; no recomputation or per-layer checkpointing, selective where the run used it; the
   published ZeRO stage): the layout pipectl would recommend to a user of that engine, against the
   published one on the same engine (`own_on_engine`, summarised in `summary.own_on_engine`).

Each pinned step is split on its busiest stage twice: as `pipectl status` shows phases (forward,
backward, pipeline waits, end of step) and by cause (`pinned_phases.split`): compute, the exposed
tensor-parallel collectives inside the forwards and backwards, pipeline waits (bubble and
transfers), the exposed data-parallel collectives and the optimizer step.

The device constants are configs/devices.yaml as committed; nothing is fitted to these rows. The
error of each row is (predicted - published) / published. Prints a table and writes
benchmarks/results/published_runs.json (rows, median and max absolute error over the rows with a
published figure, per device kind, the constants and where they came from, command, machine, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pipectl.artifacts.calibration import RunsCalibration  # noqa: E402
from pipectl.artifacts.cluster import ClusterSpec  # noqa: E402
from pipectl.artifacts.model import ModelConfig  # noqa: E402
from pipectl.artifacts.plan import Candidate, PlanRequest, Recompute, RecomputeChoice  # noqa: E402
from pipectl.artifacts.profile import EngineFeatures  # noqa: E402
from pipectl.catalog import get_device  # noqa: E402
from pipectl.errors import PipectlError  # noqa: E402
from pipectl.io import write_json_atomic  # noqa: E402
from pipectl.plan.costs import hardware_for, layer_seconds
from pipectl.plan.layer_table import layer_table  # noqa: E402
from pipectl.plan.phases import simulated_phases  # noqa: E402
from pipectl.plan.search import plan  # noqa: E402
from pipectl.profile.derive import DEFAULT_SHARD_DEGREES, derive_profile  # noqa: E402

RUNS = ROOT / "benchmarks" / "published_runs.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "published_runs.json"
CATALOG = ROOT / "configs" / "devices.yaml"
# Micro-batch sizes every profile is derived for (the planner searches these where b is free).
MICRO_BATCH_SIZES = (1, 2, 4, 8)
TARGET_MEDIAN, TARGET_MAX = 0.10, 0.20
# The diagnostic's device memory (bytes): far beyond any layout here, within the profile's bounds.
UNBOUNDED_MEMORY = 2**50
# Layers Megatron splits over the tensor group by vocabulary and pipectl keeps whole on every rank.
VOCAB_LAYER_KINDS = ("embedding", "lm_head")

# What configs/devices.yaml says of each compute constant the predictions read (from its comments
# and its history: `git log -p configs/devices.yaml`). None was changed for this benchmark.
CONSTANTS_PROVENANCE = {
    "peak_tflops_bf16, memory_bandwidth, multiprocessors, link figures": "datasheets (NVIDIA A100, V100, H100 datasheets and architecture whitepapers); not tuned",
    "h100-80gb.gemm_efficiency = 0.74": (
        "FITTED: the one value that puts derived/measured forward and backward of 36 GEMM-bound H100 "
        "block shards (tests/profile/data/h100-block-shards.json, measured on one H100 SXM5) at a median "
        "of 1.00 (commit c53a791). Used by every H100 row here; not fitted to any published run. Below the "
        "best matmul shape's burst on one H100 SXM, 794.5 TFLOP/s = 0.803 (Bekman's MAMF table)"
    ),
    "kernel_overhead_us = 40 (every device)": (
        "FITTED on the same H100 reference (the middle of its launch-bound floors, 29-67 us per kernel) "
        "and used for all devices; it matters only for small shards (launch-bound), not for these shapes"
    ),
    "a100-40gb / a100-80gb.gemm_efficiency = 0.8": (
        "ESTIMATE (catalog: 'about 80 % of the 312 TFLOP/s peak at the 400 W limit; not measured here'); not tuned. "
        "Below the best matmul shape's burst on one A100 SXM with idle neighbours, 271.2 TFLOP/s = 0.869 (Bekman, "
        "'Machine Learning Engineering', Maximum Achievable Matmul FLOPS table): no measurement found that puts "
        "it lower"
    ),
    "a100 / h100 / h200.intra_node_allreduce_bandwidth_gbytes_per_second = 230 / 370 / 370": (
        "MEASURED by others: NCCL's bus bandwidth inside an 8-GPU NVSwitch node, the NVLink line rate (300 / 450 GB/s) "
        "less NCCL's protocol overhead (NCCL maintainer in https://github.com/NVIDIA/nccl-tests/issues/149 and /212; "
        "232.5 and 368.8 GB/s measured in /175 and /309); prices the tensor-parallel collectives of every row with "
        "t > 1. Not tuned"
    ),
    "v100-16gb / v100-32gb.gemm_efficiency = 0.66 (was 0.8, an estimate)": (
        "MEASURED by others: cuBLAS fp16 GEMMs on V100 tensor cores 'up to 83 Tflops/s' of 125 (Markidis et al. 2018, "
        "IPDPSW, abstract); 85 for an 8192^3 matmul (yaroslavvb/stuff matmul_benchmark_seq.py). Not tuned"
    ),
    "a100.attention_efficiency = 0.6": "FlashAttention-2 paper (Dao 2023, 50-73 % of peak on A100); read only by flash attention (no A100 row here runs flash)",
    "v100-32gb.attention_efficiency = 0.3": "ESTIMATE (memory-efficient SDPA); read only by flash attention (the V100 rows run unfused)",
    "h100-80gb.attention_efficiency = 0.35": "FlashAttention-3 paper (Shah et al. 2024: FlashAttention-2 reaches 35 % of H100 peak)",
    "plan.costs.OVERLAP_COMPUTE_SLOWDOWN = 0.189": (
        "MEASURED by others: compute beside an overlapped collective runs 18.9 % slower on average (at most 40 %), "
        "GPT and Llama training on 4 A100, H100, MI250 and MI210 (arXiv 2507.03114, abstract); prices every "
        "overlapped collective (tensor-parallel, gradient reduction, parameter all-gather). Not tuned"
    ),
    "engine features (published_runs.yaml `engine`)": (
        "NOT constants and not tuned: what each run's engine did (vocabulary-parallel embedding and head, sequence "
        "parallelism, fused kernels, dropout, the even split of the blocks, tensor-parallel and data-parallel overlap, "
        "gradients reduced in fp32, DeepSpeed's synchronous pipeline transfers, its BF16_Optimizer's whole all-reduce, blocking launches), each read in the engine's code or scripts at the row's commit "
        "(the row's `engine.source`), except llama3-*: Meta's engine is not public, its features are ASSUMED from "
        "the paper's description (a pipeline balanced for a vocabulary-split output layer, FSDP-style overlapped "
        "data parallelism; gradients reduce-scattered in fp32, the paper's §3.3.2) and from the tensor-parallel "
        "engines of 2024 (Megatron-Core; PyTorch's torchtitan Llama 3 recipe), marked verified: false. The overlaps, "
        "the fp32 gradient reductions, the even split and the rendezvous transfers are terms of the "
        "cost model (plan/costs.py, plan/cost_table.py, plan/partition.py, plan/simulate.py), the rest of the derived profile "
        "(profile/compute_model.py, profile/derive.py)"
    ),
    "efficiency_by_micro_batch curves": (
        "whole-training MFU taken from published runs (A100: Narayanan et al. 2021 Table 1, the same table as "
        "the ptdp-* rows here; V100: Shoeybi et al. 2019; H100: Llama 3 Table 4, the same as the llama3-* rows). "
        "NOT read by these predictions: derived profiles on devices with compute constants use the kernel "
        "model, and the planner reads the curve only for tensor-parallel degrees without derived shards "
        "(shards exist for t = 2, 4, 8; every row here uses t in 1, 2, 4, 8; checked per row)"
    ),
}


# ------------------------------------------------------------------------------------------------
# Published step time


def flops_megatron_ptdp_eq3(row: dict, recompute_factor: int) -> float:
    """Narayanan et al. 2021 Eq. 3: 24 f B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    m, batch = row["model"], row["global_batch"]
    s, l, h, v = m["seq_len"], m["layers"], m["hidden"], m["vocab"]
    return 24 * recompute_factor * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def flops_megatron_core_2024(row: dict) -> float:
    """Megatron-LM num_floating_point_operations (commit f2e5db402c): forward + backward, no recompute."""
    m, batch = row["model"], row["global_batch"]
    s, l, h, v, a = m["seq_len"], m["layers"], m["hidden"], m["vocab"], m["heads"]
    g = m.get("kv_heads") or a
    ffn = m.get("ffn_hidden") or 4 * h
    gated = 1.5 if m.get("activation") == "swiglu" else 1.0
    query_ratio = 1.0  # heads x head dimension = hidden for every row here
    return 12 * batch * s * l * h * h * (
        (1 + g / a + s / h) * query_ratio + (ffn / h) * gated + v / (2 * l * h)
    )


def step_flops(row: dict) -> float | None:
    published = row.get("published") or {}
    formula = published.get("flops_formula")
    if formula == "megatron_ptdp_eq3":
        return flops_megatron_ptdp_eq3(row, 4 if row.get("recompute") == "full" else 3)
    if formula == "megatron_core_2024":
        return flops_megatron_core_2024(row)
    return None


def published_step(row: dict) -> tuple[float | None, str]:
    """(seconds, how) from the row's published throughput."""
    published = row.get("published")
    if not published:
        return None, "no published throughput"
    if published.get("step_seconds"):
        return float(published["step_seconds"]), "published step time"
    flops = step_flops(row)
    if flops is None or not published.get("tflops_per_gpu"):
        return None, "no step time and no FLOP count"
    seconds = flops / (published["tflops_per_gpu"] * 1e12 * row["devices"]["count"])
    return seconds, f"{published['flops_formula']}: {flops:.4g} FLOP / ({published['tflops_per_gpu']} TFLOP/s x {row['devices']['count']})"


# ------------------------------------------------------------------------------------------------
# Model, cluster, profile


MODEL_KEYS = ("layers", "hidden", "heads", "seq_len", "vocab", "tied_embeddings", "kv_heads", "ffn_hidden",
              "activation", "norm", "linear_bias", "rotary")


def model_config(row: dict) -> ModelConfig:
    fields = {key: row["model"][key] for key in MODEL_KEYS if key in row["model"]}
    return ModelConfig(name=row["id"], family="gpt", shape_only=True, **fields)


def cluster_of(row: dict) -> ClusterSpec:
    devices = row["devices"]
    nodes = math.ceil(devices["count"] / devices["per_node"])
    node_type = {"name": f"{devices['kind']}-nodes", "device": devices["kind"],
                 "devices_per_node": devices["per_node"], "nodes": nodes}
    if devices.get("links"):
        node_type["links"] = devices["links"]
    return ClusterSpec(name=f"published-{row['id']}", description=row["name"], node_types=[node_type])


def engine_features(row: dict) -> EngineFeatures | None:
    """The row's engine features (the YAML's `engine`, each with its source), or None: the run is
    priced as pipectl's own runtime would run it."""
    engine = row.get("engine")
    if not engine:
        return None
    return EngineFeatures(**{key: value for key, value in engine.items() if key not in ("evidence", "verified")})


def micro_batch_sizes(row: dict) -> list[int]:
    sizes = set(MICRO_BATCH_SIZES)
    if row["layout"].get("micro_batch_size"):
        sizes.add(int(row["layout"]["micro_batch_size"]))
    return sorted(sizes)


# ------------------------------------------------------------------------------------------------
# Planning


def run_lengths(values: list[int]) -> str:
    """[1, 1, 3, 3, 3] -> '1x2 3x3': layers per stage (virtual stage), in pipeline order."""
    groups: list[list[int]] = []
    for value in values:
        if groups and groups[-1][0] == value:
            groups[-1][1] += 1
        else:
            groups.append([value, 1])
    return " ".join(f"{value}x{count}" for value, count in groups)


def candidate_summary(candidate: Candidate) -> dict:
    return {
        "devices": candidate.devices,
        "t": candidate.tensor_parallel,
        "p": candidate.pipeline_parallel,
        "d": candidate.data_parallel,
        "b": candidate.micro_batch_size,
        "m": candidate.micro_batches,
        "v": candidate.chunks,
        "schedule": candidate.schedule.value,
        "recompute": candidate.recompute,
        "checkpoint_layers": candidate.checkpoint_layers,
        "zero_stage": candidate.zero_stage,
        "step_seconds": round(candidate.predicted_step_seconds, 3),
        "tflops_per_device": round(candidate.tflops_per_device, 1),
        "bubble_fraction": round(candidate.bubble_fraction, 3),
        "communication_fraction": round(candidate.communication_fraction, 3),
        "peak_memory_gib_max": round(max(candidate.peak_memory_bytes) / 2**30, 1),
        "layers_per_stage": run_lengths([end - start for start, end in candidate.stage_layers]),
    }


def pinned_request(row: dict, workers: int | None) -> PlanRequest:
    layout = row["layout"]
    schedule = layout.get("schedule")
    chunks = [int(layout["v"])] if layout.get("v") and int(layout["v"]) > 1 else [2, 4]
    return PlanRequest(
        global_batch=row["global_batch"],
        devices=row["devices"]["count"],
        tensor_parallel=layout["t"],
        pipeline_parallel=layout["p"],
        data_parallel=layout["d"],
        micro_batch_size=layout.get("micro_batch_size"),
        schedule=schedule,
        chunks=chunks,
        zero_stages=[layout.get("zero_stage", 1)],
        # Megatron-LM's "full" recompute is per-layer activation checkpointing; its "selective" the
        # attention core only.
        recompute={"full": RecomputeChoice.LAYER, "selective": RecomputeChoice.SELECTIVE,
                   "none": RecomputeChoice.NEVER}.get(row.get("recompute"), RecomputeChoice.AUTO),
        include_all=True,
        for_deepspeed=False,
        morph=False,
        workers=workers,
    )


def pick_pinned(row: dict, candidates: list[Candidate]) -> tuple[Candidate | None, str]:
    """The fastest candidate that matches what the source pins (recompute, chunks): "full" is
    per-layer activation checkpointing (Megatron-LM's), on every stage, p = 1 included."""
    layout = row["layout"]
    wanted_recompute = {"full": Recompute.LAYER, "selective": Recompute.SELECTIVE,
                        "none": Recompute.NONE}.get(row.get("recompute"))
    matching = [
        c for c in candidates
        if (wanted_recompute is None or c.recompute_granularity is wanted_recompute)
        and (not layout.get("v") or c.chunks == int(layout["v"]))
    ]
    if not matching:
        kinds = sorted({(c.schedule.value, c.chunks, c.recompute_granularity.label) for c in candidates})
        wanted = wanted_recompute.label if wanted_recompute is not None else None
        return None, f"no feasible candidate with recompute={wanted} v={layout.get('v')} (feasible: {kinds})"
    return min(matching, key=lambda c: c.predicted_step_seconds), ""


def pinned_plan(row: dict, profile, cluster: ClusterSpec, workers: int | None) -> tuple[Candidate | None, str, dict]:
    """(the pinned candidate or None, why not, the planner's infeasibility counts)."""
    try:
        result = plan(profile, cluster, pinned_request(row, workers))
    except PipectlError as error:
        return None, str(error), {}
    chosen, why = pick_pinned(row, list(result.candidates))
    return chosen, why, dict(result.infeasible or {})


def tensor_parallel_seconds(candidate: Candidate, profile, cluster: ClusterSpec, rank: int) -> float:
    """The exposed tensor-parallel collectives in one step of pipeline rank `rank`: its layers'
    forward and backward seconds (recomputed forwards included) priced as the planner prices them
    (`plan.costs.layer_seconds`), less the same with collectives that cost nothing, times the
    step's micro-batches."""
    t = candidate.tensor_parallel
    if t <= 1:
        return 0.0
    hardware = hardware_for(cluster, profile)
    # Collectives that cost nothing: no latency, no bandwidth limit, no host time to issue them.
    free = dataclasses.replace(hardware, device=hardware.device.model_copy(update={"kernel_overhead_us": 0.0}),
                               links=dataclasses.replace(hardware.links, allreduce_intra_latency_seconds=0.0,
                                                         allreduce_intra_bandwidth_bytes_per_second=1e30))
    table = layer_table(profile, candidate.micro_batch_size, t)
    priced, bare = layer_seconds(table, hardware, t), layer_seconds(table, free, t)
    p = candidate.pipeline_parallel
    seconds = 0.0
    for stage, (start, end) in enumerate(candidate.stage_layers):
        if stage % p != rank:
            continue
        for timing, sign in ((priced, 1.0), (bare, -1.0)):
            work = timing.stage_forward(start, end) + timing.stage_backward(start, end)
            if candidate.recompute or candidate.checkpoint_layers:
                work += (timing.stage_forward(start, end) if candidate.recompute
                         else timing.recomputed_forward(start, end))
            seconds += sign * work
    return max(0.0, seconds) * candidate.micro_batches


def phase_breakdown(candidate: Candidate, profile, cluster: ClusterSpec) -> dict:
    """Where the pinned step goes, on its busiest stage (the most forward + backward seconds):
    forward (recomputation included), backward, pipeline waits (bubble and exposed transfers) and
    end of step (exposed data-parallel collectives and the optimizer), as `pipectl status` shows
    them (`plan.phases.simulated_phases`); and the same step split by cause: compute (forward and
    backward less the exposed tensor-parallel collectives they include), those collectives,
    pipeline waits (bubble and point-to-point), the exposed data-parallel collectives and the
    optimizer step."""
    stages, step = simulated_phases(candidate, profile, cluster)
    index = max(range(len(stages)), key=lambda i: stages[i][0] + stages[i][1])
    forward, backward, waits, reductions, optimizer, _ = stages[index]  # no checkpoint in a pinned step
    end = reductions + optimizer
    tensor_parallel = min(tensor_parallel_seconds(candidate, profile, cluster, index), forward + backward)
    return {"stage": index, "forward_seconds": round(forward, 4), "backward_seconds": round(backward, 4),
            "pipeline_waits_seconds": round(waits, 4), "end_of_step_seconds": round(end, 4),
            "step_seconds": round(step, 4),
            "split": {"compute_seconds": round(forward + backward - tensor_parallel, 4),
                      "tensor_parallel_exposed_seconds": round(tensor_parallel, 4),
                      "pipeline_waits_seconds": round(waits, 4),
                      "data_parallel_exposed_seconds": round(reductions, 4),
                      "optimizer_seconds": round(optimizer, 4)}}


def vocab_parallel_copy(profile, t: int):
    """A copy of `profile` whose embedding and head layers take 1/t of their seconds (a diagnostic)."""
    layers = []
    for layer in profile.layers:
        if layer.kind in VOCAB_LAYER_KINDS:
            costs = [cost.model_copy(update={"forward_seconds": cost.forward_seconds / t,
                                             "backward_seconds": cost.backward_seconds / t}) for cost in layer.costs]
            layer = layer.model_copy(update={"costs": costs})
        layers.append(layer)
    return profile.model_copy(update={"layers": layers})


def row_profiles(row: dict, profile_cache: dict, calibration: RunsCalibration | None = None):
    """(pipectl's own profile, the run's engine's profile) of a row's shape on its device, derived
    once per shape: the pinned prediction reads the profile of the run as its engine ran it
    (`engine`), pipectl's own choice the profile of pipectl's runtime (no engine features), what
    `pipectl plan` would launch. With `calibration`, its device figures on its device (as
    `pipectl profile --derive --calibration` takes them)."""
    device = get_device(row["devices"]["kind"])
    if calibration is not None and calibration.device == device.name:
        device = calibration.terms.device_spec(device)
    config = model_config(row)
    sizes = micro_batch_sizes(row)
    engine = engine_features(row)
    key = (tuple(sorted((k, str(v)) for k, v in row["model"].items())), device.name, row["attention"], tuple(sizes))
    if key not in profile_cache:
        profile_cache[key] = derive_profile(config, device, sizes, attention=row["attention"])
    own_profile = profile_cache[key]
    engine_key = (key, engine.model_dump_json() if engine else None)
    if engine_key not in profile_cache:
        profile_cache[engine_key] = (derive_profile(config, device, sizes, attention=row["attention"], engine=engine)
                                     if engine else own_profile)
    return own_profile, profile_cache[engine_key]


def pinned_errors(workers: int | None = 1, calibration: RunsCalibration | None = None) -> dict:
    """Every row's pinned prediction against its published step, and their summary (the figures
    `benchmarks/measured_runs.py` reports beside the measured rows; pipectl's own choices, the slow
    part of this benchmark, left out). With `calibration`: its device's rows only, derived with its
    device figures (how a calibration fitted on other runs carries to these)."""
    cache: dict = {}
    rows, errors = [], []
    for row in yaml.safe_load(RUNS.read_text())["runs"]:
        seconds, _ = published_step(row)
        if not seconds or (calibration is not None and row["devices"]["kind"] != calibration.device):
            continue
        _, profile = row_profiles(row, cache, calibration)
        chosen, why, _ = pinned_plan(row, profile, cluster_of(row), workers)
        error = chosen.predicted_step_seconds / seconds - 1 if chosen else None
        if error is not None:
            errors.append(error)
        rows.append({"id": row["id"], "device": row["devices"]["kind"], "devices": row["devices"]["count"],
                     "published_step_seconds": round(seconds, 3),
                     "predicted_step_seconds": round(chosen.predicted_step_seconds, 3) if chosen else None,
                     "error": round(error, 4) if error is not None else None, "problem": why or None})
    summary = summarise(errors)
    return {"rows_file": str(RUNS.relative_to(ROOT)), "summary": {**summary, **targets_met(summary)}, "rows": rows}


def plan_row(row: dict, workers: int | None, profile_cache: dict) -> dict:
    config = model_config(row)
    sizes = micro_batch_sizes(row)
    engine = engine_features(row)
    started = time.perf_counter()
    own_profile, profile = row_profiles(row, profile_cache)
    derive_seconds = time.perf_counter() - started
    cluster = cluster_of(row)
    t = row["layout"]["t"]
    shard_degrees = {1, *(d for d in DEFAULT_SHARD_DEGREES if config.heads % d == 0)}
    out: dict[str, Any] = {
        "parameters_billion": round(profile.parameter_count / 1e9, 2),
        "profile_dtype": profile.dtype,
        "micro_batch_sizes_derived": sizes,
        "tensor_parallel_has_derived_shards": t in shard_degrees,
        "derive_seconds": round(derive_seconds, 3),
    }

    started = time.perf_counter()
    chosen, why, infeasible = pinned_plan(row, profile, cluster, workers)
    out["pinned_plan_seconds"] = round(time.perf_counter() - started, 3)
    out["pinned"] = candidate_summary(chosen) if chosen else None
    out["pinned_phases"] = phase_breakdown(chosen, profile, cluster) if chosen else None
    out["pinned_problem"] = why or None
    out["pinned_infeasible"] = infeasible
    # Diagnostics, not in the headline statistics: the time model alone. (a) The pinned request with
    # the memory check out of the way (the profile claims a device of UNBOUNDED_MEMORY bytes): the
    # step pipectl's time model gives the published layout, whatever its memory model says. (b) The same with the embedding and the
    # head split t ways, as Megatron splits them (VocabParallelEmbedding; a column-parallel head
    # with a vocab-parallel cross-entropy) where pipectl keeps both whole on every tensor rank:
    # their seconds divided by t in a copy of the profile.
    unbounded = profile.model_copy(update={"device_memory_bytes": UNBOUNDED_MEMORY})
    time_only, time_only_why, _ = pinned_plan(row, unbounded, cluster, workers)
    out["time_model_only"] = candidate_summary(time_only) if time_only else None
    out["time_model_only_problem"] = time_only_why or None
    out["time_model_only_vocab_parallel"] = None
    if t > 1 and not (engine and engine.vocab_parallel):
        split, _, _ = pinned_plan(row, vocab_parallel_copy(unbounded, t), cluster, workers)
        out["time_model_only_vocab_parallel"] = candidate_summary(split) if split else None

    started = time.perf_counter()
    try:
        own = plan(own_profile, cluster, PlanRequest(global_batch=row["global_batch"], devices=row["devices"]["count"],
                                                     morph=False, workers=workers)).chosen
        out["own"] = candidate_summary(own)
        out["own_problem"] = None
    except PipectlError as error:
        out["own"], out["own_problem"] = None, str(error)
    out["own_plan_seconds"] = round(time.perf_counter() - started, 3)

    # The layout pipectl would recommend to a user of the run's own engine: the same profile as the
    # pinned prediction (the engine's features) and what that engine runs: 1F1B, and Megatron's
    # interleaving where the pipeline transfers are not DeepSpeed's (`blocking_p2p`); no
    # recomputation or per-layer checkpointing (selective instead where the run used it); the
    # published ZeRO stage (Megatron's 2021 runs had no distributed optimizer). Against the pinned
    # layout this compares layouts only, engine for engine.
    out["own_on_engine"], out["own_on_engine_problem"] = None, None
    if engine is not None:
        started = time.perf_counter()
        schedules = ["1f1b"] if engine.blocking_p2p else ["1f1b", "interleaved"]
        recompute = RecomputeChoice.SELECTIVE if row.get("recompute") == "selective" else RecomputeChoice.LAYER
        try:
            chosen = plan(profile, cluster, PlanRequest(
                global_batch=row["global_batch"], devices=row["devices"]["count"], morph=False, workers=workers,
                engine="any", for_deepspeed=False, schedules=schedules, recompute=recompute,
                zero_stages=[row["layout"].get("zero_stage", 1)],
            )).chosen
            out["own_on_engine"] = candidate_summary(chosen)
        except PipectlError as error:
            out["own_on_engine_problem"] = str(error)
        out["own_on_engine_plan_seconds"] = round(time.perf_counter() - started, 3)
    return out


# ------------------------------------------------------------------------------------------------
# Report


def layout_text(layout: dict) -> str:
    parts = [f"t{layout['t']} p{layout['p']} d{layout['d']}"]
    if layout.get("v") and int(layout["v"]) > 1:
        parts.append(f"v{layout['v']}")
    parts.append(f"b{layout['micro_batch_size']}" if layout.get("micro_batch_size") else "b?")
    return " ".join(parts)


def candidate_text(c: dict | None) -> str:
    if not c:
        return "-"
    text = f"t{c['t']} p{c['p']} d{c['d']} b{c['b']}"
    if c["v"] > 1:
        text += f" v{c['v']}"
    text += f" {c['schedule']}{'+R' if c['recompute'] else '+ckpt' if c.get('checkpoint_layers') else ''} z{c['zero_stage']}"
    if c["devices"]:
        text += f" ({c['devices']})"
    return text


def seconds_text(seconds: float | None) -> str:
    return f"{seconds:.2f}s" if seconds else "-"


def percent_text(fraction: float | None) -> str:
    return f"{fraction:+.1%}" if fraction is not None else "-"


def summarise(errors: list[float]) -> dict:
    absolute = [abs(e) for e in errors]
    return {
        "rows": len(errors),
        "median_abs_error": round(statistics.median(absolute), 4) if absolute else None,
        "max_abs_error": round(max(absolute), 4) if absolute else None,
        "mean_signed_error": round(statistics.fmean(errors), 4) if errors else None,
        "within_10pct": sum(a <= 0.10 for a in absolute),
        "within_20pct": sum(a <= 0.20 for a in absolute),
    }


def targets_met(summary: dict) -> dict:
    """Whether `summarise`'s median and maximum absolute errors meet their targets."""
    return {
        "median_met": summary["median_abs_error"] is not None and summary["median_abs_error"] <= TARGET_MEDIAN,
        "max_met": summary["max_abs_error"] is not None and summary["max_abs_error"] <= TARGET_MAX,
    }


def on_engine_summary(results: list[dict]) -> dict:
    """How pipectl's layout on each run's own engine compares with the published one: how often it
    is the same (t, p, d, b), faster by more than 1 %, or deeper or more tensor-parallel."""
    pairs = [(r["pinned"], r["own_on_engine"], r["own_on_engine_gain_vs_pinned"]) for r in results
             if r.get("pinned") and r.get("own_on_engine")]
    same = [own for pinned, own, _ in pairs if all(own[k] == pinned[k] for k in ("t", "p", "d", "b"))]
    gains = [gain for _, _, gain in pairs if gain is not None]
    return {
        "rows": len(pairs),
        "same_t_p_d_b": len(same),
        "faster_by_more_than_1_percent": sum(1 for gain in gains if gain > 0.01),
        "median_gain": round(statistics.median(gains), 4) if gains else None,
        "max_gain": round(max(gains), 4) if gains else None,
        "deeper_pipeline": sum(1 for pinned, own, _ in pairs if own["p"] > pinned["p"]),
        "shallower_pipeline": sum(1 for pinned, own, _ in pairs if own["p"] < pinned["p"]),
        "more_tensor_parallel": sum(1 for pinned, own, _ in pairs if own["t"] > pinned["t"]),
        "less_tensor_parallel": sum(1 for pinned, own, _ in pairs if own["t"] < pinned["t"]),
    }


def git(*arguments: str) -> str | None:
    """A read-only git query's output, or None outside a repository."""
    try:
        return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True, check=True).stdout.rstrip("\n")
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated row ids")
    parser.add_argument("--workers", type=int, default=1, help="planner processes (default 1)")
    parser.add_argument("--no-write", action="store_true", help="do not update the results file")
    args = parser.parse_args()

    started_all = time.perf_counter()
    load_before = os.getloadavg()[0]
    document = yaml.safe_load(RUNS.read_text())
    rows = document["runs"]
    if args.only:
        wanted = set(args.only.split(","))
        rows = [row for row in rows if row["id"] in wanted]
    cache: dict = {}
    results = []
    header = (f"{'id':<20} {'dev':<9} {'GPUs':>5} {'published layout':<20} {'published':>9} {'pinned':>9} {'err':>7}   "
              f"{'pipectl own choice':<42} {'own':>8} {'vs pinned':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        seconds, how = published_step(row)
        figures = plan_row(row, args.workers, cache)
        pinned = figures["pinned"]
        own = figures["own"]
        error = (pinned["step_seconds"] - seconds) / seconds if pinned and seconds else None
        own_gain = (pinned["step_seconds"] - own["step_seconds"]) / pinned["step_seconds"] if pinned and own else None
        source = row["source"]
        record = {
            "id": row["id"],
            "name": row["name"],
            "source": source["url"],
            "source_reference": " ".join(source["reference"].split()),
            "evidence": source.get("evidence", []),
            "verified": source.get("verified"),
            "device": row["devices"]["kind"],
            "devices": row["devices"]["count"],
            "devices_per_node": row["devices"]["per_node"],
            "links_override": row["devices"].get("links"),
            "model": row["model"],
            "global_batch": row["global_batch"],
            "published_layout": row["layout"],
            "precision": row.get("precision"),
            "recompute": row.get("recompute"),
            "sequence_parallel": row.get("sequence_parallel"),
            "engine": row.get("engine"),
            "attention": row["attention"],
            "published": row.get("published"),
            "published_step_seconds": round(seconds, 3) if seconds else None,
            "published_step_from": how,
            "predicted_pinned_step_seconds": pinned["step_seconds"] if pinned else None,
            "error": round(error, 4) if error is not None else None,
            "own_choice_step_seconds": own["step_seconds"] if own else None,
            "own_choice_gain_vs_pinned": round(own_gain, 4) if own_gain is not None else None,
            "own_choice_vs_published": round((own["step_seconds"] - seconds) / seconds, 4) if own and seconds else None,
            "own_on_engine_gain_vs_pinned": (
                round((pinned["step_seconds"] - figures["own_on_engine"]["step_seconds"]) / pinned["step_seconds"], 4)
                if pinned and figures["own_on_engine"] else None),
            **figures,
        }
        for label in ("time_model_only", "time_model_only_vocab_parallel"):
            diagnostic = figures[label]
            record[f"{label}_error"] = (
                round((diagnostic["step_seconds"] - seconds) / seconds, 4) if diagnostic and seconds else None)
        results.append(record)
        print(f"{row['id']:<20} {row['devices']['kind']:<9} {row['devices']['count']:>5} {layout_text(row['layout']):<20} "
              f"{seconds_text(seconds):>9} {seconds_text(pinned and pinned['step_seconds']):>9} "
              f"{percent_text(error):>7}   {candidate_text(own):<42} "
              f"{seconds_text(own and own['step_seconds']):>8} {percent_text(None if own_gain is None else -own_gain):>9}",
              flush=True)
        if not pinned:
            print(f"    pinned layout not planned: {figures['pinned_problem']}")
        else:
            phases = figures["pinned_phases"]
            print(f"    pinned {candidate_text(pinned)}: busiest stage {phases['stage']}: forward {phases['forward_seconds']:.3f}s, "
                  f"backward {phases['backward_seconds']:.3f}s, waits {phases['pipeline_waits_seconds']:.3f}s, "
                  f"end of step {phases['end_of_step_seconds']:.3f}s")
            split = phases["split"]
            print(f"    split: compute {split['compute_seconds']:.3f}s, tensor-parallel {split['tensor_parallel_exposed_seconds']:.3f}s, "
                  f"pipeline waits {split['pipeline_waits_seconds']:.3f}s, data-parallel {split['data_parallel_exposed_seconds']:.3f}s, "
                  f"optimizer {split['optimizer_seconds']:.3f}s")
        on_engine = figures["own_on_engine"]
        if on_engine:
            gain = record["own_on_engine_gain_vs_pinned"]
            print(f"    own choice on the run's engine: {candidate_text(on_engine)} {seconds_text(on_engine['step_seconds'])}"
                  + (f" ({percent_text(-gain)} vs pinned)" if gain is not None else ""))
        notes = []
        for label, text in (("time_model_only", "memory check off"),
                            ("time_model_only_vocab_parallel", "and embedding/head split t ways")):
            diagnostic = figures[label]
            if diagnostic:
                notes.append(f"{text}: {candidate_text(diagnostic) if label == 'time_model_only' else ''}"
                             f"{' ' if label == 'time_model_only' else ''}{seconds_text(diagnostic['step_seconds'])} "
                             f"({percent_text(record[f'{label}_error'])})")
        if notes:
            print("    diagnostics: " + "; ".join(notes))

    compared = [r for r in results if r["error"] is not None]
    errors = [r["error"] for r in compared]
    by_device = {kind: summarise([r["error"] for r in compared if r["device"] == kind])
                 for kind in sorted({r["device"] for r in compared})}
    overall = summarise(errors)
    # Diagnostics: every row with a published step, the time model alone (memory check off), then
    # with the embedding and head split t ways (t = 1 rows keep their first figure).
    published_rows = [r for r in results if r["published_step_seconds"]]
    memory_off = [r["time_model_only_error"] for r in published_rows if r["time_model_only_error"] is not None]
    split = [r["time_model_only_vocab_parallel_error"] if r["time_model_only_vocab_parallel_error"] is not None
             else r["time_model_only_error"] for r in published_rows]
    diagnostics = {
        "time_model_only_memory_check_off": summarise(memory_off),
        "time_model_only_plus_embedding_and_head_split_t_ways": summarise([e for e in split if e is not None]),
    }
    runtime = time.perf_counter() - started_all
    summary = {
        **overall,
        "target": {"median_abs_error": TARGET_MEDIAN, "max_abs_error": TARGET_MAX,
                   "device_kinds": 3, "model_sizes": 3},
        **targets_met(overall),
        "device_kinds_compared": sorted(by_device),
        "model_sizes_compared_billion": sorted({r["parameters_billion"] for r in compared}),
        "by_device": by_device,
        "diagnostics_not_headline": diagnostics,
        "not_compared": [{"id": r["id"], "why": r["published_step_from"] if r["published_step_seconds"] is None
                          else r["pinned_problem"]} for r in results if r["error"] is None],
        "own_choice_faster_than_pinned": sum(1 for r in results if (r["own_choice_gain_vs_pinned"] or 0) > 0.005),
        "own_choice_slower_than_pinned": sum(1 for r in results if (r["own_choice_gain_vs_pinned"] or 0) < -0.005),
        "own_on_engine": on_engine_summary(results),
    }
    print()
    print(f"compared rows: {overall['rows']}; median |error| {overall['median_abs_error']:.1%} "
          f"(target {TARGET_MEDIAN:.0%}), max {overall['max_abs_error']:.1%} (target {TARGET_MAX:.0%}), "
          f"mean signed {overall['mean_signed_error']:+.1%}")
    for kind, figures in by_device.items():
        print(f"  {kind:<10} {figures['rows']:>2} rows: median {figures['median_abs_error']:.1%}, "
              f"max {figures['max_abs_error']:.1%}, mean signed {figures['mean_signed_error']:+.1%}")
    for label, figures in diagnostics.items():
        print(f"  diagnostic, {label.replace('_', ' ')}: {figures['rows']} rows, median {figures['median_abs_error']:.1%}, "
              f"max {figures['max_abs_error']:.1%}, mean signed {figures['mean_signed_error']:+.1%}")
    choices = summary["own_on_engine"]
    if choices["rows"]:
        print(f"  own choice on the run's engine: {choices['rows']} rows, the published t, p, d, b in {choices['same_t_p_d_b']}, "
              f"faster by > 1 % in {choices['faster_by_more_than_1_percent']} (median gain {choices['median_gain']:.1%}, "
              f"max {choices['max_gain']:.1%}); deeper pipeline in {choices['deeper_pipeline']}, shallower in "
              f"{choices['shallower_pipeline']}; more tensor-parallel in {choices['more_tensor_parallel']}, less in "
              f"{choices['less_tensor_parallel']}")
    print(f"runtime {runtime:.1f} s")

    catalog_bytes = CATALOG.read_bytes()
    payload = {
        "benchmark": "published large-scale training runs: pipectl's predicted step time with the published layout pinned, and its own choice",
        "rows_file": str(RUNS.relative_to(ROOT)),
        "summary": summary,
        "flops_formulas": document["flops_formulas"],
        "error_definition": "(predicted pinned step - published step) / published step",
        "own_choice_definition": (
            "pipectl plan with only the device count and global batch given (DeepSpeed-runnable schedules, "
            "ZeRO-1, micro-batch sizes 1, 2, 4, 8 plus the published one): gain = (pinned - own) / pinned "
            "of pipectl's two predictions"
        ),
        "own_on_engine_definition": (
            "pipectl plan on the pinned prediction's profile (the run's engine features), only the device count and "
            "global batch given, what the engine runs (1F1B, and interleaving unless its transfers are DeepSpeed's; "
            "no recomputation or per-layer checkpointing, selective where the run used it; the published ZeRO "
            "stage): gain = (pinned - own) / pinned, both priced on the same engine, so it compares the layouts alone"
        ),
        "constants_tuned": CONSTANTS_PROVENANCE,
        "catalog_sha256": hashlib.sha256(catalog_bytes).hexdigest(),
        "catalog_constants": {
            kind: {key: getattr(get_device(kind), key) for key in (
                "peak_tflops_bf16", "memory_bandwidth_gbytes_per_second", "multiprocessors", "gemm_efficiency",
                "attention_efficiency", "kernel_overhead_us", "intra_node_bandwidth_gbytes_per_second",
                "intra_node_allreduce_bandwidth_gbytes_per_second", "inter_node_bandwidth_gbytes_per_second")}
            for kind in sorted({r["device"] for r in results})
        },
        "rows": results,
        "runtime_seconds": round(runtime, 1),
        "workers": args.workers,
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/published_runs.py"
        + (f" --only {args.only}" if args.only else "") + (f" --workers {args.workers}" if args.workers != 1 else ""),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
        "load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        # Uncommitted changes under src/ that this run imported (the planner is read from the tree).
        "src_uncommitted": (git("status", "--porcelain", "--", "src") or "").splitlines(),
    }
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(RESULTS, payload)
        print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
