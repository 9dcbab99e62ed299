"""`pipectl calibrate RUN [RUN ...] -o calibrated.json`: the runs' profile fitted to what they measured."""

from __future__ import annotations

import math
import stat
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from pipectl.cli.context import (
    JsonFlag, console, err_console, into_folder, output_file, print_json, refuse_overwriting, refuse_overwriting_model,
)
from pipectl.artifacts.run import JOB_FILE
from pipectl.errors import PipectlError, UserInputError
from pipectl.io import MAX_MAPPING_BYTES, file_kind, read_mapping, write_json_atomic
from pipectl.artifacts.calibration import DEFAULT_FOLDS


def register(app: typer.Typer) -> None:
    """Add `pipectl calibrate` to the root app."""

    @app.command("calibrate")
    def calibrate_command(
        runs: Annotated[
            list[Path],
            typer.Argument(help="Run directories (runs/NAME) planned from one measured profile; or one CSV of runs "
                           "measured on a cluster (with --conditions).", metavar="RUN_DIR | MEASURED.csv"),
        ],
        conditions: Annotated[
            Path | None,
            typer.Option("--conditions", "-c", help="With a CSV: YAML of what every run shares (as for validate)."),
        ] = None,
        folds: Annotated[
            int, typer.Option("--folds", min=0, help="With a CSV: cross-validation folds (0: none).")
        ] = DEFAULT_FOLDS,
        output: Annotated[
            Path | None,
            typer.Option("--output", "-o", help="Where to write the calibrated profile (runs; default calibrated.json) "
                         "or the calibration (a CSV; default calibration.json).", callback=output_file,
                         parser=into_folder(None)),
        ] = None,
        json_output: JsonFlag = False,
    ) -> None:
        """Fit the profile the runs were planned from (its engine terms: host slowdowns, forward and
        backward scale, end of step, hand-off between ranks) to the phases the runs measured, and
        write it; plan with it to predict the layouts not run. Given a CSV of runs measured on a
        cluster, fit its device, link and engine terms to them instead (`--calibration` of
        validate, profile --derive, plan and simulate)."""
        # A file, a pipe (`<(...)`) or a CSV's name: measured runs; a folder: a run directory.
        files = [run for run in runs if (run.exists() and not run.is_dir()) or run.suffix.lower() == ".csv"]
        if conditions is not None and len(runs) == 1 and not runs[0].exists():
            raise UserInputError(f"{runs[0]}: no such file", hint="pipectl calibrate MEASURED.csv --conditions CONDITIONS.yaml")
        if files == runs and len(runs) == 1:
            _calibrate_measured(runs[0], conditions, folds, output or Path("calibration.json"), json_output)
            return
        if files:  # more than one file, or a file among run directories
            raise UserInputError(f"{files[0]} is a file among {len(runs)} arguments: give one CSV of measured runs "
                                 "(with --conditions), or run directories only",
                                 hint="pipectl calibrate MEASURED.csv --conditions CONDITIONS.yaml; or pipectl calibrate "
                                 "runs/a runs/b")  # fmt: skip
        if conditions is not None:
            raise UserInputError("--conditions goes with a CSV of measured runs, not with run directories")
        _calibrate_runs(runs, output or Path("calibrated.json"), json_output)


