"""`pipectl resize runs/NAME --devices N`: the same job on N devices, the same global batch.

Also the renderables `pipectl status` uses for a run's morph history and stragglers.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from shlex import quote
from typing import Annotated

import typer

from pipectl.artifacts.layout import layout_label
from pipectl.cli.context import JsonFlag, console, err_console, print_json, training_progress
from pipectl.cli.launch import check_stopped_while_starting, job_failure
from pipectl.cli.options import passed_flags, with_options
from pipectl.config import layered
from pipectl.errors import UserInputError
from pipectl.artifacts.run import Engine
from pipectl.launch.prepare import read_run
from pipectl.launch.supervise import signals_interrupt
from pipectl.rundir.analysis import analyse
from pipectl.rundir.status import RunStatus, run_status
from pipectl.report.run_tables import decision_table, morph_history_table, status_table
from pipectl.resize.live import LiveUnavailable, ResizeInterrupted, live_resize
from pipectl.resize.restart import ResizeDecision, RestartInterrupted, check_resumable, decide_resize, resize_run
from pipectl.resize.options import ResizeOptions
from pipectl.rundir.stragglers import StragglerPolicy
from pipectl.rundir.morph_history import read_history
from pipectl.rundir.metrics import MetricsTail
from pipectl.rundir.run import newest_checkpoint_step
from pipectl.words import count


def register(app: typer.Typer) -> None:
    """Add `pipectl resize` to the root app."""

    @app.command("resize")
    @with_options(ResizeOptions, after="run_dir")
    def resize_command(
        ctx: typer.Context,
        run_dir: Annotated[Path, typer.Argument(help="The run directory (runs/NAME).")],
        json_output: JsonFlag = False,
    ) -> None:
        """Move a run to N devices with the same global batch. A job running here moves live (its ranks
        hand their state over in memory at the next step boundary); otherwise it stops at a step
        boundary, the checkpoint is re-cut and the job relaunched with the same engine. Works on
        running, stopped and finished runs."""
        flags = passed_flags(ctx, ResizeOptions)
        options = layered(ResizeOptions, [flags])
        devices, steps, submit, scancel = options.devices, options.steps, options.submit, options.scancel
        stop_timeout, timeout = options.stop_timeout, options.timeout
        if submit or scancel:
            engine = read_run(run_dir).job.engine
            if engine is not Engine.SLURM:
                flag = "--submit" if submit else "--scancel"
                raise UserInputError(f"{flag} is for a Slurm run; {run_dir} runs on engine {engine.value}")
        requested_unix = time.time()
        policy = StragglerPolicy(slowdown_threshold=options.straggler_slowdown)
        decision = decide_resize(
            run_dir, devices, steps=steps, exclude_stragglers=options.exclude_stragglers, straggler_policy=policy
        )
        if options.dry_run:
            _print_dry_run(decision, devices, json_output)
            return
        status = run_status(decision.run_dir)
        if _nothing_to_move(decision, status, run_dir, json_output):
            return
        if not status.active:  # a running job may still checkpoint as it stops
            check_resumable(decision)
        if not json_output:
            console.print(decision_table(decision))
        if options.live:
            try:
                with signals_interrupt() as interrupted:  # a kill or a closed terminal too: the request withdrawn
                    moved = live_resize(
                        decision,
                        requested_unix=requested_unix,
                        say=None if json_output else (lambda line: console.print(line, style="dim", highlight=False, markup=False)),
                    )
            except KeyboardInterrupt as stop:  # before the request or after (`ResizeInterrupted`)
                _say_cancelled(isinstance(stop, ResizeInterrupted) and stop.asked, run_dir,
                               grows=decision.candidate.devices > decision.from_devices, signals=interrupted)  # fmt: skip
            except LiveUnavailable as exc:
                if exc.running or "live" in flags.values:  # asked for by name: say why it is not
                    err_console.print(f"[yellow]cannot resize live: {exc.message}; restarting instead[/]", highlight=False)
            else:
                if json_output:
                    print_json({"run_dir": str(decision.run_dir), "joined_pids": moved.joined, **moved.record.model_dump(mode="json")})
                    return
                console.print(morph_history_table(read_history(decision.run_dir)))
                return
        try:
            with signals_interrupt() as interrupted:  # as the live resize's
                result = _resize_with_progress(
                    decision,
                    requested_unix=requested_unix,
                    stop_timeout=stop_timeout,
                    timeout=timeout,
                    quiet=json_output,
                    submit=submit,
                    scancel=scancel,
                )
        except RestartInterrupted as stop:
            _say_restart_cancelled(stop, run_dir, interrupted)
        if result.signals:
            _check_stopped(result, run_dir, requested_unix, json_output)
        if result.exit_code not in (None, 0):
            done = run_status(result.run_dir).steps_done
            raise job_failure(
                result.run_dir,
                requested_unix,
                f"the resized job exited with code {result.exit_code} after {done} of {decision.target_steps} steps",
                go_on=f"fix the cause, then resize again (pipectl resize {quote(str(run_dir))} --devices {devices})",
                log_tail=not json_output,
            )
        if json_output:
            print_json(result.to_dict())
            return
        if result.submit_hint:
            console.print(f"wrote the new layout into {result.run_dir}; {result.submit_hint}", markup=False)
            return
        if result.submitted_job:
            console.print(f"wrote the new layout into {result.run_dir} and submitted it as Slurm job {result.submitted_job}", markup=False)
            return

        console.print(status_table(analyse(result.run_dir, detail=False), brief=True))
        if result.record.downtime_seconds is None:
            err_console.print("[yellow]no step completed on the new layout: downtime unknown[/]")


def _check_stopped(result, run_dir: Path, requested_unix: float, json_output: bool) -> None:
    """A person stopped the relaunched job (Ctrl-C): before its first step that is no failure of
    the new layout, and after it the run stopped at a checkpoint; either way said with the command
    that continues it in its new layout (the run's own plan), exit 128 + the signal."""
    again = f"pipectl launch {quote(str(run_dir / read_run(run_dir).job.plan_file))} --run-dir {quote(str(run_dir))}"
    signum = result.signals[0]
    if result.record.first_step_unix is None:
        relaunched = result.record.relaunched_unix
        check_stopped_while_starting(result.run_dir, relaunched or requested_unix, signum, again,
                                     ranks_started=relaunched is not None)  # fmt: skip
        return  # a rank failed as well: the failure report follows
    report = analyse(result.run_dir, detail=False)
    status = report.status
    if status.finished or status.stopped is None:
        return
    if json_output:
        print_json(result.to_dict())
    else:
        console.print(status_table(report, brief=True))
        console.print(f"stopped at step {status.steps_done} of {result.decision.target_steps} (signal or stop request), "
                      f"checkpoint written; continue with: {again} --resume")  # fmt: skip
    raise typer.Exit(128 + signum)


def _resize_with_progress(
    decision, *, requested_unix: float, stop_timeout: float, timeout: float | None, quiet: bool, submit: bool, scancel: bool
):
    """Run the resize; once relaunched, tail metrics.jsonl into a progress bar."""

    run_dir = decision.run_dir
    tail = MetricsTail(run_dir)
    with training_progress(quiet=quiet) as progress:
        task = None

        def phase(line: str) -> None:
            nonlocal task, tail
            if "could not be loaded" in line:  # the ranks fell back past a checkpoint: stderr, always
                err_console.print(line, style="yellow", highlight=False, markup=False, soft_wrap=True)
            elif not quiet:
                progress.console.print(line, style="dim", highlight=False, markup=False)
            if line.startswith("relaunching") and task is None:
                # The new job's steps only (the stopped job's last ones may lie past its checkpoint),
                # from the checkpoint it resumes.
                tail = MetricsTail(run_dir, from_end=True)
                task = progress.add_task(
                    f"training {run_dir.name}", total=decision.target_steps, stats="starting ranks…",
                    completed=min(newest_checkpoint_step(run_dir), decision.target_steps),
                )  # fmt: skip

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
            submit=submit,
            cancel_slurm=scancel,
        )


