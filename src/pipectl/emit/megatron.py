"""A plan layout as Megatron-LM's command-line arguments: `megatron-args.sh`, a file to source.

    source megatron-args.sh
    torchrun ... pretrain_gpt.py "${PIPECTL_MEGATRON_ARGS[@]}" <data, tokenizer, optimizer arguments>

The names are those of Megatron-LM's `megatron/training/arguments.py` at the release
`pipectl.emit.vendored` pins. The cut, in the order Megatron reads it:

- the blocks split evenly, the embedding on the first stage and the final norm and loss on the last
  (Megatron's default): nothing more, or `--num-layers-per-virtual-pipeline-stage` when interleaved;
- one chunk per rank, middle stages equal: `--decoder-first-pipeline-num-layers` and
  `--decoder-last-pipeline-num-layers`;
- any other cut: `--pipeline-model-parallel-layout`, one `|`-separated entry per virtual stage in
  stage order (virtual stage s on rank s mod p), `E` the embedding, `t` a block, `L` the final norm
  and the loss (Megatron builds the norm with the loss, `plan.frameworks.kept_together`).

Ranks are numbered tensor first, then pipeline, then data (`--use-tp-pp-dp-mapping`): the placement
pipectl prices (a replica's stages on consecutive ranks), not Megatron's default tp-dp-pp.
"""

from __future__ import annotations

import shlex

from pipectl.artifacts.plan import Framework, Recompute
from pipectl.emit.common import FP32_LOSS, Target, engine_differences, header, profile_is_pipectls
from pipectl.plan.frameworks import BLOCK, EMBEDDING, HEAD

FILE = "megatron-args.sh"


def megatron_files(target: Target) -> dict[str, str]:
    model, parallel = model_arguments(target), parallel_arguments(target)
    c = target.candidate
    lines = [
        # Sourced, never run: no shebang. The directives tell shellcheck its shell, and that the
        # variables it sets are for the script that sources it (SC2034, "appears unused").
        "# shellcheck shell=bash disable=SC2034",
        header(target, Framework.MEGATRON, differences(target)),
        "# Source this file in a Megatron-LM launch script, then pass the array to pretrain_gpt.py:",
        '#   torchrun --nnodes "$PIPECTL_NODES" --nproc-per-node "$PIPECTL_GPUS_PER_NODE" ... pretrain_gpt.py \\',
        '#       "${PIPECTL_MEGATRON_ARGS[@]}" <your data, tokenizer, optimizer and checkpoint arguments>',
        *(["export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's validate_args asks it of tensor parallelism (before Blackwell)"]
          if c.tensor_parallel > 1 else []),
        f"PIPECTL_WORLD_SIZE={c.devices}",
        f"PIPECTL_NODES={target.nodes}",
        f"PIPECTL_GPUS_PER_NODE={target.ranks_per_node}",
        _array("PIPECTL_MODEL_ARGS", model),
        _array("PIPECTL_PARALLEL_ARGS", parallel),
        'PIPECTL_MEGATRON_ARGS=("${PIPECTL_MODEL_ARGS[@]}" "${PIPECTL_PARALLEL_ARGS[@]}")',
    ]
    return {FILE: "\n".join(lines) + "\n"}


def _array(name: str, arguments: list[list[str]]) -> str:
    body = "".join(f"    {' '.join(shlex.quote(word) for word in group)}\n" for group in arguments)
    return f"{name}=(\n{body})"


def blocks_of(target: Target) -> list[int]:
    """Blocks per (virtual) stage, in stage order."""
    kinds = [layer.kind for layer in target.profile.layers]
    return [sum(1 for kind in kinds[start:end] if kind == BLOCK) for start, end in target.candidate.stage_layers]


