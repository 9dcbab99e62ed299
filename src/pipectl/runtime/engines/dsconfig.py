"""A plan candidate -> the DeepSpeed config, validated by DeepSpeed's own parser before anything starts.

The batch arithmetic is the virtual-node mapping (VirtualFlow, Or et al., MLSys 2022; docs/design.md, 'The global batch'): every data-parallel
replica runs m micro-batches of b samples and accumulates their gradients, so

    train_batch_size                = B = b * m * d
    train_micro_batch_size_per_gpu  = b
    gradient_accumulation_steps     = m          (DeepSpeed's pipeline engine: one step = m micro-batches)

    >>> from pipectl.runtime.engines.dsconfig import batch_section
    >>> batch_section(micro_batch_size=2, micro_batches=4, data_parallel=2)
    {'train_batch_size': 16, 'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 4}

Choices and why:
- The plan's ZeRO stage, which must be 1, or 2 or 3 for a one-stage plan without a tensor split
  (`runtime_runs_zero`; DeepSpeed's ordinary engine runs them, `runtime/engines/plain.py`): pipectl's
  checkpoints read and write the fp32 partitions of DeepSpeed's ZeRO-1/2 and ZeRO-3 optimizers
  (`engine_state`), and DeepSpeed's pipeline engine rejects 2 and 3. The planner labels d = 1 candidates ZeRO-1 (they
  shard nothing; ZeRO-1 gave bit-identical losses to ZeRO-0 there, shared/DEEPSPEED-ON-CPU.md) and
  marks any other stage as not runnable, so a plan and its run never differ silently.
- `"torch_adam": true`: otherwise DeepSpeed JIT-compiles its fused Adam before the first step (minutes on
  a CPU host); the losses are identical.
- `pipeline.stages`/`partition` are written for the record, but DeepSpeed ignores them (a 2-stage
  module passes with `stages: 4`), so they are checked here against the plan and the runtime passes
  the cut to the PipelineModule itself.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

from pydantic import ValidationError

from pipectl.artifacts.plan import Candidate, Engine, Plan, runtime_runs_zero
from pipectl.artifacts.run import LrSchedule, Precision, TrainingSettings
from pipectl.errors import UserInputError
from pipectl.io import error_words
from pipectl.runtime.engines.dsinit import choose_accelerator
from pipectl.schedule import ScheduleKind, deepspeed_runnable, torch_runnable

# Print DeepSpeed's own step log practically never: pipectl writes metrics.jsonl instead.
STEPS_PER_PRINT = 1_000_000_000


class DeepSpeedConfigRejected(UserInputError):
    """DeepSpeed's parser (or pipectl's checks of what DeepSpeed ignores) refused the config."""


def batch_section(*, micro_batch_size: int, micro_batches: int, data_parallel: int) -> dict[str, int]:
    """The three batch keys DeepSpeed cross-checks (train = micro x accumulation x data-parallel)."""
    return {
        "train_batch_size": micro_batch_size * micro_batches * data_parallel,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
    }


def stage_partition(stage_layers: list[tuple[int, int]]) -> list[int]:
    """Half-open stage ranges -> DeepSpeed's `parts` boundaries: [(0,3),(3,9)] -> [0, 3, 9]."""
    return [start for start, _ in stage_layers] + [stage_layers[-1][1]]