def _calibrate_runs(runs: list[Path], output: Path, json_output: bool) -> None:
    from pipectl.profile.calibrate import calibrate  # torch-free, but the simulator: only when asked

    refuse_overwriting(output, {}, writes="ModelProfile")  # a run's files: calibrate reads every one of them
    for run in runs:  # and a run's model: its resume builds it
        refuse_overwriting_model(output, _model_of(run), f"{run} trains")

    profile, report = calibrate(runs)
    write_json_atomic(output, profile)
    error_before = sum(r.error_before for r in report.runs) / len(report.runs)
    error_after = sum(r.error_after for r in report.runs) / len(report.runs)
    if json_output:
        print_json({
            "output": str(output),
            "mean_error_before": error_before,
            "mean_error_after": error_after,
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
    terms = Table(title="engine terms fitted", box=box.SIMPLE, title_justify="left", caption_justify="left")
    for column in ("term", "before", "after"):
        terms.add_column(column, justify="left" if column == "term" else "right")
    for name, (before, after) in report.fitted.items():
        terms.add_row(name, f"{before:.4g}", f"{after:.4g}")
    console.print(runs_table)
    console.print(terms)
    console.print(f"wrote {output}: plan with it (pipectl plan --profile {output} ...) to predict other layouts",
                  markup=False, highlight=False)
    if error_after > error_before:
        # The fit matches each run's phases; a step time its phases do not add up to (a busy host,
        # a run cut short) can leave the steps themselves predicted worse than before.
        _warn(f"the fitted terms predict these runs' step times worse than the profile did (mean error "
              f"{error_before:.1%} -> {error_after:.1%}): their measured phases do not add up to their step "
              "times, as on a busy host; run the layouts again on a quiet host, or keep planning with the "
              "profile as it was")  # fmt: skip


def _readable_twice(path: Path, stack: ExitStack) -> Path:
    """`path`, or where a pipe's bytes were copied (read once, they are parsed and then hashed). Only
    a FIFO is copied, and at most `MAX_MAPPING_BYTES` of it: anything else goes to the readers, which
    refuse a device or a socket by name."""
    try:
        fifo = stat.S_ISFIFO(path.stat().st_mode)
    except OSError:
        fifo = False
    if not fifo:
        return path
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipectl-calibrate-")))
    copy = folder / path.name
    with open(path, "rb") as pipe:
        data = pipe.read(MAX_MAPPING_BYTES + 1)
    if len(data) > MAX_MAPPING_BYTES:
        raise UserInputError(f"{path} holds more than {MAX_MAPPING_BYTES // 2**20} MiB: not a file of measured runs")
    copy.write_bytes(data)
    return copy


@contextmanager
def _named_as_given(copies: dict[Path, Path]):
    """Errors about a pipe's copy name the pipe the user gave."""
    try:
        yield
    except UserInputError as error:
        message = error.message
        for copy, given in copies.items():
            message = message.replace(str(copy), str(given))
        if message == error.message:
            raise
        raise UserInputError(message, hint=error.hint) from None


def _warn(text: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)


def _model_of(run: Path) -> str | None:
    """The model a run directory names (job.json's `model`), or None where it names none readable."""
    try:
        model = read_mapping(run / JOB_FILE).get("model")
    except PipectlError:
        return None
    return model if isinstance(model, str) else None


def _calibrate_measured(csv: Path, conditions: Path | None, folds: int, output: Path, json_output: bool) -> None:
    from pipectl.measured.calibrate import MOST_LOG_MULTIPLIER, bounded_terms, calibrate_runs
    from pipectl.measured.runs import load_conditions, read_runs
    from pipectl.plan.workers import available_workers

    kind = file_kind(csv) if csv.is_file() else None  # (a pipe is read once: by the fit)
    if kind is not None:  # a plan, a profile, ...: neither measured runs nor a run directory
        raise UserInputError(f"{csv} is {kind}, neither a run directory nor a CSV of measured runs",
                             hint="pipectl calibrate runs/NAME ... or pipectl calibrate MEASURED.csv --conditions C.yaml")
    if conditions is None:
        raise UserInputError(
            f"{csv} is a file: calibrating to measured runs needs --conditions CONDITIONS.yaml",
            hint="pipectl calibrate MEASURED.csv --conditions CONDITIONS.yaml -o calibration.json",
        )
    refuse_overwriting(output, {"measured runs": csv, "conditions": conditions}, writes="RunsCalibration")
    with ExitStack() as stack:  # a pipe is read once: its bytes kept, so the hash is of what was read
        rows_file, conditions_file = (_readable_twice(path, stack) for path in (csv, conditions))
        with _named_as_given({rows_file: csv, conditions_file: conditions}):
            shared = load_conditions(conditions_file)
            measured = read_runs(rows_file)
        say = lambda line: err_console.print(line, highlight=False, markup=False)  # noqa: E731
        calibration = calibrate_runs(
            measured, shared, rows_file=rows_file, conditions_file=conditions_file, folds=folds,
            workers=available_workers(), progress=(lambda line: None) if json_output else say, notice=say,
        )  # fmt: skip
    calibration = calibration.model_copy(update={"rows_file": str(csv)})
    write_json_atomic(output, calibration)
    held_out = calibration.cross_validated
    warnings = []
    if held_out is not None and held_out.mape > calibration.before.mape:
        warnings.append(
            f"fitted on some rows, the terms predict the rows held out worse than uncalibrated (MAPE "
            f"{calibration.before.mape:.1%} -> {held_out.mape:.1%}): the rows do not tell the terms apart (too "
            "few, or too alike in shape and layout); predictions for other layouts may be worse with it"
        )  # fmt: skip
    if json_output:
        print_json({"output": str(output), **calibration.model_dump(mode="json"), "warnings": warnings})
        for warning in warnings:
            _warn(warning)
        return
    terms = Table(title="terms fitted", box=box.SIMPLE, title_justify="left", caption_justify="left")
    for column in ("term", "before", "after"):
        terms.add_column(column, justify="left" if column == "term" else "right")
    bounded = bounded_terms(shared, calibration.uncalibrated, calibration.terms, calibration.device)
    for name, before in calibration.uncalibrated:
        after = getattr(calibration.terms, name)
        terms.add_row(name, f"{before:.4g}", f"{after:.4g}" + (" *" if name in bounded else ""))
    if bounded:
        # The rows ask for more of a rate than a device could have: the model misses a cost they share.
        terms.caption = (f"* at the fit's bound ({math.exp(MOST_LOG_MULTIPLIER):.0f}x its starting figure, or what a device "
                         "of the kind can have: its best GEMM, its datasheet memory, its links' line rate): these rows "
                         "share a cost the model misses; more rows of other layouts and shapes tell the terms apart "
                         "better")  # fmt: skip
    errors = Table(title=f"errors over {calibration.rows} runs", box=box.SIMPLE, title_justify="left")
    for column in ("", "median |error|", "MAPE", "max |error|", "signed median"):
        errors.add_column(column, justify="left" if not column else "right")
    rows = [("uncalibrated", calibration.before), ("fitted (the rows fitted on)", calibration.after)]
    if calibration.cross_validated is not None:
        rows.append((f"{calibration.folds}-fold cross-validated", calibration.cross_validated))
    for label, e in rows:
        errors.add_row(label, f"{e.median_abs_error:.1%}", f"{e.mape:.1%}", f"{e.max_abs_error:.1%}",
                       f"{e.signed_median_error:+.1%}")  # fmt: skip
    console.print(terms)
    console.print(errors)
    console.print(f"wrote {output}: pass it as --calibration to validate, profile --derive, plan and simulate",
                  soft_wrap=True, highlight=False, markup=False)  # fmt: skip
    for warning in warnings:
        _warn(warning)
