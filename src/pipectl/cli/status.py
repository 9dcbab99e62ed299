"""`pipectl status RUN`: progress, last loss, predicted vs measured step time and memory, checkpoints."""

from __future__ import annotations

import time
from shlex import quote
from pathlib import Path
from typing import Annotated

import typer

from pipectl.cli.context import JsonFlag, console, err_console, output_file, print_json
from pipectl.errors import UserInputError
from pipectl.report.run_tables import status_table
from pipectl.artifacts.run import JOB_FILE, Engine
from pipectl.launch.options import check_stored_options
from pipectl.rundir.analysis import RunReport, analyse
from pipectl.rundir.run import is_run_dir, read_run_files
from pipectl.rundir.status import RunStatus, run_status
from pipectl.words import count


def register(app: typer.Typer) -> None:
    """Add `pipectl status` to the root app."""

    @app.command("status")
    def status_command(
        run_dir: Annotated[Path, typer.Argument(help="The run directory (runs/NAME).")],
        json_output: JsonFlag = False,
        plot: Annotated[
            Path | None,
            typer.Option("--plot", help="Write a figure (.png, .svg or .pdf): loss curve and predicted vs measured step time.",
                         callback=output_file),
        ] = None,
        verify: Annotated[
            bool, typer.Option("--verify", help="Hash every checkpoint file against its manifest (slower).")
        ] = False,
        follow: Annotated[
            bool, typer.Option("--follow", "-f", help="Update the summary live until the job ends, then print the whole status.")
        ] = False,
    ) -> None:
        """Progress, last loss, predicted-vs-measured step time and memory, and checkpoints of a run."""
        if follow and not json_output:
            _follow(run_dir)
        report = _analysed(run_dir, verify_hashes=verify)
        status = report.status
        plot_path = None
        if plot is not None:
            from pipectl.report.run_plots import plot_run  # matplotlib: only when plotting

            plot_path = plot_run(status.metrics, plot, title=status.path.name)
        if json_output:
            payload = report.to_dict()
            payload["plot"] = str(plot_path) if plot_path else None
            queued = _queued(status)  # what the table's line under it says: the job Slurm still holds
            payload["slurm_queue"] = None if queued is None else {"job_id": queued[0], "state": queued[1]}
            print_json(payload)
            _exit_if_damaged(status, verify)
            return
        console.print(status_table(report))
        if not follow:
            _say_if_queued(status)
        unreadable = status.unreadable_metrics_lines
        if unreadable:
            shown = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
            console.print(f"[yellow]warning:[/] {status.path / 'metrics.jsonl'}: "
                          f"{count(len(unreadable), 'line')} not a step record, skipped (line {shown})", highlight=False)
        if plot_path:
            console.print(f"plot written to {plot_path}")
        _exit_if_damaged(status, verify)


def _analysed(run_dir: Path, **how) -> RunReport:
    """`analyse`, with the run's stored options (job.json's `options`) checked as a resume would
    take them back: a value this version refuses is named with its key."""
    report = analyse(run_dir, **how)
    job = report.status.job
    if job.options:
        check_stored_options(job.options, report.status.path / JOB_FILE)
    return report


FOLLOW_SECONDS = 1.0  # how often --follow reads the run again
# How long --follow waits for a run directory that is not there yet (a launch just started beside it).
APPEAR_SECONDS = 60.0


