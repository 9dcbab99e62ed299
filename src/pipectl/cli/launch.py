"""`pipectl launch PLAN.json --run-dir runs/NAME`: validate, write the run directory, train."""

from __future__ import annotations

import shutil
import signal
from shlex import join, quote
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.cluster import SlurmSpec
from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import JOB_FILE, LOGS_DIR, METRICS_FILE, CheckpointOutcome, DataKind, Engine, Precision
from pipectl.cli.context import JsonFlag, console, err_console, print_json, training_progress
from pipectl.cli.options import ConfigOption, file_layers, passed_flags, with_options
from pipectl.config import files_gone, option_fields, render_config, to_sections, toml_value
from pipectl.errors import LaunchError, UserInputError
from pipectl.io import load_model
from pipectl.launch import PreparedLaunch, effective_options, job_node_type, plan_cluster, prepare_launch, run_engine, slurm_settings
from pipectl.launch.engines import ENGINE_LOG
from pipectl.launch.supervise import JobEnded, TimedOut
from pipectl.launch.options import LaunchOptions
from pipectl.launch.placement import placement_note
from pipectl.rundir.run import check_steps_beyond_trained, is_run_dir, newest_checkpoint_step, runs_inside_hint
from pipectl.launch.prepare import run_files
from pipectl.cli.plan import planned_otherwise
from pipectl.plan.options import PlanOptions, plan_sections
from pipectl.rundir.analysis import analyse
from pipectl.rundir.status import RunStatus, run_status
from pipectl.report.run_tables import failure_report, status_table
from pipectl.report.tables import format_bytes
from pipectl.resize.replicas import read_recovery, recovery_line
from pipectl.rundir.checkpoints import RESIZE_STOP, has_checkpoint, read_events
from pipectl.runtime.engines.dsconfig import check_schedule
from pipectl.rundir.failures import read_failures, read_resume, resume_lines
from pipectl.runtime.liveness import StallWatch, job_collective_timeout_seconds
from pipectl.rundir.heartbeats import read_heartbeats, stopped_cleanly, vanished_line, vanished_ranks
from pipectl.runtime.elastic.recovery import says_peer_loss
from pipectl.rundir.metrics import MetricsTail, read_metrics, read_refusals, refusal_line
from pipectl.words import count


def _engine_log_tail(run_dir: Path, lines: int = 15) -> str:
    log = run_dir / LOGS_DIR / ENGINE_LOG
    if not log.is_file():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


PRINT_CONFIG_TITLE = """pipectl launch options, and the plan's.
Use: pipectl launch PLAN.json --run-dir DIR --config FILE; pipectl plan --config FILE re-plans from
the same file ([model] profile, [cluster], [training] global_batch, [plan]: as the plan was made).
Flags win over the file; a relative path is taken from the file's folder; a commented-out key keeps
its default."""


