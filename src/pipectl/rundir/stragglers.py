"""Straggler detection from the per-rank heartbeats in metrics.jsonl (pure; no processes, no I/O).

A *fail-stutter* rank (Arpaci-Dusseau & Arpaci-Dusseau, "Fail-Stutter Fault Tolerance", HotOS
2001) keeps working, only slower; in a synchronous pipeline it sets the pace of every step. Varuna
(EuroSys 2022, §4) watches per-rank step times and leaves such a rank out at the next morph.

Only ranks doing the same work on the same kind of device can be compared: the data-parallel
replicas of one pipeline stage hold the same layers; uneven replicas process different shares of
the batch, so their compute is taken per sample where the heartbeat records the share; and the
replicas of a heterogeneous plan are compared with peers of their own device kind only (a P100 is
meant to be slower than a V100). For each recent step of the current layout
and each rank in a group of stage peers:

    slowdown(r, s) = compute(r, s) / median over the other peers of compute(peer, s)
    z(r, s)        = 0.6745 (compute(r, s) - median_s) / MAD_s     (modified z-score, Iglewicz &
                                                                    Hoaglin 1993; groups of >= 3)

where compute = forward + backward seconds from the rank's heartbeat (per sample of its share when
recorded). A rank's score is the median
over the window, so one slow step (a page fault, a checkpoint) is not a straggler; a rank that is
slow in most steps is. It is flagged when its median slowdown reaches `slowdown_threshold` and, in
groups of three or more where the MAD is meaningful, its median z-score reaches `z_threshold`
too. With two peers the MAD cannot tell which one is off (both sit at z = ±0.6745), so only the
slowdown decides there. A rank without data-parallel peers (d = 1) cannot be judged this way and
is never flagged.

    >>> from pipectl.artifacts.run import RankTiming, StepMetrics
    >>> def step(s, slow):
    ...     ranks = [RankTiming(rank=r, stage=r % 2, forward_seconds=(0.4 if r == slow else 0.1),
    ...                         backward_seconds=0.2) for r in range(4)]
    ...     return StepMetrics(step=s, loss=1.0, step_seconds=1.0, samples_per_second=8.0,
    ...                        global_batch=8, world_size=4, ranks=ranks)
    >>> report = find_stragglers([step(s, slow=3) for s in range(1, 9)])
    >>> report.straggler_ranks, round(report.scores[3].median_slowdown, 3)
    ([3], 2.0)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from pipectl.artifacts.run import StepMetrics
from pipectl.errors import UserInputError

# Scale that makes the MAD a consistent estimator of the standard deviation for normal data
# (Iglewicz & Hoaglin, "How to Detect and Handle Outliers", 1993): z = 0.6745 (x - median) / MAD.
MODIFIED_Z_SCALE = 0.6745


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank counts as a straggler."""

    window_steps: int = 10  # recent steps of the current layout that are looked at
    min_steps: int = 3  # fewer steps than this: no verdict
    slowdown_threshold: float = 1.5  # median compute time vs the peers' median
    z_threshold: float = 3.5  # modified z-score, used in groups of >= 3 peers

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.min_steps < 1:
            raise UserInputError(
                f"straggler window {self.window_steps} and minimum {self.min_steps} steps must be >= 1"
            )
        if self.slowdown_threshold <= 1.0:
            raise UserInputError(
                f"straggler slowdown threshold {self.slowdown_threshold} must be > 1 (1.5 = 50 % slower)"
            )
        if self.z_threshold <= 0:
            raise UserInputError(f"straggler z-score threshold {self.z_threshold} must be > 0")


@dataclass(frozen=True)
class RankScore:
    """One rank's standing against its data-parallel peers over the window."""

    rank: int
    stage: int
    peers: int  # other ranks of the same stage
    median_compute_seconds: float
    median_slowdown: float  # 1.0 = as fast as the peers' median
    median_z: float | None  # None in groups of fewer than 3
    straggler: bool


