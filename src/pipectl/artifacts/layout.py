"""The runnable part of a plan candidate: how the ranks split the work.

The worker builds its engine from a `Layout`, metrics lines and morph records carry its `label()`,
and a checkpoint's manifest records the one that wrote it.

    >>> Layout(2, 1, 2, 4, ((0, 4), (4, 9))).label()
    't1p2d1 1f1b b2 m4'
    >>> Layout(2, 1, 2, 4, ((0, 4), (4, 9)), checkpoint_layers=True).label()
    't1p2d1 1f1b +ckpt b2 m4'
    >>> Layout(2, 1, 2, 4, ((0, 4), (4, 9)), selective_recompute=True).label()
    't1p2d1 1f1b +sel b2 m4'
    >>> Layout(2, 1, 2, 4, ((0, 3), (3, 5), (5, 7), (7, 9)), ScheduleKind.INTERLEAVED, chunks=2, engine=Engine.TORCH).label()
    't1p2d1 interleaved b2 m4 v2 torch'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator

from pipectl.artifacts.plan import Candidate, Engine
from pipectl.schedule.ir import ScheduleKind


@dataclass(frozen=True)
class Layout:
    """How the ranks split the work: the runnable part of a plan candidate."""

    pipeline_parallel: int
    data_parallel: int
    micro_batch_size: int
    micro_batches: int
    stage_layers: tuple[tuple[int, int], ...]
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    recompute: bool = False  # whole-stage recomputation: the schedule's R actions
    tensor_parallel: int = 1
    chunks: int = 1
    # Heterogeneous plans: (micro_batch_size, micro_batches) of every data-parallel replica, in
    # replica order; None when every replica does micro_batch_size x micro_batches.
    replica_shares: tuple[tuple[int, int], ...] | None = None
    # Per-layer activation checkpointing: each layer of every stage recomputes its forward inside
    # its backward (`Candidate.checkpoint_layers`); the schedule has no R actions for it.
    checkpoint_layers: bool = False
    # What runs it: DeepSpeed's pipeline engine, or PyTorch's pipelining runtime (`Candidate.engine`
    # torch: `runtime.engines.torch_pipeline.TorchPipelineEngine`). Older manifests: deepspeed.
    engine: Engine = Engine.DEEPSPEED
    # Selective recomputation: every transformer block recomputes its attention core inside its
    # backward (`Candidate.selective_recompute`). Older manifests: false.
    selective_recompute: bool = False

    @classmethod
    def from_candidate(cls, candidate: Candidate) -> "Layout":
        return cls(
            pipeline_parallel=candidate.pipeline_parallel,
            data_parallel=candidate.data_parallel,
            micro_batch_size=candidate.micro_batch_size,
            micro_batches=candidate.micro_batches,
            stage_layers=tuple((int(a), int(b)) for a, b in candidate.stage_layers),
            schedule=candidate.schedule,
            recompute=candidate.recompute,
            tensor_parallel=candidate.tensor_parallel,
            chunks=candidate.chunks,
            replica_shares=(
                tuple((r.micro_batch_size, r.micro_batches) for r in sorted(candidate.replicas, key=lambda r: r.replica))
                if candidate.replicas
                else None
            ),
            checkpoint_layers=candidate.checkpoint_layers,
            engine=Engine.TORCH if candidate.engine is Engine.TORCH else Engine.DEEPSPEED,
            selective_recompute=candidate.selective_recompute,
        )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def global_batch(self) -> int:
        if self.replica_shares:
            return sum(b * m for b, m in self.replica_shares)
        return self.data_parallel * self.micro_batch_size * self.micro_batches

    def replica_share(self, replica: int) -> tuple[int, int]:
        """(micro_batch_size, micro_batches) of data-parallel replica `replica`."""
        if self.replica_shares:
            return self.replica_shares[replica]
        return self.micro_batch_size, self.micro_batches

    def label(self) -> str:
        """e.g. 't1p2d1 1f1b b2 m4' (metrics lines carry it); a torch-engine layout adds its chunks
        and engine: 't1p2d1 interleaved b2 m4 v2 torch'."""
        torch = (f" v{self.chunks}" if self.chunks > 1 else "") + " torch" if self.engine is Engine.TORCH else ""
        recompute = f" {mark}" if (mark := recompute_mark(self)) else ""
        if self.replica_shares:
            return (f"t{self.tensor_parallel}p{self.pipeline_parallel}d{self.data_parallel} {self.schedule.value}"
                    f"{recompute} {_shares_label(self.replica_shares)}{torch}")  # fmt: skip
        return (
            f"t{self.tensor_parallel}p{self.pipeline_parallel}d{self.data_parallel} "
            f"{self.schedule.value}{recompute} b{self.micro_batch_size} m{self.micro_batches}{torch}"
        )


# What a layout recomputes, as one word (simulate's JSON) and as its mark in labels and tables.
RECOMPUTE_MARKS = {"stage": "+R", "layer": "+ckpt", "selective": "+sel"}


def recomputed(layout: Any) -> str | None:
    """'stage' (whole-stage recompute), 'layer' (per-layer checkpointing), 'selective' (the
    attention cores) or None, of anything with a layout's three flags (a `Layout`, a `Candidate`)."""
    if layout.recompute:
        return "stage"
    if layout.checkpoint_layers:
        return "layer"
    return "selective" if layout.selective_recompute else None


