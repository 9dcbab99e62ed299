"""A plan layout as torchtitan's job config sections: `torchtitan.toml`, to merge into a train config.

    [parallelism]            degrees, schedule, micro-batch size, the cut as module names per stage
    [training]               local and global batch, sequence length, parameter precision
    [activation_checkpoint]  none, or full (per block)

The keys are those of `torchtitan/config/job_config.py` at the release `pipectl.emit.vendored`
pins. The cut is `module_fqns_per_model_part`: one list per virtual stage in stage order, with
torchtitan's decoder names (`tok_embeddings`, `layers.<i>`, `norm`, `output`: its Llama, Qwen and
DeepSeek models); torchtitan places the stages on ranks as pipectl does (a loop, or a V for
ZBVZeroBubble). Data parallelism replicates (DDP) or shards (FSDP) as
`plan.frameworks.torchtitan_data_parallel` maps pipectl's ZeRO stages.
"""

from __future__ import annotations

import json

from pipectl.artifacts.plan import Framework, Recompute
from pipectl.catalog import DTYPE_BYTES
from pipectl.emit.common import FP32_LOSS, Target, engine_differences, header, profile_is_pipectls
from pipectl.plan.frameworks import (
    BLOCK, EMBEDDING, FINAL_NORM, HEAD, REPLICATE, SHARD_ALWAYS, SHARD_NEVER, torchtitan_data_parallel,
)
from pipectl.schedule import ScheduleKind

FILE = "torchtitan.toml"

# pipectl's schedules as torch.distributed.pipelining names them (`get_schedule_class`).
SCHEDULE_NAMES = {
    ScheduleKind.ONE_F_ONE_B: "1F1B",
    ScheduleKind.GPIPE: "GPipe",
    ScheduleKind.INTERLEAVED: "Interleaved1F1B",
    ScheduleKind.ZBV: "ZBVZeroBubble",
}
PRECISIONS = {"bfloat16": "bfloat16", "float32": "float32"}  # torchtitan's mixed_precision_param


def torchtitan_files(target: Target) -> dict[str, str]:
    precision = PRECISIONS[target.profile.dtype]
    sections = config_sections(target, precision)
    body = "\n".join(
        f"[{section}]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in keys.items())
        for section, keys in sections.items()
    )
    comment = [
        "# Merge these sections into your torchtitan train config (or pass them as --section.key overrides);",
        f"# run it on {target.candidate.devices} GPUs: NGPU={target.ranks_per_node} per node on {target.nodes} "
        f"node{'s' if target.nodes != 1 else ''}.",
        "",
    ]
    return {FILE: header(target, Framework.TORCHTITAN, differences(target)) + "\n" + "\n".join(comment) + "\n" + body}


