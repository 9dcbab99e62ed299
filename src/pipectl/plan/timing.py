"""A candidate's step time for the planner: the reference simulation, or a fast path equal to it.

The definition of a step's time is `pipectl.plan.simulate.simulate` run on the schedule the
runtime executes: `generate(kind, p, m, v, recompute)`, with its sends and receives
(`executed_schedule`) when the cost table's transfers block (gloo), since then their order
decides who waits. The planner times thousands of candidates with up to thousands of
micro-batches, so where an exact fast path exists (`pipectl.plan.fast`: no jitter, asynchronous
transfers) it is used instead; each equals the simulation to 1e-12 relative, which its tests
hold. Jittered and blocking cost tables always take the simulation.

Reference mode. With the environment variable `PIPECTL_PLAN_REFERENCE=1` every candidate the
planner times is simulated instead (`reference_mode`, read here and nowhere else, by each
`Evaluator` when it is made): slower, for checking that the fast paths change no plan. The
bounds the search prunes with stay on in both modes: they are lower bounds on the simulation
itself (their tests compare them with `simulate`, not with a fast path), so a pruned candidate
could not have entered the ranking or the morph table in either mode.

    >>> from pipectl.plan.simulate import uniform_costs
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

from pipectl.errors import UserInputError
from pipectl.plan.fast import varuna, waves
from pipectl.plan.simulate import (
    StageCosts,
    StepSummary,
    check_costs,
    simulate,
    simulate_step_seconds,
    transfers_block,
)
from pipectl.schedule.comm import add_communication
from pipectl.schedule.generators import generate
from pipectl.schedule.ir import Schedule, ScheduleKind

__all__ = [
    "REFERENCE_ENV",
    "actions_per_step",
    "executed_schedule",
    "reference_mode",
    "step_seconds_of",
    "summary_of",
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
    return waves.supported(kind, costs.jitter_seconds) or kind is ScheduleKind.VARUNA


def step_seconds_of(
    kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int, recompute: bool,
    costs: StageCosts, *, reference: bool = False,
) -> float:
    """The step time of `simulate(generate(kind, p, m, v, recompute), costs)` (see the module
    docstring), by a fast path unless `reference` or none applies.

    GPipe, 1F1B, PipeDream-2BW and interleaved: `pipectl.plan.fast.waves` (GPipe in closed
    form); Varuna: `pipectl.plan.fast.varuna`.
    """
    p, m, v = pipeline_parallel, micro_batches, chunks
    check_costs(p, p * v, costs)
    if reference or not _has_fast_path(kind, p, costs):
        return simulate_step_seconds(_reference_schedule(kind, p, m, v, recompute, costs), costs)
    if kind is ScheduleKind.VARUNA:
        return varuna.step_seconds(p, m, costs)
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
    if kind is ScheduleKind.VARUNA:
        return varuna.summary(p, m, costs)
    return waves.summary(kind, p, m, v, recompute, costs)


def actions_per_step(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int,
                     recompute: bool) -> int:
    """Timed actions of one step (F, B, R, AR, STEP), without building the schedule.

    >>> schedule = generate(ScheduleKind.ONE_F_ONE_B, 2, 3, 1, True)
    >>> actions_per_step(ScheduleKind.ONE_F_ONE_B, 2, 3, 1, True), sum(map(len, schedule.actions.values()))
    (19, 19)
    """
    stages = pipeline_parallel * chunks
    recomputing = stages - 1 if recompute or kind is ScheduleKind.VARUNA else 0
    return micro_batches * (2 * stages + recomputing) + 2 * pipeline_parallel