def register(app: typer.Typer) -> None:
    """Add `pipectl launch` to the root app."""

    @app.command("launch")
    @with_options(LaunchOptions, after="config")
    def launch_command(
        ctx: typer.Context,
        plan_path: Annotated[Path, typer.Argument(help="plan.json from `pipectl plan`.", metavar="PLAN.json")],
        run_dir: Annotated[
            Optional[Path], typer.Option("--run-dir", help="Run directory to create, e.g. runs/demo.")
        ] = None,
        config: ConfigOption = None,
        bf16: Annotated[bool, typer.Option("--bf16", help="Same as --precision bf16.")] = False,
        print_config: Annotated[
            bool,
            typer.Option(
                "--print-config",
                help="Print the effective options (defaults, the run's on --resume, --config, flags) as a commented "
                "TOML config file, and exit: each value is checked, nothing is written or started (--dry-run checks "
                "the job too).",
            ),
        ] = False,
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Validate and print the config and command; write and run nothing.")
        ] = False,
        timeout: Annotated[
            Optional[float], typer.Option(min=1.0, help="Stop the job after this many seconds, at a checkpoint; exit 124 (as timeout does).")
        ] = None,
        json_output: JsonFlag = False,
    ) -> None:
        """Run a plan inside DeepSpeed's pipeline engine (a plan for engine torch: PyTorch's pipelining
        runtime), with checkpoints and metrics."""
        plan = load_model(Plan, plan_path)
        check_planned_batch(config, plan, plan_path)
        flags = passed_flags(ctx, LaunchOptions)
        if bf16:
            asked = flags.values.get("precision")
            if asked not in (None, Precision.BF16, "bf16"):
                raise UserInputError(f"--bf16 contradicts --precision {getattr(asked, 'value', asked)}")
            flags.values["precision"] = Precision.BF16
        layers = [*file_layers(LaunchOptions, config), flags]
        if run_dir is None and not print_config:
            raise UserInputError("missing --run-dir (the run directory to create, e.g. runs/demo)")
        run_dir = run_dir or Path(".")  # --print-config: no run directory is read unless --resume names one
        resume = bool(flags.values.get("resume"))
        if resume and not is_run_dir(run_dir):  # checked here too: a dry run never reaches prepare_run_dir
            raise UserInputError(f"cannot resume {run_dir}: no such run (it holds no job.json)",
                                 hint=runs_inside_hint(run_dir))
        as_given = {  # the model and data as typed (the last layer naming them), beside their absolute forms
            name: value
            for layer in layers
            for name, value in layer.values.items()
            if name in ("model", "data") and isinstance(value, str) and value != DataKind.BUILTIN.value
        }
        options = effective_options(run_dir, layers, plan, as_given=as_given)
        if options.cluster is not None and options.cluster in (plan.cluster, plan.cluster_file):
            # The plan's own cluster (a printed config names it for `plan`): the default, kept as such.
            options = options.model_copy(update={"cluster": None})
        if print_config:
            _print_config(plan, plan_path, options)
            return
        check_schedule(plan.chosen)  # before anything else: a 2BW plan is another optimizer
        if options.elastic is not None and options.engine is not Engine.TORCHRUN:
            raise UserInputError(f"--elastic needs --engine torchrun, not {options.engine.value}")
        if resume and is_run_dir(run_dir):  # before any rank starts: a finished run has nothing left to train
            given = any("steps" in layer.values for layer in layers)
            if options.steps is None:  # every launch stores its total: only an edited job.json lacks it
                raise UserInputError(f"{run_dir / JOB_FILE} [training] steps is not set: the run's total is unknown",
                                     hint="pass the total to train to with --steps N")
            check_steps_beyond_trained(run_dir, options.steps, options.steps, given=given)
        prepared = prepare_launch(plan, run_dir, options, plan_dir=plan_path.parent, write=not dry_run)
        try:
            _launch(prepared, plan_path, run_dir, timeout=timeout, dry_run=dry_run, json_output=json_output)
        finally:
            if prepared.lock is not None:  # the job has ended: the run directory is free again
                prepared.lock.release()


def check_planned_batch(config: Path | None, plan: Plan, plan_path: Path) -> None:
    """Refuse a config file whose planning keys are not what the plan was made with: a launch runs
    the plan it is given, so its file's [plan] pipeline_parallel, [cluster] devices or [training]
    global_batch would otherwise be ignored in silence (and the global batch is fixed when planning:
    every layout divides it, and a launch never changes it)."""
    for layer in file_layers(PlanOptions, config):
        differ = planned_otherwise(plan, plan_path.parent, layer)
        if not differ:
            continue
        name, where, value, planned = differ[0]
        said = (f"was planned for a global batch of {planned}" if name == "global_batch"
                else f"was planned with {_planned_words(planned)}")  # fmt: skip
        more = f" (and {count(len(differ) - 1, 'other key')})" if len(differ) > 1 else ""
        raise UserInputError(
            f"{where} = {_planned_words(value)}, but {plan_path} {said}{more}",
            hint=f"re-plan with the file ({_replan_command(config, plan, plan_path, layer)}), then launch that "
            "plan; or leave the key out of the file",
        )