def model_arguments(target: Target) -> list[list[str]]:
    """The model's shape as Megatron names it: what the plan's memory and time assume."""
    profile, config = target.profile, target.model
    blocks = sum(1 for layer in profile.layers if layer.kind == BLOCK)
    arguments = [["--num-layers", str(blocks)]]
    if profile.hidden:
        arguments.append(["--hidden-size", str(profile.hidden)])
    if config is not None:
        arguments.append(["--num-attention-heads", str(config.heads)])
        if config.kv_heads is not None and config.kv_heads != config.heads:
            arguments.append(["--group-query-attention", "--num-query-groups", str(config.kv_heads)])
        arguments.append(["--ffn-hidden-size", str(config.ffn_hidden or config.ffn_multiplier * config.hidden)])
        if config.activation == "swiglu":
            arguments.append(["--swiglu"])
        if config.norm == "rms":
            arguments.append(["--normalization", "RMSNorm"])
        if config.rotary:
            arguments.append(["--position-embedding-type", "rope"])
        if not config.linear_bias:
            arguments.append(["--disable-bias-linear"])
        if not config.tied_embeddings:
            arguments.append(["--untie-embeddings-and-output-weights"])
    if profile.seq_len:
        arguments.append(["--seq-length", str(profile.seq_len), "--max-position-embeddings", str(profile.seq_len)])
    return arguments


