"""Where a run's step goes, predicted against measured, per pipeline stage (`pipectl status`):
the table of `rundir.analysis.PhaseComparison`, with the phase furthest from its prediction named.
"""

from __future__ import annotations

from rich import box
from rich.table import Table

from pipectl.plan.phases import PHASES
from pipectl.rundir.analysis import PhaseComparison


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def phase_table(comparison: PhaseComparison) -> Table:
    """Per stage: each phase predicted / measured in ms, what no phase covers, and the phase
    furthest from its prediction."""
    table = Table(
        title=f"where the step goes, predicted / measured ms (medians over steps {comparison.steps[0]}-{comparison.steps[1]})",
        box=box.SIMPLE,
        title_justify="left",
    )
    table.add_column("stage", justify="right")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    table.add_column("other", justify="right")
    table.add_column("furthest from its prediction")
    for s in comparison.stages:
        cells = [f"{_ms(p)} / {_ms(m) if m is not None else '-'}" for p, m in zip(s.predicted, s.measured)]
        other = _ms(s.unaccounted) if s.unaccounted is not None else "-"
        table.add_row(str(s.stage), *cells, other, s.furthest)
    table.caption = (
        "pipeline waits: sends and receives, waiting for peers included (bubble and transfers); end of step: "
        "gradient reductions and the optimizer; other: measured time no phase covers"
    )
    return table
