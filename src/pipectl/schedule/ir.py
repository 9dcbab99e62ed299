"""The schedule IR: one typed representation read by the simulator, the validator, the Gantt chart
and the DeepSpeed runtime adapter.

An `Action` is a frozen value with a compact text form that parses back exactly:

    >>> Action.parse("2F0")
    Action(stage=2, kind=<ActionKind.FORWARD: 'F'>, microbatch=0)
    >>> str(Action(stage=1, kind=ActionKind.SEND_FORWARD, microbatch=3))
    '1SF3'
    >>> str(Action(stage=0, kind=ActionKind.OPTIMIZER_STEP))
    '0STEP'

`stage` is the *virtual* stage: with v model chunks per rank and p ranks, virtual stage s lives on
rank s % p as its chunk s // p (device k holds chunks k, k+p, k+2p, ...: the "loop" placement).
With v = 1 the virtual stage is the rank. The V-shaped schedule (`ScheduleKind.ZBV`, v = 2) places
its stages as a V instead: stage s on rank s for s < p, on rank 2p − 1 − s otherwise, so rank k
holds stages k and 2p − 1 − k, and the hand-off between stages p − 1 and p stays on rank p − 1.
`stage_rank` is the one place that mapping is written (`stage_ranks`: every stage's at once).

A `Schedule` maps every rank to its ordered list of actions for one optimizer step. Generators
produce compute actions only (F, B, R, and the per-rank all-reduce and optimizer step); a separate
pass adds the sends and receives (`pipectl.schedule.comm`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache


class ActionKind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    RECOMPUTE = "R"
    SEND_FORWARD = "SF"  # send this micro-batch's output activation to the next stage
    RECV_FORWARD = "RF"  # receive this micro-batch's input activation from the previous stage
    SEND_BACKWARD = "SB"  # send the gradient of this micro-batch's input to the previous stage
    RECV_BACKWARD = "RB"  # receive the gradient of this micro-batch's output from the next stage
    ALL_REDUCE = "AR"  # data-parallel gradient all-reduce of this stage's parameters
    OPTIMIZER_STEP = "STEP"
    # The split backward of the zero-bubble schedules: I(i) computes the gradient of the stage's
    # input (what the previous stage waits for), W(i) later the gradient of its weights. A stage
    # runs either B(i) or I(i) then W(i) for each micro-batch. DeepSpeed's engine cannot run them;
    # the torch pipelining path (`pipectl.runtime.engines.torch_pipeline`) can.
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"

    @property
    def is_compute(self) -> bool:
        return self in (
            ActionKind.FORWARD,
            ActionKind.BACKWARD,
            ActionKind.RECOMPUTE,
            ActionKind.BACKWARD_INPUT,
            ActionKind.BACKWARD_WEIGHT,
        )

    @property
    def computes_input_gradient(self) -> bool:
        """B or I: the action after which the stage's input gradient exists (sent upstream)."""
        return self in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)

    @property
    def is_p2p(self) -> bool:
        return self in (
            ActionKind.SEND_FORWARD,
            ActionKind.RECV_FORWARD,
            ActionKind.SEND_BACKWARD,
            ActionKind.RECV_BACKWARD,
        )

    @property
    def has_microbatch(self) -> bool:
        return self not in (ActionKind.ALL_REDUCE, ActionKind.OPTIMIZER_STEP)


# Longest kinds first so "SF" is not read as "S" + "F".
_KINDS = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KINDS})(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"stage must be >= 0, got {self.stage}")
        if self.kind.has_microbatch and (self.microbatch is None or self.microbatch < 0):
            raise ValueError(f"{self.kind.name} needs a micro-batch index >= 0, got {self.microbatch}")
        if not self.kind.has_microbatch and self.microbatch is not None:
            raise ValueError(f"{self.kind.name} takes no micro-batch index, got {self.microbatch}")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F0', '1SB3', '0STEP')")
        stage, kind, mb = match.groups()
        return cls(int(stage), ActionKind(kind), int(mb) if mb else None)


