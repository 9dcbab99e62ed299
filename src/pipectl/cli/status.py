"""`pipectl status RUN`: progress, last loss, predicted vs measured step time, checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Group
from rich.table import Table

from pipectl.cli.context import JsonFlag, console, print_json
from pipectl.launch.rundir import RunStatus, run_status


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f} %"


def status_table(status: RunStatus) -> Group:
    """Rich renderables: a summary table and a checkpoint table."""
    summary = Table(box=box.SIMPLE, show_header=False, title=f"run {status.path.name}", title_justify="left")
    summary.add_column(style="bold")
    summary.add_column()
    state = "finished" if status.finished else ("not started" if not status.metrics else "in progress / stopped")
    summary.add_row("model", status.job.model)
    summary.add_row("engine", f"{status.job.engine.value}, {status.job.world_size} ranks")
    summary.add_row("progress", f"{status.steps_done} / {status.job.steps} steps ({state})")
    if status.metrics:
        first, last = status.metrics[0], status.metrics[-1]
        summary.add_row("loss", f"{first.loss:.4f} (step {first.step}) -> {last.loss:.4f} (step {last.step})")
        summary.add_row("throughput", f"{last.samples_per_second:.1f} samples/s (last step)")
    if status.layouts:
        summary.add_row("layout" if len(status.layouts) == 1 else "layouts", " -> ".join(status.layouts))
    prediction = status.prediction
    if prediction is not None:
        summary.add_row(
            "step time",
            f"measured {prediction.median_measured_seconds * 1e3:.1f} ms, "
            f"predicted {prediction.median_predicted_seconds * 1e3:.1f} ms (medians over {prediction.steps} steps)",
        )
        summary.add_row(
            "prediction error",
            f"median {_percent(prediction.median_abs_error)}, max {_percent(prediction.max_abs_error)}",
        )
    parts: list = [summary]
    if status.checkpoints:
        table = Table(box=box.SIMPLE_HEAD, title="checkpoints", title_justify="left")
        for column in ("tag", "step", "state", "size"):
            table.add_column(column)
        for ckpt in status.checkpoints:
            state = "[green]ok[/]" if ckpt.verified else "[red]" + "; ".join(ckpt.problems) + "[/]"
            table.add_row(ckpt.tag, str(ckpt.step if ckpt.step is not None else "?"), state, f"{ckpt.bytes / 1024:.0f} KiB")
        parts.append(table)
    from pipectl.cli.resize import status_renderables

    parts.append(status_renderables(status.path))
    return Group(*parts)


def register(app: typer.Typer) -> None:
    """Add `pipectl status` to the root app."""

    @app.command("status")
    def status_command(
        run_dir: Annotated[Path, typer.Argument(help="The run directory (runs/NAME).")],
        json_output: JsonFlag = False,
        plot: Annotated[
            Path | None, typer.Option("--plot", help="Write a PNG: loss curve and predicted vs measured step time.")
        ] = None,
        verify: Annotated[
            bool, typer.Option("--verify", help="Hash every checkpoint file against its manifest (slower).")
        ] = False,
    ) -> None:
        """Progress, last loss, predicted-vs-measured step time and checkpoints of a run."""
        status = run_status(run_dir, verify_hashes=verify)
        plot_path = None
        if plot is not None:
            from pipectl.report.run_plots import plot_run

            plot_path = plot_run(status.metrics, plot, title=status.path.name)
        if json_output:
            from pipectl.resize.history import read_history

            payload = status.to_dict()
            payload["morphs"] = [record.model_dump(mode="json") for record in read_history(status.path)]
            payload["plot"] = str(plot_path) if plot_path else None
            print_json(payload)
            return
        console.print(status_table(status))
        if plot_path:
            console.print(f"plot written to {plot_path}")
