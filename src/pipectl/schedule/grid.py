"""A schedule as a step × rank grid of action texts, with offending cells marked.

Used in every `ScheduleError` about an order (the way PyTorch's `_format_pipeline_order` shows a
pipeline), so a broken schedule can be read at a glance:

    >>> from pipectl.schedule.ir import Action, Schedule, ScheduleKind
    >>> acts = {0: tuple(map(Action.parse, "0F0 0B0".split())), 1: tuple(map(Action.parse, "1B0 1F0".split()))}
    >>> print(format_grid(Schedule(ScheduleKind.GPIPE, 2, 1, 1, acts), {1: 0}))
    step  rank 0  rank 1
       0  0F0     *1B0*   <-- here
       1  0B0     1F0
"""

from __future__ import annotations

from collections.abc import Mapping

from pipectl.schedule.ir import Schedule

_CONTEXT_ROWS = 4
_FULL_GRID_ROWS = 40


def format_grid(schedule: Schedule, marks: Mapping[int, int] | None = None) -> str:
    """Rows are per-rank step indices, columns ranks; `marks` maps rank -> step to flag.

    Long schedules show only the rows near the marks (and the first rows when nothing is marked).
    """
    marks = dict(marks or {})
    ranks = sorted(schedule.actions)
    rows = max((len(schedule.actions[r]) for r in ranks), default=0)
    cells = {
        (step, rank): (f"*{action}*" if marks.get(rank) == step else str(action))
        for rank in ranks
        for step, action in enumerate(schedule.actions[rank])
    }
    width = max([len(c) for c in cells.values()] + [len(f"rank {r}") for r in ranks] + [1])
    marked_rows = sorted(set(marks.values()))
    if rows <= _FULL_GRID_ROWS:
        shown = list(range(rows))
    else:
        wanted: set[int] = set()
        for row in marked_rows or [0]:
            wanted.update(range(max(row - _CONTEXT_ROWS, 0), min(row + _CONTEXT_ROWS + 1, rows)))
        shown = sorted(wanted)
    step_width = max(len(str(rows)), 4)
    lines = ["step".rjust(step_width) + "  " + "  ".join(f"rank {r}".ljust(width) for r in ranks)]
    previous = -1
    for row in shown:
        if row != previous + 1:
            lines.append("...".rjust(step_width))
        line = str(row).rjust(step_width) + "  " + "  ".join(
            cells.get((row, r), "").ljust(width) for r in ranks
        )
        if row in marked_rows:
            line += "  <-- here"
        lines.append(line.rstrip() if row not in marked_rows else line)
        previous = row
    if shown and shown[-1] != rows - 1:
        lines.append("...".rjust(step_width))
    return "\n".join(lines)