# fp16 with dynamic loss scaling (DeepSpeed's config keys): loss_scale 0 = dynamic, starting at
# 2**16, halved on an overflow (after `hysteresis` of them), doubled after 1000 clean steps.
FP16_DYNAMIC_LOSS_SCALING = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def deepspeed_config(
    candidate: Candidate,
    *,
    global_batch: int | None = None,
    precision: Precision = Precision.FP32,
    training: TrainingSettings | None = None,
    total_steps: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config dict for one plan candidate (not yet validated: see `validated_config`).

    `global_batch` defaults to the candidate's b * m * d; pass the plan's B so that a plan whose
    numbers disagree is caught by the validation rather than silently re-derived. `training` gives
    the optimizer, schedule and clipping (`training_sections`); `total_steps` the run's length, which
    a decaying schedule needs.
    """
    config: dict[str, Any] = batch_section(
        micro_batch_size=candidate.micro_batch_size,
        micro_batches=candidate.micro_batches,
        data_parallel=candidate.data_parallel,
    )
    if global_batch is not None:
        config["train_batch_size"] = global_batch
    config.update(
        {
            "steps_per_print": STEPS_PER_PRINT,
            "wall_clock_breakdown": False,
            **training_sections(training or TrainingSettings(), total_steps),
            "zero_optimization": {"stage": candidate.zero_stage},
            "pipeline": {
                "stages": candidate.pipeline_parallel,
                "partition": stage_partition(candidate.stage_layers),
                "seed_layers": False,
                # Whole-stage recomputation is the schedule's R actions (the runtime's executor);
                # per-layer checkpointing is DeepSpeed's own, every layer, non-reentrant
                # (`runtime.engines.pipeline.build_pipeline_module` sets the same on the module).
                "activation_checkpoint_interval": 1 if candidate.checkpoint_layers else 0,
                **({"use_reentrant": False} if candidate.checkpoint_layers else {}),
            },
        }
    )
    if precision is Precision.BF16:
        config["bf16"] = {"enabled": True}
    elif precision is Precision.FP16:
        config["fp16"] = dict(FP16_DYNAMIC_LOSS_SCALING)
    return config


def training_sections(training: TrainingSettings, total_steps: int | None) -> dict[str, Any]:
    """`optimizer` (AdamW), `scheduler` (DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR,
    linear warm-up from 0) and `gradient_clipping`.

        >>> from pipectl.artifacts.run import LrSchedule
        >>> sections = training_sections(TrainingSettings(lr_schedule=LrSchedule.WARMUP_DECAY, warmup_steps=10), 100)
        >>> sections["scheduler"]["type"], sections["scheduler"]["params"]["total_num_steps"]
        ('WarmupDecayLR', 100)
    """
    sections: dict[str, Any] = {
        "gradient_clipping": training.gradient_clipping,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": training.learning_rate,
                "betas": list(training.betas),
                "eps": training.eps,
                "weight_decay": training.weight_decay,
                "torch_adam": True,
            },
        },
    }
    warmup = {"warmup_num_steps": training.warmup_steps, "warmup_type": "linear"}
    if training.lr_schedule is LrSchedule.CONSTANT:
        if training.warmup_steps:
            sections["scheduler"] = {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": training.learning_rate, **warmup},
            }
        return sections
    if total_steps is None or total_steps <= training.warmup_steps:
        raise UserInputError(
            f"--lr-schedule {training.lr_schedule.value} decays after {training.warmup_steps} warm-up steps, but the run "
            f"has {total_steps} steps",
            hint="train longer (--steps) or warm up for fewer steps (--warmup-steps)",
        )
    if training.lr_schedule is LrSchedule.WARMUP_DECAY:
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": training.learning_rate, "total_num_steps": total_steps, **warmup}
        sections["scheduler"] = {"type": "WarmupDecayLR", "params": params}
    else:
        params = {"total_num_steps": total_steps, "warmup_min_ratio": 0.0, "cos_min_ratio": training.min_lr_ratio, **warmup}
        sections["scheduler"] = {"type": "WarmupCosineLR", "params": params}
    return sections


# Keys a user's overlay may not set: the plan (batch arithmetic, cut, ZeRO stage, precision) and
# pipectl's checkpoints (ZeRO-1 partitions) own them. A dotted key names a key inside a section.
PLAN_OWNED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "pipeline",
    "zero_optimization.stage", "bf16.enabled", "fp16.enabled",
)  # fmt: skip


# Keys a launch option writes, by the option's flag: job.json keeps the option (every resume and
# resize writes it again, `status` and the launch's notes show it), so an overlay that set the key
# would train with one value and record another. The scheduler's are the option's only where
# pipectl's own schedule has them (an overlay may still give a constant-rate run a WarmupLR).
OPTION_OWNED_KEYS = {
    "optimizer.params.lr": "--lr", "optimizer.params.weight_decay": "--weight-decay",
    "gradient_clipping": "--gradient-clipping", "scheduler.params.warmup_max_lr": "--lr",
    "scheduler.params.warmup_num_steps": "--warmup-steps", "scheduler.params.total_num_steps": "--steps",
}  # fmt: skip
# Sections DeepSpeed reads as mappings whether or not pipectl's config has them.
MAPPING_SECTIONS = ("optimizer", "optimizer.params", "scheduler", "scheduler.params")


def merge_overlay(config: dict[str, Any], overlay: dict[str, Any], *, options_own: bool = True) -> dict[str, Any]:
    """`config` with the user's `overlay` merged in, section by section (a mapping merges into a
    mapping, anything else replaces); an overlay that sets a key of `PLAN_OWNED_KEYS` or (with
    `options_own`) of `OPTION_OWNED_KEYS` (one pipectl's config has), or a mapping's place to
    anything else, is refused, naming it.

        >>> merge_overlay({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, {"optimizer": {"params": {"eps": 1e-6}}})
        {'optimizer': {'type': 'AdamW', 'params': {'lr': 0.1, 'eps': 1e-06}}}
    """
    for key in PLAN_OWNED_KEYS:
        if _found(overlay, key):
            raise DeepSpeedConfigRejected(
                f"the DeepSpeed config overlay sets {key}, which the plan owns",
                hint="batch sizes, the pipeline cut, the ZeRO stage and the precision come from the plan: plan "
                "again to change them (pipectl plan), or remove the key from the overlay",
            )
    for key, flag in OPTION_OWNED_KEYS.items():
        if options_own and _found(overlay, key) and (not key.startswith("scheduler.") or _found(config, key)):
            raise DeepSpeedConfigRejected(
                f"the DeepSpeed config overlay sets {key}, which launch's {flag} sets",
                hint=f"remove it from the overlay and give {flag} (or its key in --config): the run keeps the option "
                "in job.json, and every resume and resize writes it again",
            )
    return _merged(config, overlay, "")


def overlay_adam(overlay: dict[str, Any]) -> dict[str, Any]:
    """AdamW's betas and eps as an overlay sets them (`optimizer.params`), for job.json's training
    settings to record what the run trains with.

        >>> overlay_adam({"optimizer": {"params": {"betas": [0.9, 0.95], "amsgrad": False}}})
        {'betas': [0.9, 0.95]}
    """
    params = (overlay.get("optimizer") or {}).get("params") if isinstance(overlay.get("optimizer"), dict) else None
    given = {key: params[key] for key in ("betas", "eps") if key in params} if isinstance(params, dict) else {}
    for key, value in given.items():  # torch's AdamW would refuse it in every rank, after the start
        try:
            TrainingSettings(**{key: value})
        except ValidationError as exc:
            raise DeepSpeedConfigRejected(
                f"the DeepSpeed config overlay sets optimizer.params.{key} to {value!r}: {error_words(exc.errors()[0])}"
            ) from None
    return given


def _found(config: dict[str, Any], key: str) -> bool:
    """Whether the dotted `key` ('optimizer.params.lr') is set in `config`."""
    *sections, last = key.split(".")
    for section in sections:
        config = config.get(section)
        if not isinstance(config, dict):
            return False
    return last in config


def _merged(base: dict[str, Any], overlay: dict[str, Any], where: str) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        path = f"{where}{key}"
        if not isinstance(value, dict) and (isinstance(merged.get(key), dict) or path in MAPPING_SECTIONS):
            raise DeepSpeedConfigRejected(
                f"the DeepSpeed config overlay sets {path} to {value!r}, where DeepSpeed reads a mapping of keys",
                hint=f"give {path} as keys and values (DeepSpeed's config reference lists them), e.g. "
                "optimizer: {params: {betas: [0.9, 0.95]}}",
            )
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value, f"{path}.")
        else:
            merged[key] = value
    return merged


def check_schedule(candidate: Candidate) -> None:
    """Whether the candidate's engine runs its schedule as planned. DeepSpeed's pipeline engine: not
    2BW (a different optimizer), not interleaved with v > 1, no split backward. Not only the stored
    flag: a plan written by hand keeps its default (True). A candidate for engine torch (PyTorch's
    pipelining runtime, `runtime.engines.torch_pipeline`): `check_torch_candidate`."""
    if candidate.engine is Engine.TORCH:
        check_torch_candidate(candidate)
        return
    if candidate.schedule.splits_backward:
        raise DeepSpeedConfigRejected(
            f"schedule {candidate.schedule.value} splits each backward into an input gradient (I) and a weight "
            "gradient (W) run at different times; DeepSpeed's pipeline engine runs one backward per micro-batch "
            "and cannot run it",
            hint="re-plan with --engine deepspeed (1f1b runs the same order with whole backwards)",
        )
    if candidate.schedule.changes_optimizer_semantics:
        raise DeepSpeedConfigRejected(
            f"the plan chose PipeDream-2BW (schedule {candidate.schedule.value}): no flush between steps, two "
            "weight versions per stage and 1-stale weight updates, a different optimizer. pipectl's runtime "
            "(DeepSpeed's pipeline engine) flushes every step and keeps one weight version: it cannot run it",
            hint="re-plan without 2bw in --schedules (1f1b runs the same order with a flush); "
            "`pipectl simulate PLAN.json` shows 2BW's steady state",
        )
    if candidate.chunks != 1 or not (candidate.deepspeed_runnable and deepspeed_runnable(candidate.schedule)):
        raise DeepSpeedConfigRejected(
            f"schedule {candidate.schedule.value} with v={candidate.chunks} chunks per device cannot run in "
            f"DeepSpeed's pipeline engine (one contiguous layer range per rank)",
            hint="re-plan for a DeepSpeed launch (interleaved with v > 1 is excluded there)",
        )


# zbv puts the V's two middle stages on one rank. Before 2.12, torch's pipelining runtime warmed up
# every stage's neighbours with a batched send and receive, to that same rank as well, which gloo
# refuses ("Pair is not connected") at the first step; 2.12 warms up with a vote between ranks.
# Measured: zbv at p = 2 fails on torch 2.11.0 and trains on 2.12.1 and 2.13.0.
ZBV_MIN_TORCH = (2, 12)


def installed_torch() -> tuple[int, int] | None:
    """torch's (major, minor) as installed, without importing it; None if it cannot be read."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("torch").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return None


def check_torch_candidate(candidate: Candidate) -> None:
    """What the torch engine runs: 1f1b, gpipe, interleaved (v chunks per rank), zb-h1 or zbv (v = 2), without
    recomputation, one pipeline (t = 1, d = 1), ZeRO-1 (at d = 1: plain AdamW), p x v stage ranges."""
    torch_version = installed_torch() if candidate.schedule is ScheduleKind.ZBV else None  # read only when it matters
    if torch_version is not None and torch_version < ZBV_MIN_TORCH:
        raise DeepSpeedConfigRejected(
            f"schedule zbv needs torch {'.'.join(map(str, ZBV_MIN_TORCH))} or later on engine torch; this environment "
            f"has torch {'.'.join(map(str, torch_version))}, whose pipelining runtime fails at a V's first step",
            hint="install a newer torch, or re-plan with --schedules 1f1b,zb-h1,interleaved",
        )
    problems = []
    if not torch_runnable(candidate.schedule, candidate.recompute):
        problems.append(
            f"schedule {candidate.schedule.value}" + (" with whole-stage recomputation" if candidate.recompute else "")
            + " (it runs 1f1b, gpipe, interleaved, zb-h1 and zbv, without recomputation)"
        )
    if candidate.checkpoint_layers:
        problems.append("per-layer activation checkpointing (it recomputes nothing)")
    if candidate.selective_recompute:
        problems.append("selective recomputation (it recomputes nothing)")
    if candidate.tensor_parallel != 1 or candidate.data_parallel != 1 or candidate.replicas:
        problems.append(f"t{candidate.tensor_parallel} d{candidate.data_parallel} (it runs one pipeline: t = 1, d = 1)")
    if candidate.zero_stage > 1:
        problems.append(f"ZeRO stage {candidate.zero_stage}")
    if candidate.schedule is ScheduleKind.ZBV:
        if candidate.chunks != 2:
            problems.append(f"v={candidate.chunks} chunks per rank with schedule zbv (it holds 2, a V)")
    elif candidate.chunks != 1 and candidate.schedule is not ScheduleKind.INTERLEAVED:
        problems.append(f"v={candidate.chunks} chunks per rank with schedule {candidate.schedule.value}")
    if problems:
        raise DeepSpeedConfigRejected(
            "the plan chose a candidate for engine torch (PyTorch's pipelining runtime) that it cannot run: "
            + "; ".join(problems),
            hint="re-plan with --engine torch (it plans only what that runtime runs) or --engine deepspeed",
        )


def stage_count(candidate: Candidate) -> int:
    """How many (virtual) stage ranges the candidate's cut has: p, or p x v on the torch engine."""
    return candidate.pipeline_parallel * (candidate.chunks if candidate.engine is Engine.TORCH else 1)


def check_candidate(candidate: Candidate, *, global_batch: int, layers: int) -> None:
    """What DeepSpeed cannot run or silently ignores, checked against the plan (errors name values)."""
    b, m, d = candidate.micro_batch_size, candidate.micro_batches, candidate.data_parallel
    if candidate.replicas:
        samples = sum(r.samples for r in candidate.replicas)
        if len(candidate.replicas) != d or samples != global_batch:
            raise DeepSpeedConfigRejected(
                f"{len(candidate.replicas)} replica shares covering {samples} samples for data-parallel {d} "
                f"and global batch {global_batch}"
            )
    if not has_uneven_replicas(candidate) and b * m * d != global_batch:
        raise DeepSpeedConfigRejected(
            f"train_batch_size {global_batch} != micro-batch {b} x accumulation {m} x data-parallel {d} "
            f"(= {b * m * d})",
            hint="re-plan: every candidate must keep the global batch exactly",
        )
    if candidate.zero_stage == 3 and candidate.checkpoint_layers:
        raise DeepSpeedConfigRejected(
            "the plan chose ZeRO stage 3 with per-layer activation checkpointing; DeepSpeed's ordinary engine "
            "cannot recompute a layer whose weights ZeRO-3 has partitioned (pipectl's runtime does not run it)",
            hint="re-plan with --recompute stage or never, or with --zero-stages 1,2",
        )
    if not runtime_runs_zero(candidate.zero_stage, candidate.pipeline_parallel, candidate.tensor_parallel):
        raise DeepSpeedConfigRejected(
            f"the plan chose ZeRO stage {candidate.zero_stage} for t{candidate.tensor_parallel} "
            f"p{candidate.pipeline_parallel}; pipectl trains with ZeRO-1, and with ZeRO-2 or ZeRO-3 when there is "
            f"one stage and no tensor split (in DeepSpeed's ordinary engine: its pipeline engine rejects 2 and 3)",
            hint="re-plan with --zero-stages 1 (the default)",
        )
    if candidate.zero_stage >= 2 and has_uneven_replicas(candidate):
        # ZeRO-2 and ZeRO-3 reduce-scatter after every micro-batch's backward (ZeRO-3 also gathers
        # the weights before every forward and backward): replicas running different micro-batch
        # counts would wait on collectives the others never start.
        raise DeepSpeedConfigRejected(
            f"the plan chose ZeRO stage {candidate.zero_stage} with uneven replicas "
            f"({', '.join(f'{r.micro_batch_size}x{r.micro_batches}' for r in candidate.replicas)}); "
            f"ZeRO-{candidate.zero_stage} reduces gradients after every micro-batch, so every replica must run "
            "the same number",
            hint="re-plan with --even-replicas, or with --zero-stages 1",
        )
    check_schedule(candidate)
    if len(candidate.stage_layers) != stage_count(candidate):
        raise DeepSpeedConfigRejected(
            f"{len(candidate.stage_layers)} stage ranges for pipeline degree {candidate.pipeline_parallel}"
            + (f" x {candidate.chunks} chunks" if stage_count(candidate) != candidate.pipeline_parallel else "")
        )
    first, last = candidate.stage_layers[0][0], candidate.stage_layers[-1][1]
    if first != 0 or last != layers:
        raise DeepSpeedConfigRejected(
            f"stage_layers {candidate.stage_layers} cover layers [{first}, {last}), the model has {layers}"
        )
    empty = [i for i, (start, end) in enumerate(candidate.stage_layers) if end <= start]
    if empty:
        raise DeepSpeedConfigRejected(f"stage(s) {empty} hold no layer: {candidate.stage_layers}")


def has_uneven_replicas(candidate: Candidate) -> bool:
    """Heterogeneous plans: replicas with different (micro-batch size, accumulation) shares."""
    return bool(candidate.replicas) and len({(r.micro_batch_size, r.micro_batches) for r in candidate.replicas}) > 1


def replica_config(config: dict[str, Any], micro_batch_size: int, micro_batches: int, data_parallel: int) -> dict[str, Any]:
    """One replica's batch keys (uneven replicas): each rank's engine sees its own b_r and m_r, and
    DeepSpeed checks train_batch_size = b_r x m_r x d per rank; the worker weights the replica's
    loss by d x s_r / B so that the averaged gradient is the global-batch mean (docs/design.md, 'The global batch')."""
    return {**config, **batch_section(micro_batch_size=micro_batch_size, micro_batches=micro_batches, data_parallel=data_parallel)}


def uneven_replicas_section(candidate: Candidate, global_batch: int) -> dict[str, Any]:
    """What the run's ds_config.json says of uneven replicas: its top-level batch keys are the
    plan's b and largest m (b x m x d can exceed B), and each rank's engine takes its own replica's
    (`replica_config`); the global batch and the replicas' shares, counted by (b, m)."""
    shares: dict[tuple[int, int], int] = {}
    for share in candidate.replicas or []:
        key = (share.micro_batch_size, share.micro_batches)
        shares[key] = shares.get(key, 0) + 1
    return {
        "global_batch": global_batch,
        "replicas": [{"micro_batch_size": b, "micro_batches": m, "count": n} for (b, m), n in shares.items()],
        "note": "the top-level batch keys are the plan's b and largest m; each rank's engine takes its own replica's "
        "(train_batch_size = b x m x d of that replica), and the replicas together train global_batch samples",
    }


def check_pipeline_section(config: dict[str, Any], candidate: Candidate) -> None:
    """DeepSpeed ignores `pipeline.stages`/`partition`; make sure they say what the plan says."""
    pipeline = config.get("pipeline", {})
    stages = pipeline.get("stages")
    if stages != candidate.pipeline_parallel:
        raise DeepSpeedConfigRejected(
            f"pipeline.stages {stages!r} != the plan's pipeline degree {candidate.pipeline_parallel}"
        )
    partition = pipeline.get("partition")
    expected = stage_partition(candidate.stage_layers)
    if partition != expected:
        raise DeepSpeedConfigRejected(f"pipeline.partition {partition!r} != the plan's cut {expected}")


@contextlib.contextmanager
def _quiet_deepspeed_logger() -> Iterator[None]:
    """DeepSpeed logs its parsed config at INFO; library code stays silent."""
    from deepspeed.utils import logger  # DeepSpeed only when validating: the CLI starts without it

    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def parse_with_deepspeed(config: dict[str, Any], data_parallel: int) -> Any:
    """Run DeepSpeed's own `DeepSpeedConfig` parser as the engine would see it, without processes.

    Inside the pipeline engine the parser's `world_size` is the data-parallel degree (the engine
    passes its grid as `mpu`). Without an initialised process group the parser falls back to
    world_size 1, so a subclass sets the planned degree before DeepSpeed's own checks run
    (`_configure_train_batch_size`: train_batch_size == micro x accumulation x world_size).
    Errors become `DeepSpeedConfigRejected` naming DeepSpeed's message.
    """
    choose_accelerator()
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig  # see _quiet_deepspeed_logger

    class PlannedDeepSpeedConfig(DeepSpeedConfig):
        def _initialize_params(self, param_dict: dict[str, Any]) -> None:
            self.world_size = data_parallel  # what the engine's mpu reports
            super()._initialize_params(param_dict)

    optimizer = config.get("optimizer", {}).get("type")
    if optimizer is not None and optimizer.lower() not in DEEPSPEED_OPTIMIZERS:
        raise DeepSpeedConfigRejected(
            f"optimizer type {optimizer!r} is not one of DeepSpeed's: {', '.join(DEEPSPEED_OPTIMIZERS)}"
        )
    reading = _ReadKeys(config)
    try:
        with _quiet_deepspeed_logger():
            parsed = PlannedDeepSpeedConfig(reading)
    except Exception as exc:  # DeepSpeed raises AssertionError, ValueError and pydantic errors alike
        detail = str(exc).strip().splitlines()
        raise DeepSpeedConfigRejected(
            f"DeepSpeed rejected the config (data-parallel {data_parallel}): "
            f"{type(exc).__name__}: {' '.join(detail)[:600]}"
        ) from exc
    parsed.read_keys = sorted(k for k in reading.read if isinstance(k, str))  # every key DeepSpeed looks for
    return parsed


class _ReadKeys(dict):
    """A config that notes which of its top-level keys are looked up: DeepSpeed's parser reads
    every key it knows and passes over the rest in silence, so a key it never read is one that
    no part of DeepSpeed acts on (a misspelt section, say)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def check_overlay_is_read(overlay: dict[str, Any], config: dict[str, Any], parsed: Any) -> None:
    """Refuse what the user's overlay sets that DeepSpeed would ignore or fail on only in the ranks:
    a top-level key its parser never reads, and keyword arguments that the optimizer's
    or the learning-rate scheduler's constructor does not take (DeepSpeed passes `params` to it as
    they are, so a misspelt one raises a TypeError in every rank, after the job started).
    `parsed`: `parse_with_deepspeed`'s result, which knows the keys the parser read and looked for."""
    from difflib import get_close_matches

    for key in (k for k in overlay if k not in parsed.read_keys):
        near = get_close_matches(key, parsed.read_keys, n=1)
        raise DeepSpeedConfigRejected(
            f"the DeepSpeed config overlay sets {key!r}, which DeepSpeed's config parser does not read: it would "
            "be ignored",
            hint=f"did you mean {near[0]!r}?" if near else "see DeepSpeed's config reference for its keys",
        )
    scheduler = overlay.get("scheduler")
    if isinstance(scheduler, dict) and scheduler and not (config.get("scheduler") or {}).get("type"):
        # DeepSpeed builds no scheduler without a type: the parameters would change nothing.
        raise DeepSpeedConfigRejected(
            f"the DeepSpeed config overlay sets scheduler.{next(iter(scheduler))}, but the run has no learning-rate "
            "scheduler (a constant rate without warm-up): it would be ignored",
            hint="choose one with --lr-schedule or --warmup-steps (then the overlay tunes it), or set scheduler.type",
        )
    for section, accepted in (("optimizer", _optimizer_arguments(config)), ("scheduler", _scheduler_arguments(config))):
        given = (overlay.get(section) or {}).get("params") if isinstance(overlay.get(section), dict) else None
        if accepted is None or not isinstance(given, dict):
            continue
        for key in given:
            if key not in accepted:
                near = get_close_matches(key, sorted(accepted), n=1)
                raise DeepSpeedConfigRejected(
                    f"the DeepSpeed config overlay sets {section}.params.{key}, which "
                    f"{config[section].get('type')} does not take",
                    hint=(f"did you mean {near[0]!r}? " if near else "") + f"it takes {', '.join(sorted(accepted))}",
                )


# Keys of `optimizer.params` that DeepSpeed's engine takes out before it builds torch's Adam or AdamW
# (`DeepSpeedEngine.get_optimizer_configuration`, 0.19.8).
DEEPSPEED_ADAM_KEYS = {"torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach"}


def _optimizer_arguments(config: dict[str, Any]) -> set[str] | None:
    """What `optimizer.params` may hold where DeepSpeed builds torch's Adam or AdamW (`torch_adam`,
    which pipectl's config sets); None for another optimizer, whose arguments are not checked here."""
    import inspect

    import torch

    section = config.get("optimizer") or {}
    kind = str(section.get("type", "")).lower()
    if kind not in ("adam", "adamw") or not (section.get("params") or {}).get("torch_adam"):
        return None
    built = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return set(inspect.signature(built).parameters) - {"params"} | DEEPSPEED_ADAM_KEYS


def _scheduler_arguments(config: dict[str, Any]) -> set[str] | None:
    """What `scheduler.params` may hold: the keyword arguments of the class DeepSpeed builds from
    `scheduler.type` (its own `lr_schedules`, else torch's), but the optimizer; None if neither has it."""
    import inspect

    import torch
    from deepspeed.runtime import lr_schedules

    kind = str((config.get("scheduler") or {}).get("type", ""))
    built = getattr(lr_schedules, kind, None) or getattr(torch.optim.lr_scheduler, kind, None)
    if not kind or not inspect.isclass(built):
        return None
    return set(inspect.signature(built).parameters) - {"optimizer"}


def validated_config(
    plan: Plan,
    candidate: Candidate | None = None,
    *,
    precision: Precision = Precision.FP32,
    training: TrainingSettings | None = None,
    total_steps: int | None = None,
    overlay: dict[str, Any] | None = None,
    stored_overlay: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config for `plan.chosen` (or `candidate`), with the user's `training` settings
    and `overlay` (`merge_overlay`), checked by pipectl and by DeepSpeed. An overlay that is the
    run's `stored_overlay` (a resume, a resize) may keep keys a launch option sets: a run launched
    before they were refused still resumes and resizes.

    Raises `DeepSpeedConfigRejected` (a user error: exit 2) naming the offending values.
    """
    candidate = candidate or plan.chosen
    check_candidate(candidate, global_batch=plan.global_batch, layers=plan.layers)
    if candidate.engine is Engine.TORCH and precision is not Precision.FP32:
        raise DeepSpeedConfigRejected(
            f"precision {precision.value}: the torch engine (PyTorch's pipelining runtime) trains in fp32 only",
            hint="launch without --precision (fp32), or re-plan with --engine deepspeed",
        )
    uneven = has_uneven_replicas(candidate)
    config = deepspeed_config(
        candidate,
        global_batch=None if uneven else plan.global_batch,
        precision=precision,
        training=training,
        total_steps=total_steps,
    )
    if uneven:  # written down where a reader of the file looks for the batch (DeepSpeed ignores it)
        config["pipeline"]["uneven_replicas"] = uneven_replicas_section(candidate, plan.global_batch)
    config = merge_overlay(config, overlay or {}, options_own=(overlay or {}) != (stored_overlay or {}))
    check_pipeline_section(config, candidate)
    for share in (candidate.replicas or []) if uneven else []:
        parse_with_deepspeed(
            replica_config(config, share.micro_batch_size, share.micro_batches, candidate.data_parallel),
            candidate.data_parallel,
        )
    if candidate.engine is Engine.TORCH:  # what the torch engine reads of it, checked before any rank starts
        from pipectl.runtime.engines.torch_pipeline import OptimizerSettings

        OptimizerSettings.from_ds_config(config)
    parsed = parse_with_deepspeed(config, candidate.data_parallel)
    check_overlay_is_read(overlay or {}, config, parsed)
    derived = (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps)
    wanted = (config["train_batch_size"], candidate.micro_batch_size, candidate.micro_batches)  # base config
    if derived != wanted:
        raise DeepSpeedConfigRejected(
            f"DeepSpeed derived (train, micro, accumulation) = {derived}, the plan says {wanted}"
        )
    if parsed.zero_optimization_stage != config["zero_optimization"]["stage"]:
        raise DeepSpeedConfigRejected(
            f"DeepSpeed parsed ZeRO stage {parsed.zero_optimization_stage}, the config says "
            f"{config['zero_optimization']['stage']}"
        )
    return config