def _replan_command(config: Path, plan: Plan, plan_path: Path, layer) -> str:
    """`pipectl plan --config FILE` with the plan's own keys (`plan_sections`: its profiles, cluster,
    calibration, devices and search options) as flags where the file leaves them out and they are
    not the defaults: the search that made the plan, with the file's values; written beside the plan
    under another name than the plan's."""
    words = ["pipectl", "plan", "--config", str(config)]
    sections = plan_sections(plan, plan_path.parent)
    for field in option_fields(PlanOptions):
        value = sections.get(field.section or "", {}).get(field.key)
        default = getattr(field.default, "value", field.default)
        if value is None or value == default or field.name in layer.values or field.flag is None:
            continue
        if isinstance(value, bool):
            words.append(field.flag if value else "--no-" + field.flag.removeprefix("--"))
        else:
            for one in value if isinstance(value, list) else [value]:
                words += [field.flag, str(one)]
    return join([*words, "-o", str(plan_path.with_name(f"{plan_path.stem}-replanned.json"))])


def _planned_words(value: object) -> str:
    """A planning value as a config file writes it (`config.toml_value`): 2, "gpipe", or (unset)."""
    return "(unset)" if value is None else toml_value(getattr(value, "value", value))


def _say_before_starting(prepared: PreparedLaunch, dry_run: bool) -> None:
    """What the launch deleted, what it may not want, and where the ranks go, before the job starts."""
    if prepared.forced_away:  # nothing of a run goes without a word
        err_console.print(f"--force {'would delete' if dry_run else 'deleted'} the run in {prepared.forced_away}",
                          highlight=False, markup=False, soft_wrap=True)
    warmup = prepared.job.training.warmup_steps
    if warmup >= prepared.job.steps:  # allowed: a later --resume --steps N may train on past it
        err_console.print(f"note: the warm-up ({count(warmup, 'step')}) outlasts the {count(prepared.job.steps, 'step')} "
                          "to train: the learning rate stays below its peak", highlight=False, markup=False)
    if prepared.job.node_groups:
        console.print(placement_note(prepared.job.node_groups, prepared.hosts), soft_wrap=True, highlight=False, markup=False)



def _print_config(plan: Plan, plan_path: Path, options: LaunchOptions) -> None:
    """The effective options as a config file (the launch's values over the plan's); the cluster
    file's Slurm values, which a launch of it takes, in the comments of the keys they fill."""
    sections = plan_sections(plan, plan_path.parent)
    for section, keys in to_sections(options).items():
        sections.setdefault(section, {}).update(keys)
    cluster = plan_cluster(plan, options.cluster)
    inherited = {}
    if cluster is not None:
        slurm = slurm_settings(cluster, SlurmSpec(), job_node_type(plan, cluster))
        inherited["slurm"] = {key: (value, f"cluster {cluster.name}'s") for key, value in slurm.model_dump().items()
                              if value is not None and value != SlurmSpec.model_fields[key].default}
    typer.echo(render_config([LaunchOptions, PlanOptions], sections, title=PRINT_CONFIG_TITLE, inherited=inherited), nl=False)
    for gone, reader in files_gone(sections, [PlanOptions, LaunchOptions]):  # plan.json's copies price the plan
        command = "plan" if reader is PlanOptions else "launch"
        err_console.print(f"[yellow]warning:[/] {escape(gone)} is no longer there; `pipectl {command} --config` "
                          "of this file will need it back", highlight=False, soft_wrap=True)


