"""PipeDream-2BW's steady state for `pipectl simulate`: times, weight versions, stashed memory.

Built from `pipectl.plan.twobw_steady_state.TwoBWSteadyState`; the numbers are that module's simulation,
this module only lays them out (a JSON payload and Rich renderables).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pipectl.report.tables import format_bytes
from pipectl.plan.twobw_steady_state import TwoBWMemory, TwoBWSteadyState

# The rows of the version table: the first three updates show the 1-step staleness settling in.
VERSION_ROWS = 3
# Updates in the "time for N updates" comparison.
COMPARED_UPDATES = 10

SEMANTICS = (
    "2BW changes the optimizer: each update applies gradients computed on the weights one version "
    "back, W(t+1) = W(t) - lr * grad f(W(t-1)) (1-stale), not the synchronous step of 1f1b or gpipe."
)
RUNTIME = (
    "pipectl's runtime (DeepSpeed's pipeline engine) flushes the pipeline every step and keeps one weight "
    "version, so it cannot run 2BW: `pipectl launch` refuses a plan that chose it (plan and simulate only)."
)


def _in_flight_text(in_flight: Sequence[int]) -> str:
    """'4 3 2 1 (p - s)'; long pipelines as first, second, ..., last."""
    p = len(in_flight)
    shown = " ".join(str(c) for c in in_flight) if p <= 8 else f"{in_flight[0]} {in_flight[1]} ... {in_flight[-1]}"
    return shown + (" (p - s on stage s)" if list(in_flight) == [p - s for s in range(p)] else "")


def _update_formula(update: int, version: int) -> str:
    return f"W{update} = W{update - 1} - lr*grad f(W{version})"


def two_bw_payload(
    state: TwoBWSteadyState | None, memory: Sequence[TwoBWMemory] | None, notes: Sequence[str] = ()
) -> dict[str, Any]:
    """The `two_bw` part of `pipectl simulate --json` (`state` None: the steady state could not be
    simulated, and `notes` say why)."""
    payload: dict[str, Any] = {
        "weight_versions": 2,
        "changes_optimizer_semantics": True,
        "runnable_by_pipectl_runtime": False,
        "notes": [*notes, SEMANTICS, RUNTIME],
    }
    if state is None:
        return {"steady_state": None, **payload}
    return {
        "steady_state": {
            "update_seconds": state.update_seconds,
            "first_update_seconds": state.first_update_seconds,
            "flushed_step_seconds": state.flushed_step_seconds,
            "measured_over_updates": [state.transient_updates + 1, state.transient_updates + state.averaged_updates],
            "updates_compared": COMPARED_UPDATES,
            "seconds_for_updates": state.seconds_for(COMPARED_UPDATES),
            "flushed_seconds_for_updates": COMPARED_UPDATES * state.flushed_step_seconds,
        },
        "versions": [
            {"first_microbatch": row.first, "last_microbatch": row.last, "forward_version": row.forward_version,
             "backward_version": row.backward_version, "makes_update": row.update}
            for row in state.version_rows(VERSION_ROWS)
        ],  # fmt: skip
        "peak_in_flight": list(state.peak_in_flight),
        "memory": None if memory is None else [entry._asdict() for entry in memory],
        **payload,
    }


def two_bw_report(
    state: TwoBWSteadyState, memory: Sequence[TwoBWMemory] | None, plan_peak_bytes: Sequence[int] | None = None,
    plan_predicted_seconds: float | None = None,
) -> Group:
    """Times next to the flushed step, the micro-batch -> version table, memory, and the two caveats.

    `plan_predicted_seconds`: a 2bw plan's predicted step, which is this steady state per update."""
    m, n = state.micro_batches, COMPARED_UPDATES
    flushed = state.flushed_step_seconds
    predicted = f"; the plan predicted {plan_predicted_seconds:.6g} s" if plan_predicted_seconds else ""
    lines = [
        Text("PipeDream-2BW: no flush between steps, two weight versions per stage", style="bold"),
        Text(
            f"  steady state (no flush): {state.update_seconds:.6g} s per update of {m} micro-batches "
            f"(mean over updates {state.transient_updates + 1}-{state.transient_updates + state.averaged_updates}"
            f"{predicted})"
        ),
        Text(f"  with a flush (1f1b):     {flushed:.6g} s per step"
             + (f"  -> {flushed / state.update_seconds:.3g}x the throughput without it" if state.update_seconds > 0 else "")),
        Text(f"  first update, pipeline fill included: {state.first_update_seconds:.6g} s; "
             f"{n} updates: {state.seconds_for(n):.6g} s without a flush, {n * flushed:.6g} s with one"),
    ]  # fmt: skip
    versions = Table(title="weight versions of micro-batch k (1-based), on every stage", title_justify="left")
    for column, justify in (("micro-batches", "left"), ("forward", "right"), ("backward", "right"),
                            ("their gradients make", "left")):  # fmt: skip
        versions.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in state.version_rows(VERSION_ROWS):
        versions.add_row(
            f"k {row.first}-{row.last}", f"W{row.forward_version}", f"W{row.backward_version}",
            _update_formula(row.update, row.forward_version),
        )  # fmt: skip
    parts: list[Any] = [*lines, versions]
    if memory is None:
        parts.append(Text(
            "  memory: 2 weight versions per stage (2 x its parameter bytes; simulate a PLAN.json for bytes); "
            f"micro-batches in flight per stage: {_in_flight_text(state.peak_in_flight)}"
        ))  # fmt: skip
    else:
        table = Table(title="2BW memory per stage (per device)", title_justify="left")
        columns = ["stage", "2 weight versions", "in flight", "their activations"]
        if plan_peak_bytes is not None:
            columns.append("plan's peak")
        for column in columns:
            table.add_column(column, justify="right")
        for entry in memory:
            cells = [
                str(entry.stage),
                format_bytes(entry.weight_bytes),
                str(entry.in_flight),
                "-" if entry.activation_bytes is None else format_bytes(entry.activation_bytes),
            ]
            if plan_peak_bytes is not None:
                cells.append(format_bytes(plan_peak_bytes[entry.stage]))
            table.add_row(*cells)
        parts.append(table)
    parts.append(Text(SEMANTICS, style="yellow"))
    parts.append(Text(RUNTIME, style="yellow"))
    return Group(*parts)