def parallel_arguments(target: Target) -> list[list[str]]:
    c, profile = target.candidate, target.profile
    arguments = [["--tensor-model-parallel-size", str(c.tensor_parallel)]]
    if c.tensor_parallel > 1:
        arguments.append(["--sequence-parallel"])
    arguments.append(["--pipeline-model-parallel-size", str(c.pipeline_parallel)])
    if c.pipeline_parallel > 1:
        arguments += cut_arguments(target)
        if c.data_parallel > 1:
            arguments.append(["--use-tp-pp-dp-mapping"])
    arguments.append(["--micro-batch-size", str(c.micro_batch_size), "--global-batch-size", str(target.plan.global_batch)])
    granularity = c.recompute_granularity
    if granularity is Recompute.LAYER:
        arguments.append(["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    elif granularity is Recompute.SELECTIVE:
        arguments.append(["--recompute-granularity", "selective", "--recompute-modules", "core_attn"])
    if c.zero_stage == 1 and c.data_parallel > 1:
        arguments.append(["--use-distributed-optimizer"])
    arguments += overlap_arguments(target)
    precision = {"bfloat16": "--bf16", "float16": "--fp16"}.get(profile.dtype)
    if precision:
        arguments.append([precision])
    return arguments


def overlap_arguments(target: Target) -> list[list[str]]:
    """The overlaps a profile derived with Megatron's features priced, turned on: each is off by
    default (store_true in megatron/training/arguments.py), and the step would be longer without."""
    c, features = target.candidate, target.profile.engine
    if features is None:
        return []
    arguments = []
    # (priced inside a node only: `plan.costs` gives a tensor group across nodes no overlap)
    if features.tensor_parallel_overlap and 1 < c.tensor_parallel <= target.origin.devices_per_node:
        arguments.append(["--tp-comm-overlap"])
    if features.gradient_reduce_overlap and c.data_parallel > 1:
        arguments.append(["--overlap-grad-reduce"])
        # Megatron takes the gather's overlap only with the reduce's, and so does the pricing.
        if features.parameter_gather_overlap and c.zero_stage == 1:
            arguments.append(["--overlap-param-gather"])
    return arguments


def cut_arguments(target: Target) -> list[list[str]]:
    """The cut (see the module docstring): Megatron's even split, first and last stages, or a layout."""
    c = target.candidate
    blocks = blocks_of(target)
    total, stages = sum(blocks), len(blocks)
    if _is_megatron_default(target, blocks):
        if c.chunks > 1:
            return [["--num-layers-per-virtual-pipeline-stage", str(total // stages)]]
        return []
    if c.chunks == 1 and _holds_ends_only(target) and len(set(blocks[1:-1])) <= 1:
        return [["--decoder-first-pipeline-num-layers", str(blocks[0]),
                 "--decoder-last-pipeline-num-layers", str(blocks[-1])]]
    return [["--pipeline-model-parallel-layout", layout_string(target)]]


def _holds_ends_only(target: Target) -> bool:
    """Whether the embedding is on the first stage and the head on the last, each with a block."""
    kinds = [layer.kind for layer in target.profile.layers]
    (first_start, first_end), (last_start, last_end) = target.candidate.stage_layers[0], target.candidate.stage_layers[-1]
    return BLOCK in kinds[first_start:first_end] and BLOCK in kinds[last_start:last_end]


def _is_megatron_default(target: Target, blocks: list[int]) -> bool:
    total, stages = sum(blocks), len(blocks)
    return total % stages == 0 and set(blocks) == {total // stages} and _holds_ends_only(target)


def stage_letters(target: Target) -> list[str]:
    """Each virtual stage as Megatron's layout letters: 'E' + 't' per block, 'L' for the final norm
    and the head (a stage with the norm always holds the head: `plan.frameworks.joined_cuts`)."""
    kinds = [layer.kind for layer in target.profile.layers]
    stages = []
    for start, end in target.candidate.stage_layers:
        letters = "".join({EMBEDDING: "E", BLOCK: "t", HEAD: "L"}.get(kind, "") for kind in kinds[start:end])
        stages.append(letters)
    return stages


def layout_string(target: Target) -> str:
    """`--pipeline-model-parallel-layout`: the stages joined by '|', a run of equal stages written
    '(S|)*k' and a run of one letter 'x*n' (Megatron unrolls both, `parse_str_to_list`).

    A final run keeps its last stage outside the group: '(S|)*k' ends in '|', an empty stage."""
    stages = [_letters(stage) for stage in stage_letters(target)]
    runs: list[tuple[str, int]] = []
    for stage in stages:
        if runs and runs[-1][0] == stage:
            runs[-1] = (stage, runs[-1][1] + 1)
        else:
            runs.append((stage, 1))
    pieces = []
    for index, (stage, repeat) in enumerate(runs):
        last = index == len(runs) - 1
        if repeat == 1:
            pieces.append(stage if last else f"{stage}|")
        elif last:
            pieces.append(f"({stage}|)*{repeat - 1}{stage}" if repeat > 2 else f"{stage}|{stage}")
        else:
            pieces.append(f"({stage}|)*{repeat}")
    return "".join(pieces)


def _letters(stage: str) -> str:
    """'Ettt' -> 'Et*3' (only a run of t is shortened: E and L appear once)."""
    blocks = stage.count("t")
    body = "t" if blocks == 1 else f"t*{blocks}" if blocks else ""
    return ("E" if stage.startswith("E") else "") + body + ("L" if stage.endswith("L") else "")


# Engine features (`EngineFeatures`) Megatron-LM's own training loop does not have: DeepSpeed's
# blocking pipeline transfers and Megatron-DeepSpeed's layer.
MEGATRON_LACKS = frozenset({"blocking_p2p", "megatron_deepspeed_layer"})


def differences(target: Target) -> list[str]:
    c, profile = target.candidate, target.profile
    unpriced = ["fused kernels (Transformer Engine or Apex where installed): a shorter step"]
    if c.tensor_parallel > 1:
        unpriced += ["sequence parallelism: norms and dropouts keep 1/t of their activations, less memory",
                     "the vocabulary-parallel embedding and head: 1/t of their time and memory per tensor rank"]
    notes = engine_differences(profile, unpriced, "Megatron-LM", MEGATRON_LACKS)
    if profile_is_pipectls(target):  # a profile derived with an engine's features prices an fp32 loss
        notes.append("not priced: " + FP32_LOSS.format(who="vocabulary-parallel, keeping its softmax"))
    features = profile.engine
    if profile.dtype == "bfloat16" and c.data_parallel > 1 and not (features and features.gradients_reduced_in_fp32):
        notes.append("with --bf16 Megatron reduces gradients in fp32: twice the data-parallel bytes priced")
    if not (features and features.dropout):
        notes.append("Megatron's attention and hidden dropout (0.1 each unless set to 0) is not priced")
    if c.zero_stage == 1 and c.data_parallel > 1:
        notes.append("--use-distributed-optimizer is priced as ZeRO-1: optimizer state split over the replicas")
    if target.model is None:
        notes.append(f"model '{target.plan.model}' is not a shipped name or YAML: add its attention heads and MLP "
                     "width to PIPECTL_MODEL_ARGS")
    return notes
