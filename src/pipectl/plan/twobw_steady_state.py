"""PipeDream-2BW's time and memory across steps (Narayanan et al., "Memory-Efficient
Pipeline-Parallel DNN Training", ICML 2021, §3.1): its order (`schedule.twobw`, 1F1B without a
flush, an update per m micro-batches, two weight versions per stage) played by an event simulation.

* **Time.** Updates are local, so nothing waits for a flush: in steady state every stage makes one
  update per m micro-batches, m (t_f + t_b) with uniform stages and free communication, and the
  slowest stage's m · max_s(t_f,s + t_b,s) with unequal stages and free communication, against
  (m + p − 1)(t_f + t_b) per step for 1F1B with a flush. The first update still pays the pipeline
  fill. `two_bw_steady_state` measures these with the event simulation below (the timing rules of
  `pipectl.plan.simulate`: a rank runs its list in order, transfers are edge delays that overlap
  compute; the update, all-reduce and optimizer step, takes its time on its stage only).
* **Memory.** Two weight versions (2 × the stage's parameter bytes), plus the activations of the
  micro-batches in flight: p − s on stage s once past the first step (1F1B's warm-up + 1, and
  no flush to empty the pipe), `TwoBWSteadyState.peak_in_flight`.

Worked example, p = 2 stages, m = 2 micro-batches per update, a run of three updates:

    >>> run = simulate_two_bw_run(2, 2, 3, forward_seconds=1.0, backward_seconds=2.0)
    >>> [run.forward_versions[i] for i in range(6)] == [weight_version(i + 1, 2) for i in range(6)]
    True
    >>> run.forward_versions == run.backward_versions, run.run_seconds, 3 * (2 + 2 - 1) * 3.0
    (True, 21.0, 27.0)
    >>> state = two_bw_steady_state(2, 2, forward_seconds=1.0, backward_seconds=2.0)
    >>> state.update_seconds, state.first_update_seconds, state.flushed_step_seconds
    (6.0, 9.0, 9.0)
    >>> state.peak_in_flight, [row.text for row in state.version_rows(3)]
    ((2, 1), ['k 1-2: version 0 -> U1', 'k 3-4: version 0 -> U2', 'k 5-6: version 1 -> U3'])
    >>> two_bw_memory(state, parameter_bytes=[100, 100], activation_bytes=[10, 10])
    (TwoBWMemory(stage=0, weight_bytes=200, in_flight=2, activation_bytes=20), TwoBWMemory(stage=1, weight_bytes=200, in_flight=1, activation_bytes=10))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipectl.errors import ScheduleError
from pipectl.schedule.generators import weight_version
from pipectl.schedule.twobw import BACKWARD, FORWARD, RECOMPUTE, TwoBWOp, UPDATE, check_micro_batches, two_bw_order


class TwoBWEvent(NamedTuple):
    """One timed operation. `version`: the weight version it used (F/R/B) or made (U)."""

    stage: int
    op: TwoBWOp
    start: float
    end: float
    version: int


@dataclass(frozen=True)
class TwoBWRun:
    """A simulated run of `updates` updates: every operation's times and versions."""

    pipeline_parallel: int
    micro_batches: int
    updates: int
    events: tuple[TwoBWEvent, ...]  # in an execution order that respects every dependency
    update_ends: tuple[tuple[float, ...], ...]  # [stage][j - 1]: when stage's update j ends
    run_seconds: float  # the last operation's end (the run's drain included)
    # micro-batch (0-based) -> the version its forward / backward read, the same on every stage
    forward_versions: dict[int, int]
    backward_versions: dict[int, int]
    peak_in_flight: tuple[int, ...]  # per stage: micro-batches forwarded, not yet backwarded

    def stage_events(self, stage: int) -> list[TwoBWEvent]:
        return [e for e in self.events if e.stage == stage]


def _per_stage(name: str, value: float | Sequence[float], count: int) -> tuple[float, ...]:
    values = (float(value),) * count if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if len(values) != count:
        raise ScheduleError(f"{name} needs {count} values (one per stage or boundary), got {len(values)}")
    if any(not v >= 0 for v in values):
        raise ScheduleError(f"{name} must be >= 0 seconds, got {values}")
    return values


