"""Where a run's step goes, predicted against measured, per pipeline stage (`pipectl status`):
the table of `rundir.analysis.PhaseComparison`, with the phase furthest from its prediction named.
"""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from pipectl.plan.phases import CHECKPOINT_COPY, PHASES
from pipectl.report.tables import format_seconds_ms
from pipectl.rundir.analysis import PhaseComparison


def _unit(comparison: PhaseComparison) -> tuple[str, float]:
    """One unit for the whole table and what seconds are divided by to write them with
    `format_seconds_ms`: ms, or s where a phase lasts 10 s or more."""
    figures = [v for s in comparison.stages for v in (*s.predicted, *s.measured, s.unaccounted) if v is not None]
    return ("s", 1e3) if max(figures, default=0.0) >= 10 else ("ms", 1.0)


# Column headings short enough for the phases in 100 columns; the caption says what they hold.
_HEADINGS = {"pipeline waits": "waits", "gradient reductions": "reduce", CHECKPOINT_COPY: "ckpt"}


def _shown(comparison: PhaseComparison) -> list[int]:
    """The phases the table shows: all but the checkpoint copy where no step waited for one (a CPU
    run, whose copies are taken between steps, or a run without checkpoints): five phases fit 100
    columns, six only with shorter figures."""
    index = PHASES.index(CHECKPOINT_COPY)
    waited = any((s.measured[index] or 0.0) > 0 for s in comparison.stages)
    return [k for k in range(len(PHASES)) if k != index or waited]


def _steps(comparison: PhaseComparison) -> str:
    """"steps 2-12", or "7 steps of t1p2d1 between 2 and 12" when another layout ran between."""
    first, last = comparison.steps
    if comparison.count in (0, last - first + 1):
        return f"steps {first}-{last}"
    return f"{comparison.count} steps of {comparison.layout} between {first} and {last}"


def phase_table(comparison: PhaseComparison) -> Table:
    """Per stage two rows, each phase predicted, then measured (ms, or s for long steps), what no
    phase covers, and the phase furthest from its prediction: a figure per cell, so that the
    phases fit 100 columns whatever the figures."""
    unit, divisor = _unit(comparison)
    shown = _shown(comparison)

    def figure(seconds: float | None) -> str:
        return "-" if seconds is None else format_seconds_ms(seconds / divisor)

    table = Table(
        title=f"where the step goes, {unit} (medians over {_steps(comparison)})",
        box=box.SIMPLE,
        title_justify="left",
        caption_justify="left",
    )
    table.add_column("stage", justify="right")
    table.add_column("")
    for k in shown:
        table.add_column(_HEADINGS.get(PHASES[k], PHASES[k]), justify="right")
    table.add_column("other", justify="right")
    table.add_column("furthest off")
    for s in comparison.stages:
        table.add_row(str(s.stage), "predicted", *(figure(s.predicted[k]) for k in shown), "", "")
        table.add_row("", "measured", *(figure(s.measured[k]) for k in shown), figure(s.unaccounted),
                      _HEADINGS.get(s.furthest, s.furthest), end_section=True)  # fmt: skip
    checkpoint = ("ckpt: the optimizer step's wait for a checkpoint's copies to host memory (mean over the "
                  "steps); " if PHASES.index(CHECKPOINT_COPY) in shown else "")  # fmt: skip
    table.caption = (
        "waits: sends and receives, waiting for peers included (bubble and transfers); reduce: the tied and "
        f"data-parallel gradient reductions at the end of the step; {checkpoint}other: measured time no phase covers; "
        "furthest off: the phase furthest from its prediction"
        + "".join(f"; predicted with {escape(path)} as it is now: it changed since planning" for path in comparison.changed)
    )
    return table