def _launch(
    prepared: PreparedLaunch, plan_path: Path, run_dir: Path, *, timeout: float | None, dry_run: bool, json_output: bool
) -> None:
    """Print the dry run, or run the job and report how it ended."""
    files = run_files(prepared.plan, prepared.job, prepared.ds_config, prepared.command, prepared.run_dir)
    described = {
        "run_dir": str(prepared.run_dir),
        "engine": prepared.job.engine.value,
        "command": prepared.command.shell_line(),
        "job": prepared.job.model_dump(mode="json"),
        "ds_config": prepared.ds_config,
        "defaults": prepared.defaults,
    }
    chosen = (
        f"[bold]chosen by default:[/] {'; '.join(prepared.defaults)} [dim](flags or --config set them)[/]"
        if prepared.defaults and not json_output
        else None
    )
    if not json_output:
        _say_before_starting(prepared, dry_run)
    if dry_run:
        if json_output:
            print_json({**described, "files": files})
        else:
            for name, text in files.items():  # a header line per file (a rule would span a piped console)
                console.print(f"── {prepared.run_dir / name} ──", style="dim", soft_wrap=True, highlight=False, markup=False)
                console.print(text.rstrip("\n"), soft_wrap=True, highlight=False, markup=False)
            console.print(f"[bold]command:[/] {prepared.command.shell_line()}", soft_wrap=True, highlight=False)
            if chosen:
                console.print(chosen, highlight=False)
            console.print("[dim]dry run: nothing written, nothing started[/]")
        return
    if chosen:
        console.print(chosen, highlight=False)
    if not prepared.command.runnable_here:
        if json_output:
            print_json({**described, "submitted": False, "hint": prepared.command.submit_hint})
        else:
            console.print(f"wrote {prepared.run_dir}; {prepared.command.submit_hint}", markup=False)
        return
    if prepared.busier and not json_output:
        err_console.print(prepared.busier, style="yellow", highlight=False, markup=False, soft_wrap=True)
    started = time.time()
    logged_before = _metrics_bytes(prepared.run_dir)  # a resumed run's steps were logged by earlier launches
    watch = StallWatch(
        prepared.run_dir,
        since_unix=started - 1.0,
        collective_timeout_seconds=job_collective_timeout_seconds(prepared.job, prepared.plan.chosen),
    )
    try:
        signals: list[int] = []  # what stopped the job, if a person did
        exit_code = _run_with_progress(prepared, timeout, watch, quiet=json_output, since_unix=started - 1.0,
                                       signals=signals)  # fmt: skip
    except JobEnded as ended:
        _job_ended(prepared, ended, started, watch, plan_path, run_dir, described if json_output else None)
    report = analyse(prepared.run_dir, detail=False)
    status = report.status
    resumed = read_resume(prepared.run_dir, since_unix=started - 1.0)
    if exit_code != 0:
        stopped_at = stopped_cleanly(read_heartbeats(prepared.run_dir, since_unix=started - 1.0), prepared.job.world_size)
        if stopped_at is None and signals and _metrics_bytes(prepared.run_dir) == logged_before:
            check_stopped_while_starting(prepared.run_dir, started, signals[0], f"pipectl launch {quote(str(plan_path))} --run-dir {quote(str(run_dir))}")
        if stopped_at is None:
            progress = f"the job exited with code {exit_code} after {status.steps_done} of {prepared.job.steps} steps"
            raise _failure(prepared, started, progress, watch, log_tail=not json_output)
        # torchrun signalled directly reports the signal as an error although every rank stopped cleanly
        err_console.print(
            f"the launcher exited with code {exit_code} (it was signalled), but every rank stopped cleanly "
            f"after writing checkpoint step {stopped_at}",
            style="yellow",
            highlight=False,
        )
        exit_code = 0
    # A person's signal stopped a run short of its end: 128 + the signal, as before the first step,
    # so `pipectl launch ... && next` does not go on as if it had finished.
    interrupted = bool(signals) and not status.finished and not _stopped_for_resize(status)
    if json_output:
        resume = None if resumed is None else resumed.model_dump(mode="json", exclude={"schema_version"})
        print_json({**described, "exit_code": exit_code, "resumed": resume, "status": status.to_dict()})
    else:
        console.print(status_table(report, brief=True))
        _say_how_to_go_on(status, prepared, plan_path, run_dir)
    if interrupted:
        raise typer.Exit(128 + signals[0])


def _job_ended(
    prepared: PreparedLaunch, ended: JobEnded, started: float, watch: StallWatch, plan_path: Path, run_dir: Path,
    described: dict | None,
) -> None:
    """pipectl ended the job: at its --timeout with every rank at a checkpoint, a stop as asked
    (`_stopped_by_timeout`); else a failure, said with the reason and the engine's log."""
    if isinstance(ended, TimedOut) and not run_status(prepared.run_dir).finished and stopped_cleanly(
        read_heartbeats(prepared.run_dir, since_unix=started - 1.0), prepared.job.world_size
    ) is not None:
        _stopped_by_timeout(prepared, plan_path, run_dir, ended, described)
    done = run_status(prepared.run_dir).steps_done
    raise _failure(
        prepared, started, f"pipectl ended the job after {done} of {prepared.job.steps} steps: {ended.message}", watch
    ) from None