class _WeightBuffers:
    """Every stage's double weight buffer as a 2BW run plays it, what each micro-batch's forward and
    backward read, and the micro-batches in flight (`simulate_two_bw_run`)."""

    def __init__(self, pipeline_parallel: int, micro_batches: int) -> None:
        p = pipeline_parallel
        self.micro_batches = micro_batches
        self.buffers: dict[int, list[int | None]] = {s: [0, None] for s in range(p)}
        self.newest = dict.fromkeys(range(p), 0)
        self.buffer_of: dict[tuple[int, int], int] = {}
        self.versions_f: dict[tuple[int, int], int] = {}
        self.versions_b: dict[tuple[int, int], int] = {}
        self.in_flight = dict.fromkeys(range(p), 0)
        self.peak = dict.fromkeys(range(p), 0)

    def play(self, s: int, op: TwoBWOp) -> int:
        """Run `op` on stage s's buffers: the version it used (F/R/B) or made (U)."""
        buffers = self.buffers[s]
        if op.kind == UPDATE:
            slot = 1 - buffers.index(self.newest[s])
            buffers[slot] = op.index
            self.newest[s] = version = op.index
        elif op.kind == FORWARD:
            wanted = weight_version(op.index + 1, self.micro_batches)
            if wanted not in buffers:
                raise ScheduleError(
                    f"stage {s} runs F{op.index} (micro-batch k={op.index + 1}), which needs weight version "
                    f"{wanted}, while it holds versions {[v for v in buffers if v is not None]}"
                )
            self.buffer_of[(s, op.index)] = buffers.index(wanted)
            self.versions_f[(s, op.index)] = version = wanted
            self.in_flight[s] += 1
            self.peak[s] = max(self.peak[s], self.in_flight[s])
        else:
            version = buffers[self.buffer_of[(s, op.index)]]  # type: ignore[assignment]
            if op.kind == BACKWARD:
                self.versions_b[(s, op.index)] = version
                self.in_flight[s] -= 1
        return version


def simulate_two_bw_run(
    pipeline_parallel: int,
    micro_batches: int,
    updates: int,
    *,
    forward_seconds: float | Sequence[float],
    backward_seconds: float | Sequence[float],
    recompute_seconds: float | Sequence[float] | None = None,
    send_forward_seconds: float | Sequence[float] = 0.0,
    send_backward_seconds: float | Sequence[float] = 0.0,
    update_seconds: float | Sequence[float] = 0.0,
    recompute: bool = False,
) -> TwoBWRun:
    """Time a run of `updates` updates and play each stage's double weight buffer.

    Costs are per stage (a number means every stage), per micro-batch; sends per boundary s → s+1;
    `update_seconds` is a stage's update (all-reduce + optimizer step). An operation starts when the
    stage's previous one has ended and, for F(s, i), F(s−1, i) has ended plus the activation
    transfer; for B(s, i), B(s+1, i) plus the gradient transfer.

    Versions: stage buffers start as [version 0, empty]. F(s, i) looks up the buffer holding
    `weight_version(i + 1, m)`; R and B read whatever that buffer holds when they run. U j writes
    version j into the buffer not holding version j − 1. A version that is not there when F needs
    it is a `ScheduleError`; a backward that finds another version is recorded as such.
    """
    p, m = pipeline_parallel, micro_batches
    orders = two_bw_order(p, m, updates, recompute)
    forward = _per_stage("forward_seconds", forward_seconds, p)
    backward = _per_stage("backward_seconds", backward_seconds, p)
    recomputed = forward if recompute_seconds is None else _per_stage("recompute_seconds", recompute_seconds, p)
    send_f = _per_stage("send_forward_seconds", send_forward_seconds, p - 1)
    send_b = _per_stage("send_backward_seconds", send_backward_seconds, p - 1)
    update = _per_stage("update_seconds", update_seconds, p)
    durations = {FORWARD: forward, BACKWARD: backward, RECOMPUTE: recomputed, UPDATE: update}

    ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) of F and B
    waiting: dict[tuple[str, int, int], int] = {}
    heads = dict.fromkeys(range(p), 0)
    clock = dict.fromkeys(range(p), 0.0)
    weights = _WeightBuffers(p, m)
    events: list[TwoBWEvent] = []
    runnable = list(reversed(range(p)))
    while runnable:
        s = runnable.pop()
        ops = orders[s]
        while heads[s] < len(ops):
            op = ops[heads[s]]
            ready = clock[s]
            needed = None
            if op.kind == FORWARD and s > 0:
                needed, delay = (FORWARD, s - 1, op.index), send_f[s - 1]
            elif op.kind == BACKWARD and s < p - 1:
                needed, delay = (BACKWARD, s + 1, op.index), send_b[s]
            if needed is not None:
                if needed not in ends:
                    waiting[needed] = s
                    break
                ready = max(ready, ends[needed] + delay)
            end = ready + durations[op.kind][s]
            version = weights.play(s, op)
            events.append(TwoBWEvent(s, op, ready, end, version))
            clock[s] = end
            heads[s] += 1
            if op.kind in (FORWARD, BACKWARD):
                key = (op.kind, s, op.index)
                ends[key] = end
                woken = waiting.pop(key, None)
                if woken is not None:
                    runnable.append(woken)
    stuck = [s for s in range(p) if heads[s] < len(orders[s])]
    if stuck:  # cannot happen for the 1F1B order; kept so a broken order never passes silently
        raise ScheduleError(f"2BW order deadlocks at stages {stuck}")

    def across_stages(per_stage: dict[tuple[int, int], int], what: str) -> dict[int, int]:
        merged: dict[int, int] = {}
        for (s, i), v in sorted(per_stage.items()):
            if merged.setdefault(i, v) != v:
                raise ScheduleError(f"micro-batch {i}'s {what} uses version {merged[i]} on stage 0, {v} on stage {s}")
        return merged

    update_ends = tuple(
        tuple(e.end for e in events if e.stage == s and e.op.kind == UPDATE) for s in range(p)
    )
    return TwoBWRun(
        pipeline_parallel=p,
        micro_batches=m,
        updates=updates,
        events=tuple(events),
        update_ends=update_ends,
        run_seconds=max(e.end for e in events),
        forward_versions=across_stages(weights.versions_f, "forward"),
        backward_versions=across_stages(weights.versions_b, "backward"),
        peak_in_flight=tuple(weights.peak[s] for s in range(p)),
    )


