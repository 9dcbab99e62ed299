"""What another training framework can express of a plan, as the planner's search space.

`plan --emit FRAMEWORK` plans for a framework the user already runs; the search then visits only
the layouts that framework can be told to run (`plan.space.search_space` reads `FrameworkSpace`),
so the chosen layout and every row of the morph table can be written as its arguments
(`pipectl.emit`). What each one expresses, read from its source at the release
`pipectl.emit.vendored` pins:

| framework | schedules | recomputation | ZeRO | cut | replicas |
|---|---|---|---|---|---|
| megatron | 1f1b; interleaved (virtual stages) | none; layer (`--recompute-granularity full`); selective (`core_attn`) | 0; 1 (`--use-distributed-optimizer`) | any contiguous cut (`--pipeline-model-parallel-layout`), the final norm on the loss's stage | even |
| torchtitan | 1f1b, gpipe, interleaved, zbv | none; layer (`activation_checkpoint.mode = "full"`) | as `torchtitan_data_parallel` says | any contiguous cut (`module_fqns_per_model_part`) | even |
| deepspeed | 1f1b (`TrainSchedule`, the only one its pipeline engine runs) | none; layer (`activation_checkpoint_interval=1`) | 0, 1 (its pipeline engine refuses 2 and 3) | any contiguous cut (`parts`) | even |

Not expressible anywhere but in pipectl's runtime: Varuna's whole-stage recomputation, uneven
replicas (VirtualFlow's ⌈B/(d b)⌉ and ⌊B/(d b)⌋ micro-batches), PipeDream-2BW. torchtitan has no
one-chunk zero-bubble schedule and its selective checkpointing keeps attention (per-op policy),
unlike the attention-core recomputation pipectl prices (Korthikanti et al. 2022, §5), which
Megatron runs. torchtitan replicates (DDP) only when data parallelism is its one dimension, and
otherwise shards (FSDP), as `torchtitan_data_parallel` maps them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipectl.artifacts.plan import Candidate, Engine, Framework, PlanRequest, Recompute
from pipectl.artifacts.profile import ModelProfile
from pipectl.errors import UserInputError
from pipectl.schedule import ScheduleKind

# The layer kinds of a decoder in the order Megatron's GPTModel and torchtitan's models hold them:
# the embedding, the blocks, the final norm and the output layer (`models.registry`, `models.hf`).
EMBEDDING, BLOCK, FINAL_NORM, HEAD = "embedding", "transformer_block", "layer_norm", "lm_head"


@dataclass(frozen=True)
class FrameworkSpace:
    """The layouts one framework can be told to run."""

    framework: Framework
    title: str  # how the framework is named in sentences
    schedules: tuple[ScheduleKind, ...]
    # Searched when --schedules lists none: the schedules, less those priced by a slow direct walk
    # at scale (zbv, as for `plan --engine any`: `plan.space.DEEPSPEED_FREE_SCHEDULES`).
    default_schedules: tuple[ScheduleKind, ...]
    recompute: tuple[Recompute, ...]
    zero_stages: tuple[int, ...]
    default_zero_stages: tuple[int, ...]  # searched when --zero-stages is not given
    # The model must be an embedding, blocks, a final norm and a head (its layers are named by kind).
    decoder_only: bool
    # The final norm sits on the stage of the head (Megatron builds it with the loss, `L`).
    norm_with_head: bool


SPACES = {
    Framework.MEGATRON: FrameworkSpace(
        Framework.MEGATRON, "Megatron-LM",
        schedules=(ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED),
        default_schedules=(ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED),
        recompute=(Recompute.NONE, Recompute.LAYER, Recompute.SELECTIVE),
        zero_stages=(0, 1), default_zero_stages=(1,), decoder_only=True, norm_with_head=True,
    ),
    Framework.TORCHTITAN: FrameworkSpace(
        Framework.TORCHTITAN, "torchtitan",
        schedules=(ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE, ScheduleKind.INTERLEAVED, ScheduleKind.ZBV),
        default_schedules=(ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE, ScheduleKind.INTERLEAVED),
        recompute=(Recompute.NONE, Recompute.LAYER),
        zero_stages=(0, 1, 2, 3), default_zero_stages=(0, 1, 2, 3), decoder_only=True, norm_with_head=False,
    ),
    Framework.DEEPSPEED: FrameworkSpace(
        Framework.DEEPSPEED, "DeepSpeed's PipelineModule",
        schedules=(ScheduleKind.ONE_F_ONE_B,),
        default_schedules=(ScheduleKind.ONE_F_ONE_B,),
        recompute=(Recompute.NONE, Recompute.LAYER),
        zero_stages=(0, 1), default_zero_stages=(1,), decoder_only=False, norm_with_head=False,
    ),
}

# Why a layout feature is outside a framework, in the words a refusal uses.
_SCHEDULE_WORDS = {
    ScheduleKind.GPIPE: "the GPipe schedule",
    ScheduleKind.VARUNA: "Varuna's schedule (whole-stage recomputation)",
    ScheduleKind.PIPEDREAM_2BW: "PipeDream-2BW (two weight versions)",
    ScheduleKind.ZB_H1: "the one-chunk zero-bubble schedule (zb-h1)",
    ScheduleKind.ZBV: "the ZB-V schedule",
    ScheduleKind.INTERLEAVED: "the interleaved schedule",
}
_RECOMPUTE_WORDS = {
    Recompute.STAGE: "whole-stage recomputation",
    Recompute.LAYER: "per-layer activation checkpointing",
    Recompute.SELECTIVE: "selective recomputation of the attention core",
}


def space_of(framework: Framework) -> FrameworkSpace:
    return SPACES[framework]


# torchtitan's data parallelism (`parallelize_llama` at the pinned release): DDP only as the one
# dimension ("DDP has not supported > 1D parallelism"), else FSDP. Under a pipeline, torch's
# pipelining stage gathers a stage's parameters at its first forward, keeps them to its last
# backward and reduce-scatters the accumulated gradients there (`reshard_after_forward` off, its
# default with a pipeline): ZeRO-1's bytes and memory (sharded optimizer state, whole parameters
# and gradients during the step), not ZeRO-2/3's, which pipectl prices at one stage only. At one
# stage FSDP reduce-scatters after every micro-batch: ZeRO-3 resharding after the forward, ZeRO-2
# keeping the parameters.
REPLICATE, SHARD_NEVER, SHARD_ALWAYS = "replicate", "shard, reshard never", "shard, reshard always"


def torchtitan_data_parallel(zero_stage: int, tensor_parallel: int, pipeline_parallel: int) -> str | None:
    """How torchtitan runs data parallelism at ZeRO stage `zero_stage` with these degrees (d > 1):
    REPLICATE, SHARD_NEVER or SHARD_ALWAYS; None where it cannot.

    >>> torchtitan_data_parallel(0, 1, 1), torchtitan_data_parallel(0, 2, 1), torchtitan_data_parallel(1, 4, 8)
    ('replicate', None, 'shard, reshard never')
    >>> torchtitan_data_parallel(1, 1, 1), torchtitan_data_parallel(3, 8, 1), torchtitan_data_parallel(2, 1, 4)
    (None, 'shard, reshard always', None)
    """
    one_stage = pipeline_parallel == 1
    return {
        0: REPLICATE if one_stage and tensor_parallel == 1 else None,
        1: None if one_stage else SHARD_NEVER,
        2: SHARD_NEVER if one_stage else None,
        3: SHARD_ALWAYS if one_stage else None,
    }.get(zero_stage)


def zero_stages_run(framework: Framework, t: int, p: int, d: int, zeros: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The ZeRO stages of `zeros` that `framework` runs at (t, p, d) in `dtype`: every one for
    Megatron and DeepSpeed; torchtitan's by `torchtitan_data_parallel` where d > 1, and without
    data parallelism none in 16 bits beside a tensor or pipeline split (its mixed precision is
    FSDP's or autocast's, and it turns autocast off for tensor and pipeline parallelism:
    `maybe_enable_amp`), so such a layout would train in fp32, not as priced."""
    if framework is not Framework.TORCHTITAN:
        return zeros
    if d == 1:
        return () if (t > 1 or p > 1) and dtype != "float32" else zeros
    return tuple(zero for zero in zeros if torchtitan_data_parallel(zero, t, p) is not None)


