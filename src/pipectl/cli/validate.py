"""`pipectl validate MEASURED.csv --conditions CONDITIONS.yaml`: predictions against measured runs."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from pipectl.cli.context import JsonFlag, console, print_json
from pipectl.errors import UserInputError
from pipectl.words import count

WORST_ROWS = 10  # rows shown without --all-rows: the largest errors


def register(app: typer.Typer) -> None:
    """Add `pipectl validate` to the root app."""

    @app.command("validate")
    def validate_command(
        measured: Annotated[
            Path, typer.Argument(help="CSV of measured runs: shape, GPUs, global batch, layout, iteration time (ms).")
        ],
        conditions: Annotated[
            Path,
            typer.Option("--conditions", "-c", help="YAML of what every run shares: device, links, framework, precision."),
        ],
        calibration: Annotated[
            Path | None,
            typer.Option("--calibration", help="A calibration (pipectl calibrate MEASURED.csv): its device, link and "
                         "engine terms for the rows of its device."),
        ] = None,
        all_rows: Annotated[
            bool, typer.Option("--all-rows", help=f"Print every row, not only the {WORST_ROWS} largest errors.")
        ] = False,
        split: Annotated[
            bool, typer.Option("--split", help="Also print where a step's time goes, measured and predicted: per "
                               "block and micro-batch, per micro-batch, per block and step (rows without a pipeline).")
        ] = False,
        json_output: JsonFlag = False,
    ) -> None:
        """Predict every measured run with its layout pinned and compare: errors over the rows, and
        per group of competing layouts how well the predictions rank them."""
        # torch-free, but the planner: only when asked
        from pipectl.measured.predict import predict_runs
        from pipectl.measured.runs import load_calibration, load_conditions, read_runs
        from pipectl.measured.summary import summarise_errors, summarise_groups, time_split

        shared = load_conditions(conditions)
        runs = read_runs(measured)
        fitted = load_calibration(calibration, shared) if calibration is not None else None
        if fitted is not None and all((run.device or shared.device) != fitted.device for run in runs):
            raise UserInputError(
                f"--calibration {calibration} was fitted to {fitted.device} runs, and no row ran on one: it would "
                "change nothing", hint="leave --calibration out, or give the rows of that device")
        if console.is_terminal and not json_output:
            with console.status(f"predicting {len(runs)} runs"):
                predictions = predict_runs(runs, shared, fitted, stage_hints=True)
        else:
            predictions = predict_runs(runs, shared, fitted, stage_hints=True)
        errors, groups = summarise_errors(predictions), summarise_groups(predictions)
        splits = time_split(predictions)
        notes = (_calibration_notes(calibration, fitted, measured) + _unit_notes(predictions)
                 + _condition_notes(splits, shared) + _memory_notes(predictions))  # fmt: skip
        if json_output:
            print_json({
                "summary": errors.to_dict(),
                "groups": [group.to_dict() for group in groups],
                "rows": [_row_dict(p) for p in predictions],
                "time_split": [part.to_dict() for part in splits],
                "notes": notes,
            })  # fmt: skip
            _exit_if_none_predicted(errors, measured, where="each row's 'problem' in the JSON")
            return
        shown = predictions if all_rows else _worst(predictions)
        if shown:  # none predicted: the summary line says so, and each row's reason follows
            console.print(_rows_table(shown, all_rows, sum(1 for p in predictions if p.error is not None)))
        if any(g.rows > 1 for g in groups):  # a group of one row ranks nothing
            console.print(_groups_table(groups))
        if split and splits:
            console.print(_split_table(splits))
        elif split:
            console.print("--split: no group of rows without a pipeline (p = 1, one shape, t and b) differs enough in "
                          "layers and micro-batches to tell a step's parts apart",
                          soft_wrap=True, highlight=False, markup=False)  # fmt: skip
        unpredicted = [p for p in predictions if p.predicted_seconds is None]
        refused = [p for p in predictions if p.memory_refused]
        console.print(_summary_line(errors, groups, len(predictions)), soft_wrap=True, highlight=False)
        if refused:
            console.print(
                f"the memory model refuses {len(refused)} of the layouts that ran (their step predicted without the "
                f"memory check; first: line {refused[0].run.line}, {refused[0].memory_refused})",
                soft_wrap=True, highlight=False, markup=False,
            )  # fmt: skip
        for p in unpredicted[:UNPREDICTED_SHOWN]:
            console.print(f"line {p.run.line}: not predicted: {p.problem}", soft_wrap=True, highlight=False, markup=False)
        if len(unpredicted) > UNPREDICTED_SHOWN:
            console.print(f"… and {len(unpredicted) - UNPREDICTED_SHOWN} more rows not predicted (--json: each row's reason)",
                          soft_wrap=True, highlight=False, markup=False)  # fmt: skip
        for note in notes:
            console.print(f"note: {note}", soft_wrap=True, highlight=False, markup=False)
        _exit_if_none_predicted(errors, measured, where="each row's reason is above")


# Reasons of rows not predicted printed by name (--json holds every row's).
UNPREDICTED_SHOWN = 3


def _exit_if_none_predicted(errors, measured: Path, *, where: str) -> None:
    """Rows that all fail to predict (their reasons printed) are input validate cannot use: one
    error line, exit 2."""
    if errors.rows == 0:
        raise UserInputError(f"no row of {measured} could be predicted", hint=where)


def _calibration_notes(path: Path | None, fitted, measured: Path) -> list[str]:
    """Which calibration priced the rows, and whether they are the rows it was fitted to (in-sample
    errors say less than those on rows the fit has not seen)."""
    if fitted is None:
        return []
    from pipectl.io import sha256_file

    same = measured.is_file() and sha256_file(measured) == fitted.rows_sha256
    return [
        f"priced with the {fitted.device} terms of {path} (fitted to {count(fitted.rows, 'row')})"
        + (": these rows are the ones it was fitted to, so their errors are in-sample (calibrate's cross-validated "
           "error is the one to expect on other runs)" if same else "")
    ]


def _unit_notes(predictions) -> list[str]:
    from pipectl.measured.summary import unit_suspicion

    suspicion = unit_suspicion(predictions)
    return [] if suspicion is None else [suspicion]


def _condition_notes(splits, shared) -> list[str]:
    """What the rows say against the conditions (`summary.split_optimizer_evidence`)."""
    from pipectl.measured.summary import split_optimizer_evidence

    evidence = split_optimizer_evidence(splits, shared.zero_stage)
    if evidence is None:
        return []
    return [
        f"a block's share of the end of the step falls as d grows ({evidence}): the runs behave as if the "
        "optimizer state were split over the replicas (ZeRO stage 1 or more), but they are priced with stage 0; "
        "give the conditions (or a 'zero stage' column) the stage the runs used"
    ]


def _memory_notes(predictions) -> list[str]:
    """Layouts that ran, refused by the memory model at the rows' ZeRO stage, that fit at a higher one."""
    refused = [p for p in predictions if p.memory_refused]
    fitting = [p for p in refused if p.fits_with_zero_stage is not None]
    if not fitting:
        return []
    stages = sorted({p.fits_with_zero_stage for p in fitting})
    stage = f"ZeRO stage {stages[0]}" + (" or higher" if len(stages) > 1 else "")
    fits = "fits" if len(fitting) == 1 else "fit"
    share = f"{len(fitting)} of the {count(len(refused), 'layout')}" if len(refused) > 1 else "the layout"
    return [
        f"{share} the memory model refuses {fits} under {stage} ({'line' if len(fitting) == 1 else 'first: line'} "
        f"{fitting[0].run.line}), which splits more of the model state over the replicas (at stage 0 each holds 24 bytes "
        "a parameter at DeepSpeed's 16-bit optimizer step); give the conditions (or a 'zero stage' column) the stage "
        "the runs used"
    ]