class VersionRow(NamedTuple):
    """Micro-batches first..last (1-based k) of one update window and the versions they used."""

    first: int
    last: int
    forward_version: int
    backward_version: int
    update: int  # the update their accumulated gradients make

    @property
    def text(self) -> str:
        version = (
            f"version {self.forward_version}"
            if self.forward_version == self.backward_version
            else f"forward version {self.forward_version}, backward version {self.backward_version}"
        )
        return f"k {self.first}-{self.last}: {version} -> U{self.update}"


@dataclass(frozen=True)
class TwoBWSteadyState:
    """2BW's figures for given stage times, measured on a simulated run (`two_bw_steady_state`)."""

    pipeline_parallel: int
    micro_batches: int
    update_seconds: float  # steady state: time between two updates (m micro-batches), slowest stage
    first_update_seconds: float  # every stage has made update 1: the pipeline fill included
    flushed_step_seconds: float  # one step of the same order with a flush (1F1B, PipeDream-Flush)
    peak_in_flight: tuple[int, ...]  # per stage, past the first step
    run: TwoBWRun  # the simulated run the figures come from
    transient_updates: int  # updates skipped before measuring update_seconds
    averaged_updates: int  # intervals update_seconds is the mean of

    def seconds_for(self, updates: int) -> float:
        """Time to `updates` updates from the start: the fill, then the steady state."""
        return self.first_update_seconds + (updates - 1) * self.update_seconds

    def version_rows(self, updates: int = 3) -> list[VersionRow]:
        """Per update window of the first `updates`: micro-batches k, the versions they used."""
        m, run = self.micro_batches, self.run
        rows = []
        for j in range(1, min(updates, run.updates) + 1):
            window = range((j - 1) * m, j * m)
            forward = {run.forward_versions[i] for i in window}
            backward = {run.backward_versions[i] for i in window}
            if len(forward) != 1 or len(backward) != 1:  # 2BW switches versions at window boundaries only
                raise ScheduleError(f"update window {j} mixes versions: forward {forward}, backward {backward}")
            rows.append(VersionRow((j - 1) * m + 1, j * m, forward.pop(), backward.pop(), j))
        return rows


# Events simulated for a steady state at most (about 10 µs each): p=64, m=64 fits the full window.
MAX_STEADY_STATE_EVENTS = 400_000
TRANSIENT_UPDATES = 8  # skipped before measuring: enough in every case tried (tests/schedule/test_twobw.py)
AVERAGED_UPDATES = 12  # intervals averaged: with communication, intervals can alternate (period 2, 3, ...)