@dataclass(frozen=True)
class StragglerReport:
    """The verdict over `steps` (the window of the current layout)."""

    steps: tuple[int, ...]
    layout: str
    world_size: int
    scores: dict[int, RankScore] = field(default_factory=dict)
    reason: str = ""  # why nothing could be judged, if so

    @property
    def straggler_ranks(self) -> list[int]:
        return sorted(r for r, s in self.scores.items() if s.straggler)

    def describe(self) -> list[str]:
        """One line per straggler (for CLI output and notes)."""
        return [
            f"rank {s.rank} (stage {s.stage}) computes {s.median_slowdown:.2f}x as long as its "
            f"{s.peers} data-parallel peer(s) (median over {len(self.steps)} steps)"
            for s in (self.scores[r] for r in self.straggler_ranks)
        ]


def recent_window(metrics: Sequence[StepMetrics], window_steps: int) -> list[StepMetrics]:
    """The last `window_steps` steps that ran on the newest layout since the job last moved to it,
    and carry heartbeats (an earlier span of the same layout, before a move away and back, is
    another placement of its ranks: not pooled with this one)."""
    with_heartbeats = [m for m in metrics if m.ranks]
    if not with_heartbeats:
        return []
    newest = with_heartbeats[-1]
    span: list[StepMetrics] = []
    for m in reversed(metrics):
        if m.layout != newest.layout or m.world_size != newest.world_size:
            if span:
                break
            continue
        if m.ranks:
            span.append(m)
    return span[::-1][-window_steps:]


def _modified_z(value: float, values: Sequence[float]) -> float:
    center = statistics.median(values)
    mad = statistics.median(abs(v - center) for v in values)
    if mad == 0:
        return 0.0 if value == center else float("inf") if value > center else float("-inf")
    return MODIFIED_Z_SCALE * (value - center) / mad


def find_stragglers(metrics: Sequence[StepMetrics], policy: StragglerPolicy | None = None) -> StragglerReport:
    """Score every rank against its data-parallel peers over the recent window; flag stragglers."""
    policy = policy or StragglerPolicy()
    window = recent_window(metrics, policy.window_steps)
    if not window:
        return StragglerReport((), "", 0, reason="no per-rank heartbeats in the metrics yet")
    steps = tuple(m.step for m in window)
    layout, world = window[-1].layout, window[-1].world_size
    if len(window) < policy.min_steps:
        return StragglerReport(
            steps, layout, world, reason=f"{len(window)} step(s) on this layout, {policy.min_steps} needed"
        )

    compute: dict[int, list[float]] = defaultdict(list)  # rank -> per-step compute seconds
    stage_of: dict[int, int] = {}
    group_of: dict[int, tuple] = {}
    slowdowns: dict[int, list[float]] = defaultdict(list)
    zs: dict[int, list[float]] = defaultdict(list)
    for m in window:
        groups: dict[tuple, dict[int, float]] = defaultdict(dict)  # (stage, kind) -> rank -> seconds (per sample)
        for timing in m.ranks:
            seconds = timing.forward_seconds + timing.backward_seconds
            compute[timing.rank].append(seconds)
            groups[timing.stage, timing.device][timing.rank] = seconds / timing.samples if timing.samples else seconds
            stage_of[timing.rank] = timing.stage
            group_of[timing.rank] = (timing.stage, timing.device)
        for group in groups.values():
            for rank, seconds in group.items():
                others = [v for r, v in group.items() if r != rank]
                if not others:
                    continue
                reference = statistics.median(others)
                slowdowns[rank].append(seconds / reference if reference > 0 else float("inf") if seconds > 0 else 1.0)
                if len(group) >= 3:
                    zs[rank].append(_modified_z(seconds, list(group.values())))

    scores = {}
    for rank in sorted(compute):
        peers = max(0, sum(1 for group in group_of.values() if group == group_of[rank]) - 1)
        median_slowdown = statistics.median(slowdowns[rank]) if slowdowns[rank] else 1.0
        median_z = statistics.median(zs[rank]) if zs[rank] else None
        slow = bool(slowdowns[rank]) and median_slowdown >= policy.slowdown_threshold
        if median_z is not None:
            slow = slow and median_z >= policy.z_threshold
        scores[rank] = RankScore(
            rank=rank,
            stage=stage_of[rank],
            peers=peers,
            median_compute_seconds=statistics.median(compute[rank]),
            median_slowdown=median_slowdown,
            median_z=median_z,
            straggler=slow,
        )
    reason = "" if any(s.peers for s in scores.values()) else "no data-parallel peers of the same kind to compare"
    return StragglerReport(steps, layout, world, scores, reason)
