"""Gantt charts of a simulated step: a picture (PNG/SVG) and a terminal rendering.

One row per rank, time to the right, one bar per action coloured by kind (forward, backward,
recompute, all-reduce, optimizer step), the micro-batch number on every bar wide enough to hold
it, and later chunks of an interleaved schedule drawn lighter. The title carries the step time and
the mean bubble fraction.

    >>> from pipectl.plan.simulate import simulate
    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> from pipectl.schedule import ScheduleKind, generate
    >>> timeline = simulate(generate(ScheduleKind.ONE_F_ONE_B, 2, 3), uniform_costs(2, 1, 1.0, 2.0))
    >>> for line in terminal_gantt(timeline, width=24).plain.splitlines():
    ...     print(line.rstrip())
    rank 0 F0F1····B0  F2B1  ··B2
    rank 1 ··F0B0  F1B1  F2B2  ····
    F forward, B backward, · idle; F3: micro-batch 3
    step 12 s, bubble 25.0%

matplotlib is imported only when a picture is drawn, through its object API and the Agg canvas
(no pyplot, no global backend switch).
"""

from __future__ import annotations

from pathlib import Path

from rich.text import Text

from pipectl.errors import UserInputError
from pipectl.plan.simulate import Timeline
from pipectl.report import PICTURE_FORMATS
from pipectl.schedule.ir import ActionKind

KIND_COLOURS = {
    ActionKind.FORWARD: "#4C72B0",
    ActionKind.BACKWARD: "#55A868",
    ActionKind.RECOMPUTE: "#DD8452",
    ActionKind.BACKWARD_INPUT: "#64B5CD",  # zero bubble's split backward: input gradient
    ActionKind.BACKWARD_WEIGHT: "#937860",  # and weight gradient
    ActionKind.ALL_REDUCE: "#C44E52",
    ActionKind.OPTIMIZER_STEP: "#8172B3",
}
KIND_LABELS = {
    ActionKind.FORWARD: "forward",
    ActionKind.BACKWARD: "backward",
    ActionKind.RECOMPUTE: "recompute",
    ActionKind.BACKWARD_INPUT: "input gradient",
    ActionKind.BACKWARD_WEIGHT: "weight gradient",
    ActionKind.ALL_REDUCE: "all-reduce",
    ActionKind.OPTIMIZER_STEP: "optimizer step",
}
TERMINAL_LETTERS = {
    ActionKind.FORWARD: "F",
    ActionKind.BACKWARD: "B",
    ActionKind.RECOMPUTE: "R",
    ActionKind.BACKWARD_INPUT: "I",
    ActionKind.BACKWARD_WEIGHT: "W",
    ActionKind.ALL_REDUCE: "A",
    ActionKind.OPTIMIZER_STEP: "S",
}
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def micro_batch_id(number: int) -> str:
    """A micro-batch's number in base 36, as the terminal chart writes it: one character up to 35.

    >>> [micro_batch_id(n) for n in (0, 9, 10, 35, 36, 1295)]
    ['0', '9', 'a', 'z', '10', 'zz']
    """
    digits = ""
    while True:
        number, digit = divmod(number, 36)
        digits = _BASE36[digit] + digits
        if number == 0:
            return digits


def describe(timeline: Timeline) -> str:
    """'step 12 s, bubble 33.3%': the step time (with a readable unit) and the mean bubble."""
    bubble = sum(timeline.bubble_fraction) / max(len(timeline.bubble_fraction), 1)
    return f"step {_seconds(timeline.step_seconds)}, bubble {100 * bubble:.1f}%"


def _seconds(value: float) -> str:
    if value >= 1 or value == 0:
        return f"{value:.4g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.4g} ms"
    return f"{value * 1e6:.4g} us"


def _ranks(timeline: Timeline) -> int:
    return max(len(timeline.bubble_fraction), max((r.rank for r in timeline.records), default=-1) + 1)


def write_gantt(timeline: Timeline, path: str | Path, *, title: str | None = None) -> Path:
    """Draw the step and write it to `path` (.png, .svg or .pdf, chosen by the suffix)."""
    path = Path(path)
    if path.suffix.lower() not in PICTURE_FORMATS:
        raise UserInputError(
            f"Gantt chart file {str(path)!r} must end in .png, .svg or .pdf, not {path.suffix or '(no suffix)'!r}"
        )
    figure = gantt_figure(timeline, title=title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format=path.suffix.lower()[1:], dpi=150, bbox_inches="tight")
    return path