def steady_state_window(
    pipeline_parallel: int, micro_batches: int, recompute: bool = False,
    max_events: int | None = MAX_STEADY_STATE_EVENTS,
) -> tuple[int, int] | None:
    """(T, K): the updates `two_bw_steady_state` skips and the intervals it averages, for a run of
    T + K + 1 updates of at most `max_events` events (None: no limit); None when not even three
    updates fit. T = 8, K = 12 when the whole run fits, else half of the run's intervals to settle
    and half measured. The planner's figure (`pipectl.plan.fast.twobw`) reads the same window.

    >>> steady_state_window(4, 8), steady_state_window(64, 512), steady_state_window(64, 512, max_events=None)
    ((8, 12), (3, 2), (8, 12))
    >>> steady_state_window(128, 1024) is None
    True
    """
    p, m = pipeline_parallel, micro_batches
    full = TRANSIENT_UPDATES + AVERAGED_UPDATES + 1
    if max_events is None:
        return TRANSIENT_UPDATES, AVERAGED_UPDATES
    events_per_update = (3 if recompute else 2) * p * m + p
    total = min(full, max_events // events_per_update)
    if total < 3:
        return None
    if total == full:
        return TRANSIENT_UPDATES, AVERAGED_UPDATES
    averaged = (total - 1) // 2  # a shorter run: half of it to settle, half measured
    return total - 1 - averaged, averaged


def two_bw_steady_state(
    pipeline_parallel: int,
    micro_batches: int,
    *,
    forward_seconds: float | Sequence[float],
    backward_seconds: float | Sequence[float],
    recompute_seconds: float | Sequence[float] | None = None,
    send_forward_seconds: float | Sequence[float] = 0.0,
    send_backward_seconds: float | Sequence[float] = 0.0,
    update_seconds: float | Sequence[float] = 0.0,
    recompute: bool = False,
) -> TwoBWSteadyState:
    """Simulate a run long enough to reach the steady state and read 2BW's figures off it.

    The run has T + K + 1 updates; updates 1..T+K come before the run's final drain (their
    backwards all precede it, as m ≥ p − 1), so they are the values of an endless run. The
    steady-state time is the mean interval between updates T..T+K, the largest over stages
    (T = 8, K = 12, fewer when p × m is large: `transient_updates`, `averaged_updates`). With
    uniform stages, or free communication, every interval is already equal; with communication
    they can alternate, and the mean is the rate. The flushed step is a run of one update.
    """
    p, m = pipeline_parallel, micro_batches
    check_micro_batches(p, m)
    window = steady_state_window(p, m, recompute)
    if window is None:
        events_per_update = (3 if recompute else 2) * p * m + p
        raise ScheduleError(
            f"p={p} x m={m} is too large to simulate 2BW's steady state here "
            f"({3 * events_per_update:,} events, more than {MAX_STEADY_STATE_EVENTS:,})",
            hint="with uniform stages and free communication it is m (t_f + t_b) per update",
        )
    transient, averaged = window
    total = transient + averaged + 1
    costs = dict(
        forward_seconds=forward_seconds, backward_seconds=backward_seconds, recompute_seconds=recompute_seconds,
        send_forward_seconds=send_forward_seconds, send_backward_seconds=send_backward_seconds,
        update_seconds=update_seconds, recompute=recompute,
    )  # fmt: skip
    run = simulate_two_bw_run(p, m, total, **costs)  # type: ignore[arg-type]
    if run.forward_versions != run.backward_versions:
        bad = next(i for i in run.forward_versions if run.forward_versions[i] != run.backward_versions[i])
        raise ScheduleError(
            f"micro-batch k={bad + 1} ran forward with version {run.forward_versions[bad]} and backward with "
            f"{run.backward_versions[bad]}"
        )
    flushed = simulate_two_bw_run(p, m, 1, **costs)  # type: ignore[arg-type]
    ends = run.update_ends  # ends[s][j - 1]: update j
    last = transient + averaged
    return TwoBWSteadyState(
        pipeline_parallel=p,
        micro_batches=m,
        update_seconds=max((ends[s][last - 1] - ends[s][transient - 1]) / averaged for s in range(p)),
        first_update_seconds=max(ends[s][0] for s in range(p)),
        flushed_step_seconds=flushed.run_seconds,
        peak_in_flight=run.peak_in_flight,
        run=run,
        transient_updates=transient,
        averaged_updates=averaged,
    )


class TwoBWMemory(NamedTuple):
    """A stage's 2BW-specific memory: the two weight versions and the activations in flight."""

    stage: int
    weight_bytes: int  # 2 x the stage's parameter bytes
    in_flight: int  # micro-batches holding activations at the peak
    activation_bytes: int | None  # in_flight x one micro-batch's activations (None: not known)


def two_bw_memory(
    state: TwoBWSteadyState, parameter_bytes: Sequence[int], activation_bytes: Sequence[int] | None = None
) -> tuple[TwoBWMemory, ...]:
    """Per stage: 2 × its parameter bytes, and its peak in-flight micro-batches × `activation_bytes`
    (one micro-batch's saved activations on that stage, if given)."""
    p = state.pipeline_parallel
    if len(parameter_bytes) != p or (activation_bytes is not None and len(activation_bytes) != p):
        raise ScheduleError(f"parameter and activation bytes need one value per stage ({p})")
    return tuple(
        TwoBWMemory(
            stage=s,
            weight_bytes=2 * int(parameter_bytes[s]),
            in_flight=state.peak_in_flight[s],
            activation_bytes=None if activation_bytes is None else state.peak_in_flight[s] * int(activation_bytes[s]),
        )
        for s in range(p)
    )


__all__ = [
    "TwoBWEvent",
    "TwoBWMemory",
    "TwoBWRun",
    "TwoBWSteadyState",
    "VersionRow",
    "simulate_two_bw_run",
    "steady_state_window",
    "two_bw_memory",
    "two_bw_steady_state",
]