# What `timeout(1)` exits with when its command ran out of time: a script tells it from a failure.
TIMED_OUT_EXIT = 124


def _stopped_by_timeout(
    prepared: PreparedLaunch, plan_path: Path, run_dir: Path, ended: TimedOut, described: dict | None
) -> None:
    """A job stopped at its --timeout, every rank at a checkpoint: said as a stop (what was asked),
    with the command that continues it; exit 124 (it did not finish, and nothing failed). With
    `described` (--json), the launch's JSON as a finished one has it, and why it stopped."""
    report = analyse(prepared.run_dir, detail=False)
    status = report.status
    if described is not None:
        print_json({**described, "exit_code": TIMED_OUT_EXIT, "timed_out": ended.message, "status": status.to_dict()})
    else:
        console.print(status_table(report, brief=True))
        console.print(f"stopped at step {status.steps_done} of {prepared.job.steps}: {ended.message}; checkpoint "
                      f"written; continue with: {_continue_command(status, prepared, plan_path, run_dir)}",
                      markup=False, highlight=False)  # fmt: skip
    raise typer.Exit(TIMED_OUT_EXIT)


def _continue_command(status: RunStatus, prepared: PreparedLaunch, plan_path: Path, run_dir: Path) -> str:
    """The launch that continues a stopped run: with the run's own plan where a live resize moved it
    while it trained (the plan launched would move it back)."""
    moved = layout_label(status.plan.chosen) != layout_label(prepared.plan.chosen)
    plan = run_dir / status.job.plan_file if moved else plan_path
    return f"pipectl launch {quote(str(plan))} --run-dir {quote(str(run_dir))} --resume"


def _metrics_bytes(run_dir: Path) -> int:
    """metrics.jsonl's size: it grows by a line a step."""
    try:
        return (run_dir / METRICS_FILE).stat().st_size
    except OSError:
        return 0


def _stopped_for_resize(status: RunStatus) -> bool:
    return status.stopped is not None and status.stopped[1] == RESIZE_STOP


def _say_how_to_go_on(status: RunStatus, prepared: PreparedLaunch, plan_path: Path, run_dir: Path) -> None:
    """After a job that stopped early at a checkpoint: the command that continues it, or, when `pipectl resize`
    stopped it (and starts it again itself), where to follow it. A run a live resize moved while
    it trained continues from its own plan: the one launched would move it back."""
    if _stopped_for_resize(status):
        console.print(f"stopped at step {status.steps_done} for pipectl resize, which starts the job again in its new "
                      f"layout; follow it with: pipectl status {quote(str(run_dir))} --follow")  # fmt: skip
    elif status.stopped is not None:  # not a run that trained every step short of its checkpoints: the table says
        console.print(
            f"stopped at step {status.steps_done} of {prepared.job.steps} (signal or stop request), "
            f"checkpoint written; continue with: {_continue_command(status, prepared, plan_path, run_dir)}"
        )


