"""Schedules as data: the typed IR, the generators, the communication pass and the validator.

    >>> from pipectl.schedule import ScheduleKind, generate
    >>> generate(ScheduleKind.ONE_F_ONE_B, 2, 2).actions[1][:2]
    (Action(stage=1, kind=<ActionKind.FORWARD: 'F'>, microbatch=0), Action(stage=1, kind=<ActionKind.BACKWARD: 'B'>, microbatch=0))
"""

from __future__ import annotations

from pipectl.schedule.generators import (
    generate,
    gpipe,
    interleaved,
    one_f_one_b,
    pipedream_2bw,
    varuna,
    weight_version,
    zb_h1,
    zbv,
)
from pipectl.schedule.ir import Action, ActionKind, Schedule, ScheduleKind, stage_rank, stage_ranks
from pipectl.schedule.twobw import two_bw_order


def deepspeed_runnable(kind: ScheduleKind, chunks: int = 1) -> bool:
    """Whether DeepSpeed's pipeline engine can execute this schedule.

    DeepSpeed's `PipelineModule` holds one contiguous chunk of layers per rank, so interleaved
    schedules with v > 1 cannot run there. PipeDream-2BW needs two weight versions and no flush,
    which the engine does not keep, so it is planned and simulated only. Zero bubble (zb-h1, zbv)
    splits every backward into I and W, which the engine's single backward cannot do; zbv also
    holds two chunks per rank.

    >>> deepspeed_runnable(ScheduleKind.INTERLEAVED, 2), deepspeed_runnable(ScheduleKind.VARUNA)
    (False, True)
    """
    kind = ScheduleKind(kind)
    if kind is ScheduleKind.INTERLEAVED and chunks > 1:
        return False
    return kind is not ScheduleKind.PIPEDREAM_2BW and not kind.splits_backward


# What `pipectl.runtime.engines.torch_pipeline` translates: F, B, I and W actions, any chunks per rank in
# the loop placement or zbv's V; no recompute action (torch's runtime has none).
TORCH_SCHEDULES = frozenset(
    (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED, ScheduleKind.ZB_H1, ScheduleKind.ZBV)
)


def torch_runnable(kind: ScheduleKind, recompute: bool = False) -> bool:
    """Whether PyTorch's pipelining runtime (`pipectl.runtime.engines.torch_pipeline`) runs this schedule:
    GPipe, 1F1B, interleaved (any v), zb-h1 and zbv (its V placement), without recomputation
    (Varuna always recomputes; 2BW keeps two weight versions, which that runtime does not).

    >>> torch_runnable(ScheduleKind.ZB_H1), torch_runnable(ScheduleKind.ONE_F_ONE_B, recompute=True)
    (True, False)
    """
    return ScheduleKind(kind) in TORCH_SCHEDULES and not recompute


__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleKind",
    "TORCH_SCHEDULES",
    "deepspeed_runnable",
    "torch_runnable",
    "generate",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "pipedream_2bw",
    "two_bw_order",
    "varuna",
    "weight_version",
    "zb_h1",
    "zbv",
    "stage_rank",
    "stage_ranks",
]