def _say_cancelled(asked: bool, run_dir: Path, *, grows: bool, signals: list[int]) -> None:
    """Ctrl-C (or `signals`' first) during a live resize: what the job does now, then exit as
    `_cancelled` does. Only a resize to more ranks starts ranks of its own to join the job."""
    if asked:
        what = ("the request was withdrawn; the job trains on as it was unless its ranks had taken it already "
                f"(pipectl status {quote(str(run_dir))} shows the layout it runs)")  # fmt: skip
    else:
        joining = " (a joining rank started for it is stopped)" if grows else ""
        what = f"nothing was asked of the job{joining}: it trains on as it was"
    _cancelled(what, signals)


def _cancelled(what: str, signals: list[int]) -> None:
    """A resize a person cancelled: what it left, then exit 128 + the signal (130 for a Ctrl-C)."""
    signum = signals[0] if signals else signal.SIGINT
    by = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    err_console.print(f"resize cancelled ({by}): {what}", style="yellow", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(128 + signum)


def _say_restart_cancelled(stop: RestartInterrupted, run_dir: Path, signals: list[int]) -> None:
    """Ctrl-C (or `signals`' first) while a resize by restart stopped the job, before the new one
    started: what became of the job (`_cancelled`)."""
    if not stop.asked:
        what = "nothing was changed"
    elif not stop.stopped:
        what = (f"the stop request was withdrawn; the job trains on unless its ranks had taken it already "
                f"(pipectl status {quote(str(run_dir))} shows whether it runs)")  # fmt: skip
    else:
        plan = run_dir / read_run(run_dir).job.plan_file
        what = (f"the job stopped at its checkpoint and was not started again; continue with: pipectl launch "
                f"{quote(str(plan))} --run-dir {quote(str(run_dir))} --resume, or resize again")  # fmt: skip
    _cancelled(what, signals)


def _print_dry_run(decision: ResizeDecision, devices: int, json_output: bool) -> None:
    """What the resize would do, as a table or JSON; nothing stopped, written or started. What the
    resize would refuse, a dry run refuses too."""
    if not run_status(decision.run_dir).active:
        check_resumable(decision)
    if json_output:
        print_json({
            "run_dir": str(decision.run_dir), "requested_devices": devices, "devices": decision.candidate.devices,
            "plan_source": decision.choice.source, "candidate": decision.candidate.model_dump(mode="json"),
            "target_steps": decision.target_steps, "excluded_ranks": decision.excluded_ranks, "notes": decision.notes,
        })  # fmt: skip
        return
    console.print(decision_table(decision))
    console.print("[dim]dry run: nothing stopped, written or started[/]")


def _nothing_to_move(decision: ResizeDecision, status: RunStatus, run_dir: Path, json_output: bool) -> bool:
    """The run trains now, on the layout the resize would give it: said, and True (a stopped run
    with the same layout is resumed, to the steps asked)."""
    # What the job last trained on (its plan may name a relaunch that failed before its first step),
    # and ranks that still beat (a rank of this host whose process ended does not, however fresh).
    same = layout_label(decision.candidate) == decision.from_layout
    if not same or not status.ranks_beating:
        return False
    message = f"{run_dir} already runs {decision.from_layout} on {count(decision.from_devices, 'device')}: nothing to move"
    if decision.target_steps != read_run(run_dir).job.steps:
        message += f" (a running job's total of steps changes on a resume: launch --resume --steps {decision.target_steps})"
    if json_output:
        print_json({"run_dir": str(decision.run_dir), "moved": False, "reason": message, "notes": decision.notes})
    else:
        console.print(message, highlight=False, soft_wrap=True)
        for note in decision.notes:  # why the layout asked for is the one it runs (fewer devices than asked)
            console.print(f"note: {note}", highlight=False, soft_wrap=True, markup=False)
    return True