def config_sections(target: Target, precision: str) -> dict[str, dict[str, object]]:
    c = target.candidate
    strategy = torchtitan_data_parallel(c.zero_stage, c.tensor_parallel, c.pipeline_parallel) if c.data_parallel > 1 else None
    sharded = strategy in (SHARD_NEVER, SHARD_ALWAYS)
    parallelism: dict[str, object] = {
        "data_parallel_replicate_degree": c.data_parallel if strategy == REPLICATE else 1,
        "data_parallel_shard_degree": c.data_parallel if sharded else 1,
        "tensor_parallel_degree": c.tensor_parallel,
        "pipeline_parallel_degree": c.pipeline_parallel,
    }
    if sharded:  # reshard after the forward: ZeRO-3; keep the gathered parameters: ZeRO-2, and ZeRO-1 under a pipeline
        parallelism["fsdp_reshard_after_forward"] = "always" if strategy == SHARD_ALWAYS else "never"
    if c.pipeline_parallel > 1:
        parallelism["pipeline_parallel_schedule"] = SCHEDULE_NAMES[c.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = c.micro_batch_size
        parallelism["module_fqns_per_model_part"] = module_names(target)
    # With a pipeline a data-parallel rank's batch is split into m micro-batches of b; without one,
    # torchtitan accumulates global / (local x replicas) = m gradients of local = b samples.
    local = c.micro_batch_size * c.micro_batches if c.pipeline_parallel > 1 else c.micro_batch_size
    training: dict[str, object] = {
        "local_batch_size": local,
        "global_batch_size": target.plan.global_batch,
    }
    if target.profile.seq_len:
        training["seq_len"] = target.profile.seq_len
    training["mixed_precision_param"] = precision
    mode = "full" if c.recompute_granularity is Recompute.LAYER else "none"
    return {"parallelism": parallelism, "training": training, "activation_checkpoint": {"mode": mode}}


def module_names(target: Target) -> list[list[str]]:
    """torchtitan's module names of each virtual stage's layers."""
    kinds = [layer.kind for layer in target.profile.layers]
    names, block = [], 0
    for kind in kinds:
        if kind == BLOCK:
            names.append(f"layers.{block}")
            block += 1
        else:
            names.append({EMBEDDING: "tok_embeddings", FINAL_NORM: "norm", HEAD: "output"}[kind])
    return [names[start:end] for start, end in target.candidate.stage_layers]


def _toml(value: object) -> str:
    """A TOML value: strings, integers and lists of them are JSON's notation too."""
    return json.dumps(value)


# Engine features (`EngineFeatures`) torchtitan's Llama-family trainer does not have: no dropout,
# no gradient-accumulation fusion, eager element-wise kernels (torch.compile off, as its notes ask),
# no asynchronous tensor parallelism (off), no blocking pipeline transfers, no Megatron layer.
TORCHTITAN_LACKS = frozenset({"dropout", "gradient_accumulation_fusion", "fused_elementwise", "tensor_parallel_overlap",
                              "blocking_p2p", "megatron_deepspeed_layer"})


def differences(target: Target) -> list[str]:
    c, profile = target.candidate, target.profile
    unpriced = []
    if c.tensor_parallel > 1:
        unpriced += ["sequence and loss parallelism, which torchtitan's tensor parallelism always has: less memory"]
    notes = engine_differences(profile, unpriced, "torchtitan", TORCHTITAN_LACKS)
    if c.pipeline_parallel > 1 and c.data_parallel > 1 and c.tensor_parallel < target.origin.devices_per_node:
        notes.append(
            "torchtitan numbers ranks pipeline-outermost (a node holds replicas of one stage); pipectl priced a "
            "replica's stages on consecutive ranks (pipeline transfers inside a node, all-reduces across nodes)"
        )
    if c.data_parallel > 1 and c.zero_stage == 1:
        notes.append("FSDP under a pipeline is priced as ZeRO-1 (the same bytes): it gathers a stage's parameters at "
                     "its first forward, where ZeRO-1 gathers them after the optimizer step")
    # Both below double a 16-bit plan's bytes; an fp32 plan already priced 4 bytes an element.
    sixteen_bit = DTYPE_BYTES.get(profile.dtype, 4) == 2
    if c.data_parallel > 1 and c.zero_stage >= 1 and sixteen_bit:
        notes.append("FSDP reduce-scatters gradients in fp32 (training.mixed_precision_reduce): twice the bytes priced")
    if c.data_parallel > 1 and c.zero_stage == 0 and sixteen_bit:
        notes.append("DDP trains under autocast with fp32 parameters: their memory and the all-reduce's bytes are "
                     "twice what was priced")
    config = target.model
    if config is None or not (config.norm == "rms" and config.rotary and config.activation == "swiglu"):
        notes.append(f"model '{target.plan.model}' is none of torchtitan's decoders (RMSNorm, rotary positions, "
                     "SwiGLU: Llama, Qwen, DeepSeek): the cut is written in their module names")
    if profile_is_pipectls(target):
        notes.append("not priced: " + FP32_LOSS.format(who="the logits upcast whole"))
    notes.append("torch.compile, Float8 and async tensor parallelism are not priced; leave them off to train as priced")
    return notes
