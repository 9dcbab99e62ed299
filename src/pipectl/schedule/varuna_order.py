"""Varuna's order (Athlur et al., EuroSys 2022, §3.2; docs/design.md, 'Schedules and the bubble'): the definition.

Varuna derives its static schedule from a simulation of one step with uniform stage times: one
forward takes T_f, one backward T_b, one recompute T_f, and communication is free. Whenever a
stage is idle, it runs the first of these it may:

1. the recompute R(i) of its oldest pending backward i, once F(i) has run here and the next stage
   is known to finish B(i) at a time t with now ≥ t − T_f. t − T_f is the latest start that still
   has the recompute done when the gradient arrives (Varuna's rule 1, t − t' ≥ T_f), and starting
   exactly then keeps the activations alive for the shortest time: an idle stage gets
   t − t' = T_f, the equality the "≥" allows and Varuna's own generator produces. "Known" means
   the next stage started B(i) before now: stages decide together, each from what has happened;
2. after R(i), only B(i), once its gradient has arrived (rule 2: no forward between R(i) and B(i),
   which would hold two micro-batches' activations);
3. otherwise its next forward, once the previous stage's forward of it has ended. A ready
   recompute or backward always goes first (rule 3: backward before forward).

The last stage never recomputes (its backward follows its forward, the activations are still
there): it runs B(i) as soon as F(i) has run here, else its next forward. Forwards, and
backwards, each run in micro-batch order.

`pipectl.schedule.generators.varuna` turns this order into a `Schedule`. The planner reads the
same order in a compact, periodic form (`pipectl.plan.fast.varuna_flags`) that its tests hold
equal to this one.

    >>> ["".join(f"{a.kind.value}{a.microbatch}" for a in order) for order in varuna_order(3, 4)]
    ['F0F1F2F3R0B0R1B1R2B2R3B3', 'F0F1F2R0B0R1B1R2B2F3R3B3', 'F0B0F1B1F2B2F3B3']
"""

from __future__ import annotations

import math
from fractions import Fraction

from pipectl.errors import ScheduleError
from pipectl.schedule.ir import Action, ActionKind

__all__ = ["varuna_order"]

F, B, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE
_NEVER = math.inf  # the end of an action that has not started
RATIO_DENOMINATOR = 10**6  # the backward/forward ratio, as an exact fraction of at most this denominator


class _Stage:
    """One stage's progress in the derivation."""

    def __init__(self, micro_batches: int) -> None:
        self.next_forward = 0  # micro-batch of its next forward
        self.next_backward = 0  # micro-batch of its oldest pending backward
        self.recomputed = False  # R(next_backward) has run
        self.free_at: Fraction = Fraction(0)  # when its current action ends
        self.forward_end = [_NEVER] * micro_batches
        self.backward_end = [_NEVER] * micro_batches
        self.order: list[Action] = []


def varuna_order(
    pipeline_parallel: int, micro_batches: int, forward_seconds: float = 1.0, backward_seconds: float = 2.0
) -> list[list[Action]]:
    """Each stage's F, R and B actions of one step, in Varuna's order (see the module docstring).

    Only the ratio of the two stage times matters. The derivation runs in exact rational time
    (T_f = 1, T_b the ratio to within 1e-6): its rules compare moments for equality (a recompute is
    due exactly T_f before a backward ends), which float sums of measured times (3 x 0.001 against
    0.001 + 0.002) would break at random. The caller checks the degrees and that both times are
    positive.

        >>> varuna_order(4, 5, 0.001, 0.002) == varuna_order(4, 5, 1.0, 2.0)
        True
    """
    p, m = pipeline_parallel, micro_batches
    tf = Fraction(1)
    tb = Fraction(backward_seconds / forward_seconds).limit_denominator(RATIO_DENOMINATOR)
    stages = [_Stage(m) for _ in range(p)]
    now = Fraction(0)
    while any(stage.next_backward < m for stage in stages):
        # Every idle stage chooses from the state before this moment, then they all start.
        chosen = [
            (s, kind) for s, stage in enumerate(stages)
            if stage.free_at <= now and stage.next_backward < m
            for kind in [_choice(stages, s, now, tf, m)] if kind is not None
        ]  # fmt: skip
        for s, kind in chosen:
            _start(stages[s], s, kind, now, tf if kind is not B else tb)
        now = _next_moment(stages, now, tf, m)
    return [stage.order for stage in stages]


def _choice(stages: list[_Stage], s: int, now: Fraction, tf: Fraction, m: int) -> ActionKind | None:
    """What idle stage s runs now, by the rules of the module docstring (None: it waits)."""
    stage = stages[s]
    i = stage.next_backward
    if s == len(stages) - 1:
        if stage.forward_end[i] <= now:
            return B
    elif stage.recomputed:
        return B if stages[s + 1].backward_end[i] <= now else None  # rule 2
    elif stage.forward_end[i] <= now and stages[s + 1].backward_end[i] - tf <= now:
        return R  # rule 1
    j = stage.next_forward
    if j < m and (s == 0 or stages[s - 1].forward_end[j] <= now):
        return F
    return None


def _start(stage: _Stage, s: int, kind: ActionKind, now: Fraction, seconds: Fraction) -> None:
    stage.free_at = now + seconds
    if kind is F:
        microbatch = stage.next_forward
        stage.forward_end[microbatch] = stage.free_at
        stage.next_forward += 1
    elif kind is R:
        microbatch = stage.next_backward
        stage.recomputed = True
    else:
        microbatch = stage.next_backward
        stage.backward_end[microbatch] = stage.free_at
        stage.next_backward += 1
        stage.recomputed = False
    stage.order.append(Action(s, kind, microbatch))


def _next_moment(stages: list[_Stage], now: Fraction, tf: Fraction, m: int) -> Fraction:
    """The next time a choice can change: a stage frees up, or a recompute falls due (T_f before
    the end of a backward the previous stage waits for)."""
    moments = [stage.free_at for stage in stages if stage.free_at > now]
    for stage, following in zip(stages, stages[1:]):
        if stage.next_backward < m:
            due = following.backward_end[stage.next_backward] - tf
            if now < due < _NEVER:
                moments.append(due)
    if not moments:  # pragma: no cover - every stage has a next action or a neighbour to wait for
        raise ScheduleError(f"Varuna schedule derivation stalled at t={now} (p={len(stages)}, m={m})")
    return min(moments)