def _worst(predictions):
    predicted = [p for p in predictions if p.error is not None]
    worst = sorted(predicted, key=lambda p: -abs(p.error))[:WORST_ROWS]
    return sorted(worst, key=lambda p: p.run.line)


def _row_dict(p) -> dict:
    run = p.run
    return {
        "line": run.line,
        "group": run.group,
        "layout": run.layout_label,
        "measured_seconds": run.measured_seconds,
        "predicted_seconds": p.predicted_seconds,
        "error": p.error,
        "peak_memory_gib": p.peak_memory_gib,
        "memory_refused": p.memory_refused,
        "fits_with_zero_stage": p.fits_with_zero_stage,
        "problem": p.problem,
    }


def _rows_table(shown, all_rows: bool, total: int) -> Table:
    title = ("step time per run, ms" if all_rows or len(shown) == total  # every run shown: none left out
             else f"the {len(shown)} largest errors of {count(total, 'run')} predicted, ms (--all-rows: every run)")
    table = Table(title=title, box=box.SIMPLE, title_justify="left")
    for column in ("line", "group", "layout", "measured", "predicted", "error"):
        table.add_column(column, justify="left" if column in ("group", "layout") else "right")
    for p in shown:
        predicted = "—" if p.predicted_seconds is None else f"{p.predicted_seconds * 1e3:.1f}"
        error = "—" if p.error is None else f"{p.error:+.1%}"
        table.add_row(str(p.run.line), p.run.group, p.run.layout_label, f"{p.run.measured_seconds * 1e3:.1f}", predicted, error)
    return table