def gantt_figure(timeline: Timeline, *, title: str | None = None):  # -> matplotlib.figure.Figure
    """The chart as a matplotlib `Figure` (Agg canvas attached)."""
    # matplotlib only when drawing: the CLI starts without it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = _ranks(timeline)
    step = timeline.step_seconds or 1.0
    figure = Figure(figsize=(min(6 + 0.08 * len(timeline.records) / max(ranks, 1), 24), 1.0 + 0.55 * ranks))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for record in timeline.records:
        action = record.action
        chunk = action.stage // ranks if action.microbatch is not None else 0
        width = record.end - record.start
        axes.barh(
            record.rank,
            width,
            left=record.start,
            height=0.8,
            color=KIND_COLOURS[action.kind],
            alpha=1.0 if chunk == 0 else 0.55,
            edgecolor="white",
            linewidth=0.5,
        )
        if action.microbatch is not None and width / step > 0.012:
            axes.text(
                record.start + width / 2, record.rank, str(action.microbatch),
                ha="center", va="center", fontsize=7, color="white",
            )
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.invert_yaxis()
    axes.set_xlim(0, step)
    axes.set_xlabel("seconds")
    kinds = [k for k in KIND_COLOURS if any(r.action.kind is k for r in timeline.records)]
    handles = [Patch(color=KIND_COLOURS[k], label=KIND_LABELS[k]) for k in kinds]
    if any(r.action.microbatch is not None and r.action.stage >= ranks for r in timeline.records):
        handles.append(Patch(color=KIND_COLOURS[ActionKind.FORWARD], alpha=0.55, label="later chunks (lighter)"))
    axes.legend(
        handles=handles,
        loc="upper center", bbox_to_anchor=(0.5, -0.25 if ranks > 2 else -0.45), ncol=len(handles), frameon=False,
    )
    heading = describe(timeline)
    axes.set_title(f"{title}: {heading}" if title else heading)
    return figure


def terminal_gantt(timeline: Timeline, width: int = 100) -> Text:
    """One line per rank; each character cell covers step/width seconds.

    A cell shows the action running at its midpoint, in its kind's colour. A bar shows its label
    (kind letter + micro-batch in base 36, e.g. `F3`, `Fb` for micro-batch 11) when it is wide
    enough, else just the kind letter; chunks after the first (interleaved) use lower-case
    letters; '·' is idle. Then a legend line (`legend`), and `describe`.
    """
    if width < 10:
        raise UserInputError(f"terminal Gantt width must be at least 10 characters, got {width}")
    ranks = _ranks(timeline)
    step = timeline.step_seconds
    text = Text()
    label_width = len(f"rank {ranks - 1}")
    kinds: set[ActionKind] = set()
    later_chunks: set[ActionKind] = set()
    numbers: list[int] = []
    narrow = False
    for rank in range(ranks):
        records = sorted(timeline.rank_records(rank), key=lambda r: r.start)
        # which record covers each column's midpoint (None: idle)
        covering: list[int | None] = []
        index = 0
        for column in range(width):
            moment = (column + 0.5) * step / width if step > 0 else 0.0
            while index < len(records) and records[index].end <= moment:
                index += 1
            inside = index < len(records) and records[index].start <= moment
            covering.append(index if inside else None)
        text.append(f"rank {rank}".ljust(label_width) + " ", style="bold")
        column = 0
        while column < width:
            which = covering[column]
            run = 1
            while column + run < width and covering[column + run] == which:
                run += 1
            if which is None:
                text.append("·" * run, style="dim")
            else:
                action = records[which].action
                kinds.add(action.kind)
                letter = TERMINAL_LETTERS[action.kind]
                if action.microbatch is not None and action.stage >= ranks:
                    letter = letter.lower()  # a later chunk of an interleaved schedule
                    later_chunks.add(action.kind)
                label = letter
                if action.microbatch is not None:
                    label += micro_batch_id(action.microbatch)
                    numbers.append(action.microbatch)
                narrow = narrow or len(label) > run
                shown = label.ljust(run) if len(label) <= run else letter.ljust(run)
                text.append(shown, style=f"white on {KIND_COLOURS[action.kind]}")
            column += run
        text.append("\n")
    text.append(legend(kinds, later_chunks, max(numbers, default=None), narrow=narrow) + "\n", style="dim")
    text.append(describe(timeline))
    return text


def legend(kinds: set[ActionKind], later_chunks: set[ActionKind], largest_micro_batch: int | None,
           *, narrow: bool = False) -> str:
    """What the terminal chart's letters mean: the `kinds` it shows, those of them it shows for
    later chunks (lower case), the largest micro-batch number it writes, and whether some bar was
    too narrow for its number.

    >>> legend({ActionKind.FORWARD, ActionKind.BACKWARD}, {ActionKind.BACKWARD}, 12)
    'F forward, B backward, b: later chunks, · idle; F3: micro-batch 3, a-z: 10-35'
    """
    ordered = [k for k in TERMINAL_LETTERS if k in kinds]
    parts = [f"{TERMINAL_LETTERS[k]} {KIND_LABELS[k]}" for k in ordered]
    later = [TERMINAL_LETTERS[k].lower() for k in ordered if k in later_chunks]
    if later:
        parts.append(f"{' '.join(later)}: later chunks")
    parts.append("· idle")
    text = ", ".join(parts)
    if largest_micro_batch is not None:
        text += "; F3: micro-batch 3"
        if largest_micro_batch >= 36:
            text += " (base 36: a-z 10-35, 10 = 36)"
        elif largest_micro_batch >= 10:
            text += ", a-z: 10-35"
    if narrow:
        text += "; a letter alone: too narrow for its number"
    return text
