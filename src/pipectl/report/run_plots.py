"""Pictures of a run: the loss curve and predicted vs measured step time (matplotlib, Agg)."""

from __future__ import annotations

import os
from pathlib import Path

from pipectl.artifacts.run import StepMetrics
from pipectl.errors import UserInputError
from pipectl.report import PICTURE_FORMATS


def plot_run(metrics: list[StepMetrics], path: str | os.PathLike[str], *, title: str = "") -> Path:
    """Two panels: loss per step; measured and predicted step seconds per step. Returns the path.

    Layout changes (resizes) are marked with vertical lines, so a continuous loss curve across a
    resize is visible at a glance.
    """
    import matplotlib  # only when plotting: the CLI starts without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    if not metrics:
        raise UserInputError("the run has no metrics yet: nothing to plot")
    if path.suffix.lower() not in PICTURE_FORMATS:
        raise UserInputError(f"plot file {path} must end in .png, .svg or .pdf")
    steps = [m.step for m in metrics]
    fig, (loss_ax, time_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    loss_ax.plot(steps, [m.loss for m in metrics], marker="o", markersize=3, label="loss")
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    time_ax.plot(steps, [m.step_seconds * 1e3 for m in metrics], marker="o", markersize=3, label="measured")
    predicted = [(m.step, m.predicted_step_seconds * 1e3) for m in metrics if m.predicted_step_seconds]
    if predicted:
        time_ax.plot(*zip(*predicted), linestyle="--", label="predicted")
    time_ax.set_ylabel("step time (ms)")
    time_ax.set_xlabel("step")
    time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 2.5
    time_ax.grid(alpha=0.3)
    time_ax.legend()
    for previous, current in zip(metrics, metrics[1:]):
        if current.layout != previous.layout:
            for ax in (loss_ax, time_ax):
                ax.axvline(current.step - 0.5, color="grey", linestyle=":")
            loss_ax.annotate(current.layout, (current.step - 0.5, loss_ax.get_ylim()[1]), fontsize=7, va="top")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