def framework_request(request: PlanRequest, framework: Framework, *, zero_stages_given: bool = True) -> PlanRequest:
    """`request` for `framework`: even replicas, engine any, its default schedules when none are
    listed, and the ZeRO stages asked for, or when none were given its default ones (pipectl's
    ZeRO-1, or for torchtitan whichever of DDP and FSDP fits each degree). The search keeps to the
    framework's layouts (`plan.space.search_space`); what it cannot express at all is refused by
    `check_framework_request`."""
    space = space_of(framework)
    return request.model_copy(update={
        "framework": framework,
        "engine": Engine.ANY,
        "for_deepspeed": False,
        "uneven_replicas": False,
        "zero_stages": request.zero_stages if zero_stages_given else list(space.default_zero_stages),
        "schedules": request.schedules or list(space.default_schedules),
    })


def check_framework_request(request: PlanRequest, profile: ModelProfile) -> None:
    """Refuse, naming the value, what the request pins that its framework cannot run, and a model
    the framework cannot hold."""
    if request.framework is None:
        return
    space = space_of(request.framework)
    pinned = request.schedule
    if pinned is not None and pinned not in space.schedules:
        raise UserInputError(
            f"{space.title} cannot run {_SCHEDULE_WORDS.get(pinned, pinned.value)} (--schedule {pinned.value})",
            hint=f"its schedules: {', '.join(kind.value for kind in space.schedules)}",
        )
    if request.schedules and not any(kind in space.schedules for kind in request.schedules):
        listed = ",".join(kind.value for kind in request.schedules)
        raise UserInputError(
            f"{space.title} runs none of --schedules {listed}",
            hint=f"its schedules: {', '.join(kind.value for kind in space.schedules)}",
        )
    if not any(zero in space.zero_stages for zero in request.zero_stages):
        raise UserInputError(
            f"{space.title} runs none of --zero-stages {','.join(map(str, request.zero_stages))}",
            hint=f"its ZeRO stages: {', '.join(map(str, space.zero_stages))}",
        )
    # Asked for some recomputation (not only none): the framework has at least one of those kinds.
    kinds = [g for g in request.recompute_granularities if g is not Recompute.NONE]
    if kinds and not any(granularity in space.recompute for granularity in kinds):
        asked = ", ".join(_RECOMPUTE_WORDS.get(g, g.label) for g in kinds)
        raise UserInputError(
            f"{space.title} has none of the recomputation asked for ({asked}) (--recompute {request.recompute.value})",
            hint=f"its recomputation: {', '.join(g.label for g in space.recompute)}",
        )
    if framework_lacks_dtype(request.framework, profile.dtype):
        raise UserInputError(
            f"{space.title} trains in bfloat16 or float32; the profile is {profile.dtype}",
            hint="profile (or derive) the model in bfloat16",
        )
    if space.decoder_only:
        kinds = [layer.kind for layer in profile.layers]
        if not _is_decoder(kinds):
            odd = next((kind for kind in kinds if kind not in (EMBEDDING, BLOCK, FINAL_NORM, HEAD)), None)
            what = f"a layer of kind '{odd}'" if odd else "its layers in another order"
            raise UserInputError(
                f"{space.title} holds a decoder as an embedding, transformer blocks, a final norm and a head; "
                f"model '{profile.model}' has {what}",
                hint="emit for deepspeed (a PipelineModule of your own layers), or plan for pipectl's runtime",
            )