def recompute_mark(layout: Any) -> str:
    """'+R', '+ckpt', '+sel' or '' (`recomputed`)."""
    return RECOMPUTE_MARKS.get(recomputed(layout) or "", "")


def _shares_label(shares: tuple[tuple[int, int], ...]) -> str:
    """The replicas' (b, m) in replica order, a run of equal ones counted: 'b1 m6+5*2' (one replica
    of 6 micro-batches, two of 5), '2x3+1x4*2' where b differs; as long as the kinds of share, not
    the replicas (27 replicas: 'b1 m57*24+56*3').

        >>> _shares_label(((1, 6), (1, 5), (1, 5))), _shares_label(((2, 3), (1, 4), (1, 4)))
        ('b1 m6+5*2', '2x3+1x4*2')
    """
    runs: list[list] = []
    for share in shares:
        if runs and runs[-1][0] == share:
            runs[-1][1] += 1
        else:
            runs.append([share, 1])
    counted = lambda n: f"*{n}" if n > 1 else ""  # noqa: E731
    if len({b for b, _ in shares}) == 1:
        return f"b{shares[0][0]} m" + "+".join(f"{m}{counted(n)}" for (_, m), n in runs)
    return "+".join(f"{b}x{m}{counted(n)}" for (b, m), n in runs)


# The replicas' shares as labels were written before they were counted: '1x6+1x5+1x5'.
_SHARE_LIST = re.compile(r"\d+x\d+(?:\+\d+x\d+)+")


def canonical_label(label: str) -> str:
    """A layout label as `Layout.label` writes it now: an uneven layout's shares listed one by one
    (metrics and morph records of runs written before they were counted) become counted, so that a
    run trained across the change compares its layouts as one.

        >>> canonical_label("t1p1d3 1f1b 1x6+1x5+1x5"), canonical_label("t1p2d1 1f1b b2 m4")
        ('t1p1d3 1f1b b1 m6+5*2', 't1p2d1 1f1b b2 m4')
    """
    words = label.split(" ")
    for index, word in enumerate(words):
        if _SHARE_LIST.fullmatch(word):
            shares = tuple(tuple(int(n) for n in share.split("x")) for share in word.split("+"))
            words[index] = _shares_label(shares)  # type: ignore[arg-type]
    return " ".join(words)


# A layout label read from a file: canonical (`canonical_label`).
LayoutLabel = Annotated[str, AfterValidator(canonical_label)]


def layout_label(candidate: Candidate) -> str:
    """The label the worker writes into metrics.jsonl for this candidate, e.g. 't1p2d1 1f1b b2 m4'."""
    return Layout.from_candidate(candidate).label()
