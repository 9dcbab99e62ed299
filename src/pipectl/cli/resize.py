"""`pipectl resize runs/NAME --devices N`: the same job on N devices, the same global batch.

Also the renderables `pipectl status` uses for a run's morph history and stragglers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional, Sequence

import typer
from rich import box
from rich.console import Group
from rich.table import Table

from pipectl.artifacts.morph import MorphRecord
from pipectl.cli.context import JsonFlag, console, err_console, print_json, training_progress
from pipectl.errors import LaunchError
from pipectl.resize.stragglers import StragglerPolicy, StragglerReport


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def morph_history_table(records: Sequence[MorphRecord]) -> Table:
    """One row per morph: when, from which layout to which, at which step, downtime."""
    import datetime

    table = Table(box=box.SIMPLE_HEAD, title="morph history", title_justify="left")
    for column in ("when", "from", "to", "at step", "stop", "downtime", "notes"):
        table.add_column(column)
    for record in records:
        when = datetime.datetime.fromtimestamp(record.requested_unix).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            when,
            f"{record.from_devices}: {record.from_layout}",
            f"{record.to_devices}: {record.to_layout}",
            str(record.resume_step),
            _seconds(record.stop_seconds),
            _seconds(record.downtime_seconds) if record.relaunched_unix else "not relaunched",
            "; ".join(record.notes),
        )
    return table


def straggler_table(report: StragglerReport) -> Table:
    """Every rank's median slowdown against its data-parallel peers; stragglers in red."""
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"stragglers (steps {report.steps[0]}-{report.steps[-1]}, {report.layout})" if report.steps else "stragglers",
        title_justify="left",
        caption=report.reason or None,
    )
    for column in ("rank", "stage", "peers", "compute", "slowdown", "z", "verdict"):
        table.add_column(column)
    for score in report.scores.values():
        verdict = "[red]straggler[/]" if score.straggler else "ok"
        table.add_row(
            str(score.rank),
            str(score.stage),
            str(score.peers),
            f"{score.median_compute_seconds * 1e3:.1f} ms",
            f"{score.median_slowdown:.2f}x" if score.peers else "-",
            "-" if score.median_z is None else f"{score.median_z:.1f}",
            verdict,
        )
    return table


def _devices(count: int) -> str:
    return f"{count} device" + ("" if count == 1 else "s")