def framework_lacks_dtype(framework: Framework, dtype: str) -> bool:
    """torchtitan's parameters train in bfloat16 or float32 (`training.mixed_precision_param`)."""
    return framework is Framework.TORCHTITAN and dtype not in ("bfloat16", "float32")


def _is_decoder(kinds: list[str]) -> bool:
    return (
        len(kinds) >= 4 and kinds[0] == EMBEDDING and kinds[-2:] == [FINAL_NORM, HEAD]
        and all(kind == BLOCK for kind in kinds[1:-2])
    )


def recompute_offered(framework: Framework | None, granularities: tuple[Recompute, ...]) -> tuple[Recompute, ...]:
    """The granularities a search for `framework` tries of those asked for."""
    if framework is None:
        return granularities
    return tuple(g for g in granularities if g in space_of(framework).recompute)


def kept_together(framework: Framework | None, profile: ModelProfile) -> tuple[int, ...]:
    """Layer indices that must share a stage with the layer after them (`joined_cuts`): Megatron's
    final norm, which it builds on the stage of the loss."""
    if framework is None or not space_of(framework).norm_with_head:
        return ()
    kinds = [layer.kind for layer in profile.layers]
    return tuple(i for i in range(len(kinds) - 1) if kinds[i] == FINAL_NORM and kinds[i + 1] == HEAD)


