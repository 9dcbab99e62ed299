"""`pipectl calibrate RUN [RUN ...] -o calibrated.json`: the runs' profile fitted to what they measured."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from pipectl.cli.context import JsonFlag, console, output_file, print_json, refuse_overwriting
from pipectl.io import write_json_atomic


def register(app: typer.Typer) -> None:
    """Add `pipectl calibrate` to the root app."""

    @app.command("calibrate")
    def calibrate_command(
        runs: Annotated[list[Path], typer.Argument(help="Run directories (runs/NAME) planned from one measured profile.")],
        output: Annotated[
            Path, typer.Option("--output", "-o", help="Where to write the calibrated profile.", callback=output_file)
        ] = Path("calibrated.json"),
        json_output: JsonFlag = False,
    ) -> None:
        """Fit the profile the runs were planned from (its engine terms: host slowdowns, forward and
        backward scale, end of step, hand-off between ranks) to the phases the runs measured, and
        write it; plan with it to predict the layouts not run."""
        from pipectl.profile.calibrate import calibrate  # torch-free, but the simulator: only when asked

        refuse_overwriting(output, {})  # a run's files: calibrate reads every one of them

        profile, report = calibrate(runs)
        write_json_atomic(output, profile)
        if json_output:
            print_json({
                "output": str(output),
                "runs": [
                    {"run": r.run, "layout": r.layout, "measured_step_seconds": r.measured_step_seconds,
                     "predicted_before": r.predicted_before, "predicted_after": r.predicted_after}
                    for r in report.runs
                ],
                "fitted": {name: {"before": a, "after": b} for name, (a, b) in report.fitted.items()},
            })  # fmt: skip
            return
        runs_table = Table(title="step time per run, ms", box=box.SIMPLE, title_justify="left")
        for column in ("run", "layout", "measured", "predicted before", "after"):
            runs_table.add_column(column, justify="right" if column not in ("run", "layout") else "left")
        for r in report.runs:
            runs_table.add_row(
                Path(r.run).name, r.layout, f"{r.measured_step_seconds * 1e3:.2f}",
                f"{r.predicted_before * 1e3:.2f} ({r.error_before:.1%})", f"{r.predicted_after * 1e3:.2f} ({r.error_after:.1%})",
            )  # fmt: skip
        terms = Table(title="engine terms fitted", box=box.SIMPLE, title_justify="left")
        for column in ("term", "before", "after"):
            terms.add_column(column, justify="left" if column == "term" else "right")
        for name, (before, after) in report.fitted.items():
            terms.add_row(name, f"{before:.4g}", f"{after:.4g}")
        console.print(runs_table)
        console.print(terms)
        console.print(f"wrote {output}: plan with it (pipectl plan --profile {output} ...) to predict other layouts")