def _decision_table(decision) -> Table:
    from pipectl.resize.morph import layout_label

    table = Table(box=box.SIMPLE, show_header=False, title=f"resize {decision.run_dir.name}", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("from", f"{_devices(decision.previous.devices)}: {layout_label(decision.previous)}")
    table.add_row("to", f"{_devices(decision.candidate.devices)}: {layout_label(decision.candidate)}")
    table.add_row("requested", f"{_devices(decision.requested_devices)} ({decision.choice.source})")
    table.add_row("global batch", f"{decision.candidate.global_batch} (unchanged)")
    table.add_row("train up to", f"{decision.target_steps} steps")
    for note in decision.notes:
        table.add_row("[yellow]note[/]", note)
    return table


def register(app: typer.Typer) -> None:
    """Add `pipectl resize` to the root app."""

    @app.command("resize")
    def resize_command(
        run_dir: Annotated[Path, typer.Argument(help="The run directory (runs/NAME).")],
        devices: Annotated[int, typer.Option("--devices", help="Devices to run on from now on.")],
        steps: Annotated[
            Optional[int], typer.Option(help="Total steps to train up to (default: the job's own total).")
        ] = None,
        exclude_stragglers: Annotated[
            bool,
            typer.Option("--exclude-stragglers", help="Leave out ranks much slower than their data-parallel peers."),
        ] = False,
        straggler_slowdown: Annotated[
            float, typer.Option(min=1.0, help="A straggler computes at least this many times as long as its peers.")
        ] = StragglerPolicy.slowdown_threshold,
        stop_timeout: Annotated[
            float, typer.Option(min=1.0, help="Seconds to wait for a running job to checkpoint and exit.")
        ] = 300.0,
        timeout: Annotated[
            Optional[float], typer.Option(min=1.0, help="Stop the relaunched job after this many seconds.")
        ] = None,
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Show the new layout; stop, write and start nothing.")
        ] = False,
        json_output: JsonFlag = False,
    ) -> None:
        """Move a run to N devices with the same global batch: stop at a step boundary, re-cut the
        checkpoint, relaunch with the same engine. Works on running, stopped and finished runs."""
        import time

        from pipectl.resize.morph import decide_resize

        requested_unix = time.time()
        policy = StragglerPolicy(slowdown_threshold=straggler_slowdown)
        decision = decide_resize(
            run_dir, devices, steps=steps, exclude_stragglers=exclude_stragglers, straggler_policy=policy
        )
        if dry_run:
            if json_output:
                print_json(
                    {
                        "run_dir": str(decision.run_dir),
                        "requested_devices": devices,
                        "devices": decision.candidate.devices,
                        "plan_source": decision.choice.source,
                        "candidate": decision.candidate.model_dump(mode="json"),
                        "target_steps": decision.target_steps,
                        "excluded_ranks": decision.excluded_ranks,
                        "notes": decision.notes,
                    }
                )
            else:
                console.print(_decision_table(decision))
                console.print("[dim]dry run: nothing stopped, written or started[/]")
            return
        if not json_output:
            console.print(_decision_table(decision))
        result = _resize_with_progress(
            decision,
            requested_unix=requested_unix,
            stop_timeout=stop_timeout,
            timeout=timeout,
            quiet=json_output,
        )
        if result.exit_code not in (None, 0):
            raise LaunchError(
                f"the resized job exited with code {result.exit_code}",
                hint=f"logs: {result.run_dir / 'logs'}; resize again or launch --resume",
            )
        if json_output:
            print_json(result.to_dict())
            return
        if result.submit_hint:
            console.print(f"wrote the new layout into {result.run_dir}; {result.submit_hint}")
            return
        from pipectl.cli.status import status_table
        from pipectl.launch.rundir import run_status
        from pipectl.resize.history import read_history

        console.print(morph_history_table(read_history(result.run_dir)))
        console.print(status_table(run_status(result.run_dir)))
        if result.record.downtime_seconds is None:
            err_console.print("[yellow]no step completed on the new layout: downtime unknown[/]")


def _resize_with_progress(decision, *, requested_unix: float, stop_timeout: float, timeout: float | None, quiet: bool):
    """Run the resize; once relaunched, tail metrics.jsonl into a progress bar."""
    from pipectl.resize.morph import resize_run
    from pipectl.runtime.metrics import MetricsTail

    run_dir = decision.run_dir
    tail = MetricsTail(run_dir)
    with training_progress(quiet=quiet) as progress:
        task = None

        def phase(line: str) -> None:
            nonlocal task
            if not quiet:
                progress.console.print(f"[dim]{line}[/]", highlight=False)
            if line.startswith("relaunching") and task is None:
                task = progress.add_task(
                    f"training {run_dir.name}", total=decision.target_steps, stats="starting ranks…"
                )

        def tick() -> None:
            last = tail.latest()
            if task is not None and last is not None:
                stats = f"loss {last.loss:.4f}  {last.samples_per_second:.1f} samples/s"
                progress.update(task, completed=min(last.step, decision.target_steps), stats=stats)

        return resize_run(
            run_dir,
            decision.requested_devices,
            decision=decision,
            requested_unix=requested_unix,
            stop_timeout_seconds=stop_timeout,
            signal_after_seconds=min(60.0, stop_timeout / 2),
            run_timeout_seconds=timeout,
            on_phase=phase,
            on_tick=tick,
        )


def status_renderables(run_dir: Path) -> Group:
    """What `pipectl status` adds for resizes: the morph history and the straggler verdict."""
    from pipectl.resize.history import read_history
    from pipectl.resize.stragglers import find_stragglers
    from pipectl.runtime.metrics import read_metrics

    parts = []
    records = read_history(run_dir)
    if records:
        parts.append(morph_history_table(records))
    report = find_stragglers(read_metrics(run_dir))
    if report.scores:
        parts.append(straggler_table(report))
    return Group(*parts)