def joined_cuts(cuts: tuple[tuple[int, int], ...], kept: tuple[int, ...]) -> tuple[tuple[int, int], ...] | None:
    """`cuts` with no boundary just after a layer of `kept`: that boundary moves one layer earlier,
    and a stage it leaves empty pushes the boundaries before it earlier too. None where no cut of
    this many stages keeps them together (fewer layers than stages then).

        >>> joined_cuts(((0, 3), (3, 8), (8, 9)), kept=(7,))
        ((0, 3), (3, 7), (7, 9))
        >>> joined_cuts(((0, 6), (6, 7), (7, 8), (8, 9)), kept=(7,))
        ((0, 5), (5, 6), (6, 7), (7, 9))
        >>> joined_cuts(((0, 1), (1, 2)), kept=(0,)) is None
        True
    """
    if not kept:
        return cuts
    bounds = [start for start, _ in cuts[1:]]
    moved = False
    for i in range(len(bounds) - 1, -1, -1):
        limit = bounds[i + 1] - 1 if i + 1 < len(bounds) else cuts[-1][1] - 1
        bound = min(bounds[i], limit)
        while bound - 1 in kept:
            bound -= 1
        if bound != bounds[i]:
            bounds[i], moved = bound, True
    if not moved:
        return cuts
    if bounds and bounds[0] < 1:
        return None
    edges = [0, *bounds, cuts[-1][1]]
    return tuple(zip(edges[:-1], edges[1:]))


def not_expressible(candidate: Candidate, framework: Framework, profile: ModelProfile) -> str | None:
    """Why `framework` cannot run `candidate` of a model with `profile`, in words; None when it can."""
    space, c = space_of(framework), candidate
    if space.decoder_only and not _is_decoder([layer.kind for layer in profile.layers]):
        return f"model '{profile.model}', which is not an embedding, transformer blocks, a final norm and a head"
    if framework_lacks_dtype(framework, profile.dtype):
        return f"training in {profile.dtype}"
    if c.device == "mixed" or len(set(c.replica_kinds)) > 1:
        return "replicas on different device kinds"
    if c.replicas:
        return "uneven replicas (some run one micro-batch more than others)"
    if c.schedule not in space.schedules:
        return _SCHEDULE_WORDS.get(c.schedule, c.schedule.value)
    granularity = c.recompute_granularity
    if granularity not in space.recompute:
        return _RECOMPUTE_WORDS.get(granularity, granularity.label)
    runs = zero_stages_run(framework, c.tensor_parallel, c.pipeline_parallel, c.data_parallel, space.zero_stages,
                           profile.dtype)
    if c.zero_stage not in runs:
        where = f"t = {c.tensor_parallel}, p = {c.pipeline_parallel}, d = {c.data_parallel}"
        return f"{profile.dtype} training at {where}" if not runs else f"ZeRO-{c.zero_stage} at {where}"
    if space.norm_with_head:
        cuts = tuple((int(a), int(b)) for a, b in c.stage_layers)
        if joined_cuts(cuts, kept_together(framework, profile)) != cuts:
            return "a cut between the final norm and the head"
    return None