def check_stopped_while_starting(
    run_dir: Path, started: float, signum: int, again: str, *, ranks_started: bool = True
) -> None:
    """A person stopped the job before its first step (Ctrl-C while the ranks still start, before
    their handlers): the launcher reports the ranks it saw end by SIGTERM as failed, but nothing
    failed and nothing was trained. Said, with the command that starts it again (`again`), exit
    128 + the signal. A rank that did fail (its record) is left to the failure report; without
    `ranks_started` (the stop came before the job was started) none of this start's can have."""
    if ranks_started and read_failures(run_dir, since_unix=started - 1.0):
        return
    name = signal.Signals(signum).name
    if has_checkpoint(run_dir):
        said = f"stopped before its first step ({name}): the run stays at its checkpoint; continue with: {again} --resume"
    else:
        said = f"stopped before the first step ({name}): nothing trained; start it again with: {again} --force"
    err_console.print(said, style="yellow", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(128 + signum)


def _failure(
    prepared: PreparedLaunch, started: float, progress: str, watch: StallWatch, *, log_tail: bool = False
) -> LaunchError:
    """The error for a job that failed or was ended: first the ranks that went silent (the ones
    their peers waited for), then `job_failure`'s account."""
    silent = watch.lines()
    if silent:
        waited = "; the other ranks waited for it" if len(silent) == 1 else "; the other ranks waited for them"
        silent[-1] += waited
    return job_failure(prepared.run_dir, started, progress, before=silent, log_tail=log_tail, go_on="resume with --resume",
                       named=set(watch.silent))  # fmt: skip


def job_failure(
    run_dir: Path, started: float, progress: str, *, go_on: str, before: list[str] = (), log_tail: bool = False,
    named: set[int] = frozenset(),
) -> LaunchError:
    """The error for a job (`launch`'s or `resize`'s) whose ranks failed: what the ranks' own
    failure records say (the first one's exception), a replica lost for good, then `progress`;
    the hint says how to go on (`go_on`) only where a checkpoint exists to go on from. With
    `log_tail` and no record, the engine log's last lines go to stderr first. `named`: ranks the
    lines `before` already account for (silent ones, which pipectl itself ended: not "vanished")."""
    logs = f"full traceback in {run_dir / LOGS_DIR / ENGINE_LOG}"
    failures = read_failures(run_dir, since_unix=started - 1.0)
    tail = _engine_log_tail(run_dir) if log_tail and not failures else ""
    if tail:
        err_console.print(tail, highlight=False, markup=False)
    failed, advice = failure_report(failures)
    # A rank killed (or crashed past every handler) leaves no record; its peers' records then say
    # only that their connection to it broke. Named first when the records say only that a peer
    # went away; else after them (a launcher tearing the job down kills the others). Only beside a
    # record: ranks a stop ended during their start-up (Ctrl-C before their handlers) leave none,
    # and were not killed by anything but it.
    recorded = {failure.rank for failure in failures} | set(named)
    trained = [m.step for m in read_metrics(run_dir) if m.time_unix >= started - 1.0]  # by this launch
    vanished = [
        vanished_line(beat, max(trained, default=None))
        for beat in vanished_ranks(run_dir, since_unix=started - 1.0) if beat.rank not in recorded
    ] if failures else []
    if vanished and failed and not all(says_peer_loss(failure.message) for failure in failures):
        failed, vanished = "\n".join([failed, *(f"  {line}" for line in vanished)]), []
    elif vanished and failed:
        failed = "then " + failed
    recovery = read_recovery(run_dir, since_unix=started - 1.0)
    lost = [recovery_line(recovery)] if recovery is not None and not recovery.recovered else []
    message = "\n".join([*before, *vanished, *([failed] if failed else []), *lost, progress])
    if advice:
        go_on = advice
    elif not has_checkpoint(run_dir):
        go_on = "no checkpoint was written: fix the cause and launch again with --force"
        if any(failure.exception.endswith("CheckpointError") for failure in failures):  # a save failed, not a rank
            go_on += " (or with --train-without-checkpoints)"
    return LaunchError(message, hint=f"{go_on}; {logs}")


# Below this much free space the disk is as good as full: a metrics line still fits, a checkpoint
# of any real model does not.
LOW_DISK_BYTES = 64 * 2**20


class LowDiskWatch:
    """Says on the terminal, once, that the run directory's disk is (nearly) full: the ranks go on
    training, holding metrics lines in memory and skipping checkpoints, and only a person can
    free space; and each spell when metrics.jsonl was refused, once its lines are written (a disk
    full for a few seconds, between two looks at its free space). Looks every `every_seconds`."""

    def __init__(
        self, run_dir: Path, every_seconds: float = 5.0, since_unix: float = 0.0, *, trains_without_checkpoints: bool = True
    ) -> None:
        self.run_dir, self.every_seconds, self.since_unix = run_dir, every_seconds, since_unix
        # False: a first checkpoint that finds no room stops the run (`Checkpointer.save`).
        self.trains_without_checkpoints = trains_without_checkpoints
        self._next = 0.0
        self._said = False
        self._refusals_said = 0

    def check(self, *, now: bool = False) -> list[str]:
        """What to say, if anything, at most every `every_seconds` (`now`: at once, as when the job ends)."""
        if time.monotonic() < self._next and not now:
            return []
        self._next = time.monotonic() + self.every_seconds
        refusals = read_refusals(self.run_dir, since_unix=self.since_unix)
        lines = [refusal_line(refusal) for refusal in refusals[self._refusals_said:]]
        self._refusals_said = len(refusals)
        if self._said:
            return lines
        try:
            free = shutil.disk_usage(self.run_dir).free
        except OSError:
            return lines
        if free >= LOW_DISK_BYTES:
            return lines
        self._said = True
        if not self.trains_without_checkpoints and not has_checkpoint(self.run_dir):
            return [
                f"the disk of {self.run_dir} has {format_bytes(free)} free and the run no checkpoint yet: a first "
                "checkpoint that finds no room stops the run (free space, or launch with --train-without-checkpoints)",
                *lines,
            ]
        return [
            f"the disk of {self.run_dir} has {format_bytes(free)} free: training goes on, metrics wait in memory and "
            "checkpoints are skipped until space is freed",
            *lines,
        ]


def _run_with_progress(
    prepared: PreparedLaunch, timeout: float | None, watch: StallWatch, *, quiet: bool, since_unix: float,
    signals: list[int],
) -> int:
    """Run the engine; tail metrics.jsonl into a Rich progress bar with loss and samples/s, and say
    where the ranks resumed (and which checkpoints could not be loaded) as soon as they have."""
    total = prepared.job.steps
    tail = MetricsTail(prepared.run_dir, from_end=True)
    reported, lost = [], []
    checkpoints_seen = len(read_events(prepared.run_dir))
    with training_progress(quiet=quiet) as progress:
        task = progress.add_task(f"training {prepared.run_dir.name}", total=total, stats="starting ranks…",
                                 completed=min(newest_checkpoint_step(prepared.run_dir), total))  # fmt: skip

        def report() -> None:
            """Where the ranks resumed (once), a lost replica (once), and each checkpoint that did
            not commit."""
            nonlocal checkpoints_seen
            if not lost:
                recovery = read_recovery(prepared.run_dir, since_unix=since_unix)
                if recovery is not None:
                    lost.append(recovery)
                    err_console.print(recovery_line(recovery), style="yellow", highlight=False, markup=False, soft_wrap=True)
            if not reported:
                resumed = read_resume(prepared.run_dir, since_unix=since_unix)
                if resumed is not None:
                    reported.append(resumed)
                    for line in resume_lines(resumed):
                        if resumed.skipped:  # stderr (JSON output stays clean): not what was asked for
                            err_console.print(line, style="yellow", highlight=False, markup=False, soft_wrap=True)
                        elif not quiet:
                            progress.console.print(line, style="dim", highlight=False, markup=False)
            events = read_events(prepared.run_dir)
            for event in events[checkpoints_seen:]:  # training went on without it
                if event.outcome is not CheckpointOutcome.COMMITTED:
                    err_console.print(event.message, style="yellow", highlight=False, markup=False, soft_wrap=True)
            checkpoints_seen = len(events)

        low_disk = LowDiskWatch(
            prepared.run_dir, since_unix=since_unix, trains_without_checkpoints=prepared.job.train_without_checkpoints
        )

        def tick() -> str | None:
            report()
            for warning in low_disk.check():
                err_console.print(warning, style="yellow", highlight=False, markup=False, soft_wrap=True)
            last = tail.latest()
            if last is not None:
                stats = f"loss {last.loss:.4f}  {last.samples_per_second:.1f} samples/s"
                progress.update(task, completed=min(last.step, total), stats=stats)
            return watch.check()

        def say(line: str) -> None:
            err_console.print(line, style="yellow", highlight=False, markup=False)

        try:
            return run_engine(
                prepared.command, prepared.run_dir, on_tick=tick, timeout_seconds=timeout, lock=prepared.lock, say=say,
                signals=signals,
            )  # fmt: skip
        finally:
            report()  # what the job wrote after the last tick (a short job may end before the first)
            for warning in low_disk.check(now=True):
                err_console.print(warning, style="yellow", highlight=False, markup=False, soft_wrap=True)
