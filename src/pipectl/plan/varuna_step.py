"""Step time of Varuna's schedule in one pass over flat per-stage arrays, without building actions.

The event-driven simulator (`simulate.py`) builds the schedule's actions, a topological order of
them and a compiled dependency table before its longest-path pass; for Varuna at the planner's
sizes (thousands of micro-batches, tens of stages) that preparation costs seconds per (p, m). Here
the order is read in its compact form (`varuna_forward_flags`: per stage, forward or
recompute+backward, both in micro-batch order) and the same recurrence is evaluated directly:

    end(action) = max(end of the previous action on the rank, end of its dependency + transfer)
                  + duration

with F(s, i) depending on F(s−1, i) and B(s, i) on B(s+1, i) (R has no cross-stage input). A stage
runs its list until its next action needs an input its neighbour has not produced yet, and is
resumed when the neighbour gets there (Kahn's algorithm, as in `pipectl.schedule.dag`). Every
floating-point operation is the simulator's, in the same order, so the step time is identical
(the tests hold it to 1e-12 relative on random non-uniform costs).

    >>> from pipectl.plan.simulate import simulate, uniform_costs
    >>> from pipectl.schedule import ScheduleKind, generate
    >>> costs = uniform_costs(3, 1, 1.0, 2.0, send=0.25)
    >>> summary(3, 8, costs).step_seconds == simulate(generate(ScheduleKind.VARUNA, 3, 8), costs).step_seconds
    True
"""

from __future__ import annotations

from pipectl.plan.waves import StepSummary
from pipectl.schedule.generators import varuna_forward_flags

__all__ = ["step_seconds", "summary"]


def step_seconds(pipeline_parallel: int, micro_batches: int, costs) -> float:
    """The step time `simulate_step_seconds(generate(VARUNA, p, m), costs)` gives (no jitter)."""
    return summary(pipeline_parallel, micro_batches, costs).step_seconds


def summary(pipeline_parallel: int, micro_batches: int, costs) -> StepSummary:
    """Step time, idle fraction and exposed communication per rank, as `simulate` reports them.

    `costs` is a checked `pipectl.plan.simulate.StageCosts` with p virtual stages and no jitter.
    """
    p, m = pipeline_parallel, micro_batches
    last_stage = p - 1
    flags = varuna_forward_flags(p, m)
    forward = list(costs.forward_seconds)
    backward = list(costs.backward_seconds)
    recompute = list(costs.recompute_seconds)
    send_forward = list(costs.send_forward_seconds)
    send_backward = list(costs.send_backward_seconds)
    forward_end = [[0.0] * m for _ in range(p)]
    backward_end = [[0.0] * m for _ in range(p)]
    forwards_done = [0] * p
    backwards_done = [0] * p
    head = [0] * p
    last = [0.0] * p  # end of the stage's latest action
    exposed = [0.0] * p
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
        while position < len(order):
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
