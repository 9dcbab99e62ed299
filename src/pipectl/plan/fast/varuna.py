"""Step time of Varuna's schedule in one pass over flat per-stage arrays, without building actions.

The event-driven simulator (`simulate.py`) builds the schedule's actions, a topological order of
them and a compiled dependency table before its longest-path pass; for Varuna at the planner's
sizes (thousands of micro-batches, tens of stages) that preparation outweighs the pass. Here
the order is read in its compact form (`varuna_flags.forward_flags`: per stage, forward or
recompute+backward, both in micro-batch order) and the same recurrence is evaluated directly:

    end(action) = max(end of the previous action on the rank, end of its dependency + transfer)
                  + duration

with F(s, i) depending on F(s−1, i) and B(s, i) on B(s+1, i) (R has no cross-stage input). A stage
runs its list until its next action needs an input its neighbour has not produced yet, and is
resumed when the neighbour gets there (Kahn's algorithm, as in `pipectl.schedule.dag`). Every
floating-point operation is the simulator's, in the same order, except where repeating or
steadily drifting cycles of the order are skipped (`_run_with_cycle_jump`,
`pipectl.plan.fast.periodic`): the step time equals the simulation's to rounding (the tests
hold it to 1e-12 relative on random non-uniform costs).

    >>> from pipectl.plan.simulate import simulate
    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> from pipectl.schedule import ScheduleKind, generate
    >>> costs = uniform_costs(3, 1, 1.0, 2.0, send=0.25)
    >>> summary(3, 8, costs).step_seconds == simulate(generate(ScheduleKind.VARUNA, 3, 8), costs).step_seconds
    True
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from pipectl.plan.fast import varuna_flags
from pipectl.plan.fast.periodic import PERIOD_ULPS, LinearRegime
from pipectl.plan.simulate import StepSummary

__all__ = ["step_seconds", "summary"]


def step_seconds(pipeline_parallel: int, micro_batches: int, costs) -> float:
    """The step time `simulate_step_seconds(generate(VARUNA, p, m), costs)` gives (no jitter)."""
    return summary(pipeline_parallel, micro_batches, costs).step_seconds


def summary(pipeline_parallel: int, micro_batches: int, costs) -> StepSummary:
    """Step time, idle fraction and exposed communication per rank, as `simulate` reports them.

    `costs` is a checked `pipectl.plan.stage_costs.StageCosts` with p virtual stages and no jitter.
    """
    p, m = pipeline_parallel, micro_batches
    last_stage = p - 1
    flags = varuna_flags.forward_flags(p, m)
    run = _Run(p, m, flags, costs)
    cycle = varuna_flags.cycle(p)
    if cycle is not None:
        try:
            _run_with_cycle_jump(run, flags, *cycle)
        finally:
            run.margins = None  # the rest of the order runs without recording
    run.advance([len(order) for order in flags])
    last, exposed = run.last, run.exposed
    forward, backward, recompute = run.forward, run.backward, run.recompute
    # All-reduce after the rank's last backward, then the optimizer step (as `simulate`).
    allreduce = list(costs.allreduce_seconds)
    optimizer = list(costs.optimizer_seconds)
    ends = [(end + allreduce[s]) + optimizer[s] for s, end in enumerate(last)]
    step = max(ends)
    busy = [
        m * (forward[s] + backward[s]) + (m * recompute[s] if s < last_stage else 0.0) + allreduce[s] + optimizer[s]
        for s in range(p)
    ]
    idle = [max(step - b, 0.0) for b in busy]
    exposed = [e + allreduce[s] for s, e in enumerate(exposed)]
    return StepSummary(
        step_seconds=step,
        bubble_fraction=tuple(i / step if step > 0 else 0.0 for i in idle),
        communication_seconds=max(exposed),
        communication_seconds_per_rank=tuple(exposed),
    )


class _Run:
    """The evaluation state: per stage, its position in its order, the ends its neighbours read."""

    def __init__(self, p: int, m: int, flags, costs) -> None:
        self.p, self.m, self.flags = p, m, flags
        self.forward = list(costs.forward_seconds)
        self.backward = list(costs.backward_seconds)
        self.recompute = list(costs.recompute_seconds)
        self.send_forward = list(costs.send_forward_seconds)
        self.send_backward = list(costs.send_backward_seconds)
        self.forward_end = [[0.0] * m for _ in range(p)]
        self.backward_end = [[0.0] * m for _ in range(p)]
        self.forwards_done = [0] * p
        self.backwards_done = [0] * p
        self.head = [0] * p
        self.last = [0.0] * p  # end of the stage's latest action
        self.exposed = [0.0] * p
        self.margins: list[list[float]] | None = None  # per stage, every max's margin, when set

    def advance(self, stop: list[int]) -> bool:
        """Run every stage s up to position stop[s] of its order; False if one could not get there
        (it needs an action beyond a neighbour's stop)."""
        p, flags = self.p, self.flags
        last_stage = p - 1
        forward, backward, recompute = self.forward, self.backward, self.recompute
        send_forward, send_backward = self.send_forward, self.send_backward
        forward_end, backward_end = self.forward_end, self.backward_end
        forwards_done, backwards_done = self.forwards_done, self.backwards_done
        head, last, exposed = self.head, self.last, self.exposed
        margins = self.margins
        waiting_for = [-1] * p  # the neighbour a stopped stage waits for
        runnable = list(range(p - 1, -1, -1))
        while runnable:
            s = runnable.pop()
            waiting_for[s] = -1
            order = flags[s]
            position = head[s]
            end_time = last[s]
            own_forward_ends = forward_end[s]
            own_backward_ends = backward_end[s]
            progressed = False
            limit = stop[s]
            while position < limit:
                if order[position]:
                    j = forwards_done[s]
                    if s > 0:
                        if forwards_done[s - 1] <= j:
                            waiting_for[s] = s - 1
                            break
                        produced = forward_end[s - 1][j]
                        ready = produced + send_forward[s - 1]
                        start = end_time if end_time > ready else ready
                        waited_from = end_time if end_time > produced else produced
                        if start > waited_from:
                            exposed[s] += start - waited_from
                        if margins is not None:
                            margins[s].extend((end_time - ready, end_time - produced, start - waited_from))
                    else:
                        start = end_time if end_time > 0.0 else 0.0
                    end_time = start + forward[s]
                    own_forward_ends[j] = end_time
                    forwards_done[s] = j + 1
                else:
                    i = backwards_done[s]
                    if s < last_stage:
                        if backwards_done[s + 1] <= i:
                            waiting_for[s] = s + 1
                            break
                        # R(s, i) right before B(s, i): no cross-stage input, starts when the rank is free.
                        free = (end_time if end_time > 0.0 else 0.0) + recompute[s]
                        produced = backward_end[s + 1][i]
                        ready = produced + send_backward[s]
                        start = free if free > ready else ready
                        waited_from = free if free > produced else produced
                        if start > waited_from:
                            exposed[s] += start - waited_from
                        if margins is not None:
                            margins[s].extend((free - ready, free - produced, start - waited_from))
                    else:
                        start = end_time if end_time > 0.0 else 0.0
                    end_time = start + backward[s]
                    own_backward_ends[i] = end_time
                    backwards_done[s] = i + 1
                position += 1
                progressed = True
            head[s] = position
            last[s] = end_time
            if progressed:
                for neighbour in (s - 1, s + 1):
                    if 0 <= neighbour < p and waiting_for[neighbour] == s:
                        waiting_for[neighbour] = -1
                        runnable.append(neighbour)
        return all(head[s] >= stop[s] for s in range(p))

    def live_state(self) -> list[float]:
        """The values later actions read: each rank's last end, the forward ends the next stage
        has not consumed, the backward ends the previous stage has not consumed."""
        p = self.p
        state = list(self.last)
        for s in range(p - 1):
            state.extend(self.forward_end[s][self.forwards_done[s + 1]: self.forwards_done[s]])
        for s in range(1, p):
            state.extend(self.backward_end[s][self.backwards_done[s - 1]: self.backwards_done[s]])
        return state

    def shift(self, cycles: int, forwards_per_cycle: int, advance, exposed: list[float]) -> None:
        """Skip `cycles` cycles: every live end moves q·cycles micro-batches on and later by its
        entry of `advance` (laid out as `live_state`)."""
        p = self.p
        moved = cycles * forwards_per_cycle
        entry = 0
        for s in range(p):
            self.head[s] += 2 * moved
            self.last[s] += advance[entry]
            self.exposed[s] += exposed[s]
            entry += 1
        for s in range(p - 1):
            ends = self.forward_end[s]
            for j in range(self.forwards_done[s + 1], self.forwards_done[s]):
                ends[j + moved] = ends[j] + advance[entry]
                entry += 1
        for s in range(1, p):
            ends = self.backward_end[s]
            for i in range(self.backwards_done[s - 1], self.backwards_done[s]):
                ends[i + moved] = ends[i] + advance[entry]
                entry += 1
        for s in range(p):
            self.forwards_done[s] += moved
            self.backwards_done[s] += moved


def _run_with_cycle_jump(run: _Run, flags, starts: tuple[int, ...], q: int) -> None:
    """Evaluate cycle by cycle until the live state repeats shifted by a constant, then skip.

    Cycle k of every stage needs only actions of cycles up to k (`varuna_flags.cycle`), so the live
    state after cycle k is a max-plus linear function of the one after cycle k − 1, the same
    function every cycle (same order, same costs per micro-batch). Once x(k) = x(k − c) + λ in
    every entry it stays so (max-plus homogeneity; see `pipectl.plan.fast.periodic`), and the cycles up
    to the last one inside the periodic part of every stage's order are skipped by adding λ.
    Before that, stretches where each entry grows at its own fixed rate are skipped up to where
    a max could change its choice (`periodic.LinearRegime`, margins recorded per stage).
    """
    p, m = run.p, run.m
    # The order of stage s is periodic from starts[s] up to its m-th forward.
    periodic_end = _after_forwards(p, m)
    last_cycle = min((periodic_end[s] - starts[s]) // (2 * q) for s in range(p)) if q > 0 else 0
    if last_cycle < 4:
        return
    if not run.advance(list(starts)):
        return
    history: list[tuple[np.ndarray, list[float]]] = []
    depth = max(2 * p, 16)
    regime: LinearRegime | None = None
    k = 0
    while k < last_cycle:
        k += 1
        run.margins = regime.margins if regime is not None else None
        if not run.advance([starts[s] + 2 * q * k for s in range(p)]):
            return
        state = np.asarray(run.live_state())
        exposed = list(run.exposed)
        found = _repeat(state, history)
        if found is not None:
            c, seconds = found
            earlier_exposed = history[-c][1]
            cycles_left = (last_cycle - k) // c
            if cycles_left > 0:
                run.shift(cycles_left * c, q, [cycles_left * seconds] * len(state),
                          [cycles_left * (now - then) for now, then in zip(exposed, earlier_exposed)])
            return
        if regime is not None:
            jump = regime.observe(k, state, np.asarray(exposed), last_cycle)
            if jump is not None:
                cycles, advance, exposed_advance = jump
                run.shift(cycles * regime.cycle, q, advance.tolist(), exposed_advance.tolist())
                k += cycles * regime.cycle
                history.clear()
                regime = None
                continue
            if regime.done:
                regime = None
        else:
            c = _linear(state, history)
            if c is not None:
                regime = LinearRegime(k, c, state, np.asarray(exposed), streams=p)
        history.append((state, exposed))
        if len(history) > depth:
            history.pop(0)




@lru_cache(maxsize=256)
def _after_forwards(p: int, m: int) -> tuple[int, ...]:
    """Per stage: the position right after its m-th forward in `varuna_flags.forward_flags(p, m)`."""
    return tuple(len(order) - _trailing_backwards(order) for order in varuna_flags.forward_flags(p, m))


def _trailing_backwards(order) -> int:
    """Backwards after the last forward of an order."""
    count = 0
    for is_forward in reversed(order):
        if is_forward:
            break
        count += 1
    return count


def _repeat(current: np.ndarray, history) -> tuple[int, float] | None:
    """(c, λ) for the smallest c with current = history[-c] + λ in every entry, to rounding."""
    if not history:
        return None
    earlier = np.stack([entry[0] for entry in reversed(history)])  # row c - 1 is history[-c]
    differences = current[None, :] - earlier
    shifts = differences[:, 0]
    tolerance = PERIOD_ULPS * float(np.spacing(np.max(np.abs(current))))
    uniform = np.max(np.abs(differences - shifts[:, None]), axis=1) <= tolerance
    if not uniform.any():
        return None
    c = int(np.argmax(uniform)) + 1
    return c, float(shifts[c - 1])


def _linear(current: np.ndarray, history) -> int | None:
    """The smallest c with current − history[-c] = history[-c] − history[-2c], to rounding."""
    tolerance = 2 * PERIOD_ULPS * float(np.spacing(np.max(np.abs(current))))
    for c in range(1, len(history) // 2 + 1):
        middle, first = history[-c][0], history[-2 * c][0]
        if len(middle) == len(first) == len(current) and np.max(np.abs(current - 2 * middle + first)) <= tolerance:
            return c
    return None