def _groups_table(groups) -> Table:
    table = Table(title="ranking per group (one shape, GPU count and global batch)", box=box.SIMPLE, title_justify="left",
                  caption_justify="left")
    for column in ("group", "rows", "Spearman", "regret", "best measured", "predicted fastest"):
        table.add_column(column, justify="left" if column in ("group", "best measured", "predicted fastest") else "right")
    # The groups ranked worst first: a group of one row ranks nothing.
    ranked = sorted((g for g in groups if g.rows > 1), key=lambda g: (g.spearman if g.spearman is not None else 1.0, -g.regret))
    for g in ranked[:WORST_ROWS]:
        spearman = "—" if g.spearman is None else f"{g.spearman:.2f}"
        table.add_row(g.key, str(g.rows), spearman, f"{g.regret:.1%}", g.best_measured, g.ranked_first)
    if len(ranked) > WORST_ROWS:
        table.caption = f"the {WORST_ROWS} groups ranked worst of {len(ranked)} with two runs or more (--json: every group)"
    return table


def _split_table(parts) -> Table:
    """`summary.time_split`, measured / predicted in ms: per group the parts every d shares, then one
    line per d of a block's share of the end of the step."""
    table = Table(title="where a step's time goes (rows without a pipeline), measured / predicted, ms", box=box.SIMPLE,
                  title_justify="left", caption_justify="left")  # fmt: skip
    table.add_column("shape, t, b", no_wrap=True)
    for column in ("d", "block x micro-batch", "micro-batch", "block x step"):
        table.add_column(column, justify="right")
    for g in parts:
        m, p = g.measured, g.predicted
        for i, d in enumerate(m.block_step):
            first = i == 0
            table.add_row(
                g.key if first else "", str(d),
                f"{m.block_micro_batch * 1e3:.2f} / {p.block_micro_batch * 1e3:.2f}" if first else "",
                f"{m.micro_batch * 1e3:.2f} / {p.micro_batch * 1e3:.2f}" if first else "",
                f"{m.block_step[d] * 1e3:.2f} / {p.block_step[d] * 1e3:.2f}",
            )  # fmt: skip
    table.caption = (
        "each group: one shape, t and b; its rows differ in layers, m and d"
        if parts else "no group of rows without a pipeline has rows enough, differing in layers and micro-batches, to "
        "tell the parts apart"
    )
    return table


def _summary_line(errors, groups, total: int) -> str:
    if errors.rows == 0:
        return f"no run of {total} could be predicted"
    ranked = [g for g in groups if g.rows > 1]  # a group of one row ranks nothing
    rho = [g.spearman for g in ranked if g.spearman is not None]
    ranking = (
        f"; Spearman median {statistics.median(rho):.2f}, min {min(rho):.2f}; regret max "
        f"{max(g.regret for g in ranked):.1%} over {count(len(ranked), 'group')} of two runs or more"
        if rho else ""
    )
    return (
        f"{errors.rows} of {total} runs predicted: median |error| {errors.median_abs_error:.1%}, "
        f"MAPE {errors.mape:.1%}, max {errors.max_abs_error:.1%}, signed median {errors.signed_median_error:+.1%}"
        + ranking
    )
