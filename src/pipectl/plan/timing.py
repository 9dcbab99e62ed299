"""A candidate's step time for the planner: the reference simulation, or a fast path equal to it.

The definition of a step's time is `pipectl.plan.simulate.simulate` run on the schedule the
runtime executes: `generate(kind, p, m, v, recompute)`, with its sends and receives
(`executed_schedule`) when the cost table's transfers block (gloo), since then their order
decides who waits. The planner times thousands of candidates with up to thousands of
micro-batches, so where an exact fast path exists (`pipectl.plan.fast`: no jitter, asynchronous
transfers) it is used instead; each equals the simulation to 1e-12 relative, which its tests
hold. Jittered and blocking cost tables always take the simulation.

PipeDream-2BW. Its candidates are priced in steady state instead, per update of m micro-batches
with no flush (`two_bw_summary_of`): the figure `pipectl.plan.twobw_steady_state.two_bw_steady_state`
defines on the same stage costs, by its own event simulation in reference mode and otherwise by
`pipectl.plan.fast.twobw`, which a test holds equal to it. `step_seconds_of` and `summary_of`
keep timing one flushed step of any kind (2BW's is 1F1B's: the figure its notes compare with).

Reference mode. With the environment variable `PIPECTL_PLAN_REFERENCE=1` every candidate the
planner times is simulated instead (`reference_mode`, read here and nowhere else, by each
`Evaluator` when it is made): slower, for checking that the fast paths change no plan. The
bounds the search prunes with stay on in both modes: they are lower bounds on the simulation
itself (their tests compare them with `simulate`, not with a fast path), so a pruned candidate
could not have entered the ranking or the morph table in either mode.

    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> costs = uniform_costs(4, 1, 1.0, 2.0)
    >>> step_seconds_of(ScheduleKind.GPIPE, 4, 8, 1, False, costs)  # (m + p - 1)(t_f + t_b)
    33.0
    >>> summary_of(ScheduleKind.VARUNA, 4, 8, 1, True, costs, reference=True).step_seconds == (
    ...     summary_of(ScheduleKind.VARUNA, 4, 8, 1, True, costs).step_seconds)
    True
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from pipectl.errors import UserInputError
from pipectl.plan.fast import twobw, varuna, waves, zero_bubble
from pipectl.plan.stage_costs import StageCosts, check_costs
from pipectl.plan.simulate import StepSummary, simulate, simulate_step_seconds, transfers_block
from pipectl.schedule.comm import add_communication
from pipectl.schedule.generators import generate
from pipectl.schedule.ir import Schedule, ScheduleKind
from pipectl.plan.twobw_steady_state import AVERAGED_UPDATES, TRANSIENT_UPDATES, TwoBWSteadyState, steady_state_window, two_bw_steady_state
from pipectl.schedule.twobw import BACKWARD, FORWARD, UPDATE

__all__ = [
    "REFERENCE_ENV",
    "actions_per_step",
    "executed_schedule",
    "reference_mode",
    "step_seconds_of",
    "summary_of",
    "two_bw_summary_of",
]

REFERENCE_ENV = "PIPECTL_PLAN_REFERENCE"


def reference_mode() -> bool:
    """Whether `PIPECTL_PLAN_REFERENCE` asks for every candidate to be simulated (1) or not (0, unset).

    >>> os.environ[REFERENCE_ENV] = "yes"
    >>> reference_mode()
    Traceback (most recent call last):
    ...
    pipectl.errors.UserInputError: PIPECTL_PLAN_REFERENCE must be 0 or 1, got 'yes'
    >>> del os.environ[REFERENCE_ENV]
    """
    value = os.environ.get(REFERENCE_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise UserInputError(f"{REFERENCE_ENV} must be 0 or 1, got {value!r}")


@lru_cache(maxsize=256)
def executed_schedule(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int,
                      recompute: bool) -> Schedule:
    """`generate(...)` with the sends and receives the runtime executes (cached)."""
    schedule = generate(kind, pipeline_parallel, micro_batches, chunks, recompute)
    return add_communication(schedule) if pipeline_parallel > 1 else schedule


def _reference_schedule(kind: ScheduleKind, p: int, m: int, v: int, recompute: bool, costs: StageCosts) -> Schedule:
    """The schedule the reference simulates: with its sends and receives when they block."""
    if transfers_block(p, costs):
        return executed_schedule(kind, p, m, v, recompute)
    return generate(kind, p, m, v, recompute)


def _has_fast_path(kind: ScheduleKind, pipeline_parallel: int, costs: StageCosts) -> bool:
    """Whether `pipectl.plan.fast` times this schedule under these costs (no jitter, no rendezvous)."""
    if transfers_block(pipeline_parallel, costs) or costs.jitter_seconds > 0:
        return False
    return waves.supported(kind, costs.jitter_seconds) or kind in (ScheduleKind.VARUNA, ScheduleKind.ZB_H1)


def step_seconds_of(
    kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int, recompute: bool,
    costs: StageCosts, *, reference: bool = False,
) -> float:
    """The step time of `simulate(generate(kind, p, m, v, recompute), costs)` (see the module
    docstring), by a fast path unless `reference` or none applies.

    GPipe, 1F1B, PipeDream-2BW and interleaved: `pipectl.plan.fast.waves` (GPipe in closed
    form); Varuna: `pipectl.plan.fast.varuna`; zb-h1: `pipectl.plan.fast.zero_bubble`.
    """
    p, m, v = pipeline_parallel, micro_batches, chunks
    check_costs(p, p * v, costs)
    if reference or not _has_fast_path(kind, p, costs):
        return simulate_step_seconds(_reference_schedule(kind, p, m, v, recompute, costs), costs)
    if kind is ScheduleKind.VARUNA:
        return varuna.step_seconds(p, m, costs)
    if kind is ScheduleKind.ZB_H1:
        return zero_bubble.step_seconds(p, m, costs)
    return waves.step_seconds(kind, p, m, v, recompute, costs)


def summary_of(
    kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int, recompute: bool,
    costs: StageCosts, *, reference: bool = False,
) -> StepSummary:
    """Step time, idle fraction and exposed communication of the simulated step, as
    `step_seconds_of` chooses how to compute them."""
    p, m, v = pipeline_parallel, micro_batches, chunks
    check_costs(p, p * v, costs)
    if reference or not _has_fast_path(kind, p, costs):
        return simulate(_reference_schedule(kind, p, m, v, recompute, costs), costs).summary()
    if kind is ScheduleKind.ZB_H1:
        return zero_bubble.summary(p, m, costs)
    if kind is ScheduleKind.VARUNA:
        return varuna.summary(p, m, costs)
    return waves.summary(kind, p, m, v, recompute, costs)


def actions_per_step(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int,
                     recompute: bool) -> int:
    """Timed actions of one step (F, B, R, I, W, AR, STEP), without building the schedule.

    >>> schedule = generate(ScheduleKind.ONE_F_ONE_B, 2, 3, 1, True)
    >>> actions_per_step(ScheduleKind.ONE_F_ONE_B, 2, 3, 1, True), sum(map(len, schedule.actions.values()))
    (19, 19)
    """
    stages = pipeline_parallel * chunks
    recomputing = stages - 1 if (recompute or kind is ScheduleKind.VARUNA) and not kind.splits_backward else 0
    if kind.splits_backward:  # I and W in B's place
        return micro_batches * 3 * stages + 2 * pipeline_parallel
    return micro_batches * (2 * stages + recomputing) + 2 * pipeline_parallel


def two_bw_summary_of(
    pipeline_parallel: int, micro_batches: int, recompute: bool, costs: StageCosts, *, reference: bool = False,
) -> StepSummary:
    """PipeDream-2BW in steady state: the time per update (m micro-batches, no flush), and per
    stage its idle and exposed communication per update, as `summary_of` reports a step's.

    The time is `two_bw_steady_state`'s (its window, `steady_state_window`), the update being
    the stage's all-reduce plus its optimizer step; by its event simulation when `reference`,
    else by `pipectl.plan.fast.twobw` (also where p x m is beyond what the event simulation
    takes: there over the full window, T = 8, K = 12). Jitter and blocking transfers are not
    modelled, as there: transfers are asynchronous edge delays. Idle = update time − the stage's
    busy time (m (t_f + t_b (+ t_r)) + all-reduce + optimizer step); exposed communication = the
    waits for transfers in the window, per update, + the all-reduce. m ≥ p − 1.

    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> summary = two_bw_summary_of(4, 8, False, uniform_costs(4, 1, 1.0, 2.0, allreduce=0.5))
    >>> summary.step_seconds, summary.communication_seconds  # m (t_f + t_b) + the all-reduce
    (24.5, 0.5)
    """
    p, m = pipeline_parallel, micro_batches
    check_costs(p, p, costs)
    window = steady_state_window(p, m, recompute)
    if reference and window is not None:
        state = _two_bw_state(p, m, recompute, costs)
        update, exposed = state.update_seconds, _exposed_per_update(state, costs)
    else:
        fast = twobw.steady_state(p, m, recompute, costs, window or (TRANSIENT_UPDATES, AVERAGED_UPDATES))
        update, exposed = fast.update_seconds, fast.exposed_seconds
    forward = np.asarray(costs.forward_seconds, dtype=float)
    recomputes = np.zeros(p)
    if recompute and p > 1:
        recomputes[: p - 1] = np.asarray(costs.recompute_seconds, dtype=float)[: p - 1]
    allreduce = np.asarray(costs.allreduce_seconds, dtype=float)
    busy = m * (forward + np.asarray(costs.backward_seconds, dtype=float) + recomputes) + allreduce \
        + np.asarray(costs.optimizer_seconds, dtype=float)
    idle = np.maximum(update - busy, 0.0)
    communication = np.asarray(exposed, dtype=float) + allreduce
    return StepSummary(
        step_seconds=update,
        bubble_fraction=tuple((idle / update).tolist()) if update > 0 else (0.0,) * p,
        communication_seconds=float(np.max(communication)),
        communication_seconds_per_rank=tuple(communication.tolist()),
    )


def _two_bw_state(p: int, m: int, recompute: bool, costs: StageCosts) -> TwoBWSteadyState:
    return two_bw_steady_state(
        p, m, forward_seconds=costs.forward_seconds, backward_seconds=costs.backward_seconds,
        recompute_seconds=costs.recompute_seconds, send_forward_seconds=costs.send_forward_seconds,
        send_backward_seconds=costs.send_backward_seconds,
        update_seconds=[a + o for a, o in zip(costs.allreduce_seconds, costs.optimizer_seconds)],
        recompute=recompute,
    )  # fmt: skip


def _exposed_per_update(state: TwoBWSteadyState, costs: StageCosts) -> np.ndarray:
    """Per stage: its waits for transfers between its updates T and T + K of the simulated run,
    per update (the part of a wait after the producer had finished, as `simulate` counts it)."""
    run, p = state.run, state.pipeline_parallel
    first, last = state.transient_updates, state.transient_updates + state.averaged_updates
    ends = {(e.op.kind, e.stage, e.op.index): e.end for e in run.events if e.op.kind in (FORWARD, BACKWARD)}
    exposed = np.zeros(p)
    for s in range(p):
        previous, inside = 0.0, False
        for event in run.stage_events(s):
            kind, index = event.op.kind, event.op.index
            producer = None
            if kind == FORWARD and s > 0:
                producer = ends[(FORWARD, s - 1, index)]
            elif kind == BACKWARD and s < p - 1:
                producer = ends[(BACKWARD, s + 1, index)]
            if inside and producer is not None:
                exposed[s] += max(event.start - max(previous, producer), 0.0)
            previous = event.end
            if kind == UPDATE:
                if index == last:
                    break
                inside = inside or index == first
    return exposed / state.averaged_updates