def _follow(run_dir: Path) -> None:
    """The brief summary, redrawn in place while the job is active (its ranks beat or its launch
    lives); on a pipe, a line per step instead. A run not there yet is waited for a while: the
    launch writing it may have started a moment ago."""
    from rich.live import Live

    from pipectl.runtime.monitor import step_line

    if run_dir.is_file():  # no run will appear there: said at once by the reader below
        read_run_files(run_dir)
    if not is_run_dir(run_dir):
        err_console.print(f"waiting for {run_dir} to appear (up to {APPEAR_SECONDS:.0f} s)", highlight=False, soft_wrap=True)
        deadline = time.monotonic() + APPEAR_SECONDS
        while not is_run_dir(run_dir) and time.monotonic() < deadline:
            time.sleep(FOLLOW_SECONDS / 4)
        if not run_dir.exists():  # a folder or file there that is no run: the reader below says what it is
            raise UserInputError(
                f"no run directory appeared at {run_dir} in {APPEAR_SECONDS:.0f} s",
                hint=f"check the path; pipectl launch PLAN --run-dir {quote(str(run_dir))} writes it",
            )
        time.sleep(FOLLOW_SECONDS / 2)  # the launch writes the run's other files right after job.json

    status = _while_queued(run_dir, _analysed(run_dir, detail=False).status)
    if not console.is_terminal:
        shown = status.steps_done
        while True:  # the read that finds the job ended may hold its last steps: print them, then stop
            for line in status.metrics:
                if line.step > shown:
                    console.print(step_line(line, status.job.steps), highlight=False, soft_wrap=True)
                    shown = line.step
            if not status.active:
                return
            time.sleep(FOLLOW_SECONDS)
            status = run_status(run_dir)
    report = _analysed(run_dir, detail=False)
    with Live(status_table(report, brief=True), console=console, auto_refresh=False, transient=True) as live:
        while report.status.active:
            time.sleep(FOLLOW_SECONDS)
            report = _analysed(run_dir, detail=False)
            live.update(status_table(report, brief=True), refresh=True)


# How often --follow asks Slurm about a job still in its queue (squeue is a request to slurmctld).
QUEUE_POLL_SECONDS = 10.0


def _queued(status: RunStatus) -> tuple[str, str] | None:
    """(job id, state) of a Slurm job of this run that Slurm still holds while no rank beats (it
    waits in the queue, or starts); None otherwise, and for a run of another engine."""
    if status.active or status.job.engine is not Engine.SLURM or status.finished:
        return None
    from pipectl.launch.engines import slurm_queue_state

    return slurm_queue_state(status.job.name)


def _queue_words(status: RunStatus, queued: tuple[str, str]) -> str:
    return f"Slurm job {queued[0]} ({status.job.name}) is {queued[1].lower()}: waiting for its ranks"


def _say_if_queued(status: RunStatus) -> None:
    """Under a Slurm run's summary that reads "not started" (or stopped): whether its job waits in the queue."""
    queued = _queued(status)
    if queued is not None:
        err_console.print(_queue_words(status, queued), highlight=False, soft_wrap=True)


def _while_queued(run_dir: Path, status: RunStatus) -> RunStatus:
    """A Slurm run whose ranks do not beat (yet) may be waiting in the queue: as long as Slurm holds
    a job of the run's name (`#SBATCH --job-name`), say its state and wait; the run's status then."""
    said = None
    while (queued := _queued(status)) is not None:
        if queued != said:
            err_console.print(_queue_words(status, queued), highlight=False, soft_wrap=True)
            said = queued
        time.sleep(QUEUE_POLL_SECONDS)
        status = run_status(run_dir)
    return status


def _exit_if_damaged(status: RunStatus, verify: bool) -> None:
    """With --verify, a checkpoint that fails its hashes ends the command with exit 2 (a damaged
    artifact, as everywhere: `errors.ArtifactError`), so that a script checking a run's health
    sees it (the table or JSON above says which)."""
    damaged = [c.tag for c in status.checkpoints if not c.verified]
    if verify and damaged:
        err_console.print(f"[bold red]error:[/] {count(len(damaged), 'checkpoint')} of {status.path} failed "
                          f"verification: {', '.join(damaged)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    if verify:  # say what was checked: a clean run's table reads as without --verify
        err_console.print(f"verified: every file of {count(len(status.checkpoints), 'checkpoint')} matches its "
                          "manifest's sha256" if status.checkpoints else "verified: the run has no checkpoint yet",
                          highlight=False, soft_wrap=True)