class ScheduleKind(str, Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    VARUNA = "varuna"
    PIPEDREAM_2BW = "2bw"
    # Zero bubble H1 (Qi et al., ICLR 2024): 1F1B's order with every backward split into I (input
    # gradient) and W (weight gradient), W's postponed to fill the drain. DeepSpeed's engine cannot
    # run it (no split backward); torch's pipelining runtime can (`pipectl.runtime.engines.torch_pipeline`).
    ZB_H1 = "zb-h1"
    # ZB-V (Qi et al., ICLR 2024, §4): two chunks per rank in the V placement, split backward.
    # Only the torch pipelining path runs it.
    ZBV = "zbv"

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as I then W (the zero-bubble family)."""
        return self in (ScheduleKind.ZB_H1, ScheduleKind.ZBV)

    @property
    def v_placement(self) -> bool:
        """Whether virtual stages are placed as a V (`stage_rank`) rather than in a loop."""
        return self is ScheduleKind.ZBV

    @property
    def changes_optimizer_semantics(self) -> bool:
        """PipeDream-2BW updates with 1-stale gradients: a different optimizer, never chosen silently."""
        return self is ScheduleKind.PIPEDREAM_2BW


def stage_rank(stage: int, pipeline_parallel: int, v_placement: bool = False) -> int:
    """The rank that holds virtual stage `stage` of p·v: s % p (loop), or as a V when `v_placement`.

    >>> [stage_rank(s, 2) for s in range(4)], [stage_rank(s, 2, v_placement=True) for s in range(4)]
    ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    p = pipeline_parallel
    if not v_placement:
        return stage % p
    return stage if stage < p else 2 * p - 1 - stage


@lru_cache(maxsize=4096)
def stage_ranks(stages: int, pipeline_parallel: int, v_placement: bool = False) -> tuple[int, ...]:
    """`stage_rank` of every virtual stage 0..stages-1 (what the planner's per-rank sums read).

    >>> stage_ranks(6, 3), stage_ranks(6, 3, v_placement=True)
    ((0, 1, 2, 0, 1, 2), (0, 1, 2, 2, 1, 0))
    """
    return tuple(stage_rank(stage, pipeline_parallel, v_placement) for stage in range(stages))


@dataclass(frozen=True)
class Schedule:
    """One optimizer step of a pipeline: per rank, the ordered actions it performs.

    `pipeline_parallel` ranks, `micro_batches` micro-batches per step, `chunks` model chunks per
    rank (v; 1 unless interleaved or zbv). Virtual stage s runs on rank s % p in a loop placement
    and on the V's rank under zbv (`rank_of`).
    """

    kind: ScheduleKind
    pipeline_parallel: int
    micro_batches: int
    chunks: int
    actions: dict[int, tuple[Action, ...]] = field(hash=False)

    @property
    def virtual_stages(self) -> int:
        return self.pipeline_parallel * self.chunks

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.pipeline_parallel, self.kind.v_placement)

    def compute_order(self, rank: int) -> list[Action]:
        """The rank's forward/backward/recompute actions in order (what the runtime records)."""
        return [a for a in self.actions[rank] if a.kind.is_compute]

    def to_text(self) -> str:
        """One line per rank: `rank: action action ...`; `Schedule.from_text` reads it back."""
        header = f"# {self.kind.value} p={self.pipeline_parallel} m={self.micro_batches} v={self.chunks}"
        lines = [header] + [
            f"{rank}: " + " ".join(str(a) for a in self.actions[rank]) for rank in sorted(self.actions)
        ]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        lines = [line for line in text.strip().splitlines() if line.strip()]
        match = re.match(r"^# (\S+) p=(\d+) m=(\d+) v=(\d+)$", lines[0]) if lines else None
        if not match:
            raise ValueError("schedule text must start with '# KIND p=P m=M v=V'")
        kind, p, m, v = match.groups()
        actions: dict[int, tuple[Action, ...]] = {}
        for line in lines[1:]:
            rank, _, rest = line.partition(":")
            actions[int(rank)] = tuple(Action.parse(tok) for tok in rest.split())
        return cls(ScheduleKind(kind), int(p), int(m), int(v), actions)
