"""ZB-H1's step time without building the schedule: the simulator's longest path, walked directly.

The planner times zb-h1 candidates of hundreds of micro-batches on tens of stages, a new (p, m)
for nearly every one (the morph table's device counts give new d, hence new m). Simulating one
(`pipectl.plan.simulate`) costs a generated `Schedule` and its compiled DAG per (p, m), far more
than the timing pass itself. Here each rank's order is the one
`pipectl.schedule.generators.zb_h1` generates, as (kind, micro-batch) pairs from the same
arithmetic (1F1B's warm-up of min(p − s − 1, m) forwards, F/I pairs, W(i) after I(i + d),
d = min(s, m), the d W's left closing the step), and the ranks are advanced in turn as far as
their inputs exist, each action ending at

    max(end of the rank's previous action, end of its input + transfer) + duration

with the simulator's operations in the simulator's order (I = fraction × B, W = B − I; the
all-reduce, then the optimizer step), so the step, and the summary's idle and exposed
communication per rank, are the simulated ones exactly: tests/plan/fast/test_zero_bubble.py holds
them equal on random costs. Asynchronous transfers and no jitter only (`pipectl.plan.timing` simulates the others).

    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> step_seconds(4, 8, uniform_costs(4, 1, 1.0, 2.0))  # m (f + b) + (p − 1)(f + I − W)
    27.0
"""

from __future__ import annotations

from functools import lru_cache

from pipectl.errors import ScheduleError
from pipectl.plan.simulate import StepSummary

__all__ = ["rank_orders", "step_seconds", "summary"]

FORWARD, INPUT, WEIGHT = 0, 1, 2


@lru_cache(maxsize=1024)
def rank_orders(pipeline_parallel: int, micro_batches: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, its compute order as (kind, micro-batch): `zb_h1`'s order (kind 0 F, 1 I, 2 W).

    >>> rank_orders(2, 2)[1]
    ((0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1))
    """
    p, m = pipeline_parallel, micro_batches
    orders = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        delay = min(s, m)
        order = [(FORWARD, i) for i in range(warmup)]

        def backward(i: int) -> None:
            order.append((INPUT, i))
            if i >= delay:
                order.append((WEIGHT, i - delay))

        for i in range(m - warmup):
            order.append((FORWARD, warmup + i))
            backward(i)
        for i in range(m - warmup, m):
            backward(i)
        order.extend((WEIGHT, i) for i in range(m - delay, m))
        orders.append(tuple(order))
    return tuple(orders)


def step_seconds(pipeline_parallel: int, micro_batches: int, costs) -> float:
    """The step time `simulate(generate(ScheduleKind.ZB_H1, p, m), costs)` gives (no jitter,
    asynchronous transfers), from `rank_orders` (see the module docstring)."""
    return _walk(pipeline_parallel, micro_batches, costs)[0]


def summary(pipeline_parallel: int, micro_batches: int, costs) -> StepSummary:
    """`simulate(...).summary()` of the same step: per rank its idle fraction (step − busy, busy
    counting the all-reduce and the optimizer step) and its exposed communication (the part of
    each wait for an input after its producer had finished, then the all-reduce), as
    `pipectl.plan.simulate.timeline_of` computes them from the same sums."""
    step, busy, exposed = _walk(pipeline_parallel, micro_batches, costs)
    idle = [max(step - b, 0.0) for b in busy]
    return StepSummary(
        step_seconds=step,
        bubble_fraction=tuple(i / step if step > 0 else 0.0 for i in idle),
        communication_seconds=max(exposed, default=0.0),
        communication_seconds_per_rank=tuple(exposed),
    )


def _walk(pipeline_parallel: int, micro_batches: int, costs) -> tuple[float, list[float], list[float]]:
    """(step, busy seconds per rank, exposed communication per rank), summed in rank order as
    `simulate` sums them."""
    p, m = pipeline_parallel, micro_batches
    forward = costs.forward_seconds
    fraction = costs.backward_input_fraction
    inputs = [b * fraction for b in costs.backward_seconds]  # as `simulate._split_backward`
    weights = [b - i for b, i in zip(costs.backward_seconds, inputs)]
    send_forward, send_backward = costs.send_forward_seconds, costs.send_backward_seconds
    orders = rank_orders(p, m)
    forward_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    input_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    free = [0.0] * p
    busy = [0.0] * p
    exposed = [0.0] * p
    position = [0] * p
    remaining = p
    while remaining:
        moved = False
        for s in range(p):
            order, k = orders[s], position[s]
            if k == len(order):
                continue
            end = free[s]
            rank_busy, rank_exposed = busy[s], exposed[s]
            while k < len(order):
                kind, i = order[k]
                if kind == FORWARD:
                    duration = forward[s]
                    if s > 0:
                        producer = forward_end[s - 1][i]
                        if producer is None:
                            break
                        ready = producer + send_forward[s - 1]
                        start = end if end > ready else ready
                        waiting_since = end if end > producer else producer
                        if start > waiting_since:  # waiting for the transfer: exposed
                            rank_exposed += start - waiting_since
                    else:
                        start = end if end > 0.0 else 0.0
                    end = start + duration
                    forward_end[s][i] = end
                elif kind == INPUT:
                    duration = inputs[s]
                    if s < p - 1:
                        producer = input_end[s + 1][i]
                        if producer is None:
                            break
                        ready = producer + send_backward[s]
                        start = end if end > ready else ready
                        waiting_since = end if end > producer else producer
                        if start > waiting_since:
                            rank_exposed += start - waiting_since
                    else:
                        start = end if end > 0.0 else 0.0
                    end = start + duration
                    input_end[s][i] = end
                else:
                    duration = weights[s]
                    end = (end if end > 0.0 else 0.0) + duration
                rank_busy += duration
                k += 1
            busy[s], exposed[s] = rank_busy, rank_exposed
            moved = moved or k > position[s]
            free[s], position[s] = end, k
            if k == len(order):
                remaining -= 1
        if not moved:  # zb_h1's order never deadlocks; a change that broke it must not loop
            raise ScheduleError(f"zb-h1 order for p={p}, m={m} deadlocks")
    # the all-reduce, then the optimizer step, on each rank after its last action
    step = 0.0
    for s, (last, allreduce, optimizer) in enumerate(zip(free, costs.allreduce_seconds, costs.optimizer_seconds)):
        reduced = (last if last > 0.0 else 0.0) + allreduce
        stepped = (reduced if reduced > 0.0 else 0.0) + optimizer
        step = stepped if stepped > step else step
        busy[s] = busy[s] + allreduce + optimizer
    for s, allreduce in enumerate(costs.allreduce_seconds):
        exposed[s] += allreduce  # after every wait, as `simulate` adds it
    return step, busy, exposed
