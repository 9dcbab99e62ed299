"""`pipectl launch PLAN.json --run-dir runs/NAME`: validate, write the run directory, train."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from pydantic import ValidationError

from pipectl.artifacts.cluster import SlurmSpec
from pipectl.artifacts.plan import Plan
from pipectl.artifacts.run import (
    LOGS_DIR,
    CheckpointOutcome,
    DataKind,
    DataSpec,
    ElasticRange,
    Engine,
    LrSchedule,
    Precision,
)
from pipectl.cli.context import JsonFlag, console, err_console, print_json, training_progress
from pipectl.errors import LaunchError, UserInputError
from pipectl.io import load_model, read_mapping
from pipectl.launch import (
    TRAINING_DEFAULTS,
    LaunchOptions,
    PreparedLaunch,
    parse_checkpoint_interval,
    prepare_launch,
    resumed_options,
    run_engine,
)
from pipectl.launch.engines import ENGINE_LOG, JobEnded
from pipectl.launch.placement import placement_note
from pipectl.paths import given_file
from pipectl.launch.rundir import check_steps_beyond_trained, is_run_dir, run_files, run_status
from pipectl.report.run_tables import failure_report, status_table
from pipectl.resize.replicas import read_recovery, recovery_line
from pipectl.runtime.checkpoint import has_checkpoint, read_events
from pipectl.runtime.dsconfig import check_schedule
from pipectl.runtime.failure import read_failures, read_resume, resume_lines
from pipectl.runtime.liveness import StallWatch, job_collective_timeout_seconds, read_heartbeats, stopped_cleanly
from pipectl.runtime.metrics import MetricsTail


def parse_elastic(text: str) -> ElasticRange:
    """`MIN:MAX` node counts, e.g. `1:2`."""
    low, sep, high = text.partition(":")
    if not sep or not low.isdigit() or not high.isdigit() or int(low) < 1 or int(low) > int(high):
        raise UserInputError(f"--elastic {text!r} is not MIN:MAX node counts with 1 <= MIN <= MAX (e.g. 1:2)")
    return ElasticRange(min_nodes=int(low), max_nodes=int(high))


def parse_hosts(text: str) -> list[str]:
    """`--hosts h1,h2,...`: each host once, none empty.

    >>> parse_hosts("n1, n2")
    ['n1', 'n2']
    """
    hosts = [h.strip() for h in text.split(",")]
    if any(not h or any(c.isspace() for c in h) for h in hosts):
        raise UserInputError(f"--hosts {text!r} has an empty or blank entry", hint="give host names separated by commas")
    repeated = next((h for i, h in enumerate(hosts) if h in hosts[:i]), None)
    if repeated is not None:
        raise UserInputError(
            f"--hosts names {repeated} twice: one entry per node", hint="a node's ranks are its slots, not repeated names"
        )
    return hosts


def parse_data(text: str) -> DataSpec:
    """`builtin` (default corpus), `synthetic`, a path to a token or text file, or a dataset
    function `package.module:function`."""
    if text in (DataKind.BUILTIN.value, DataKind.SYNTHETIC.value):
        return DataSpec(kind=DataKind(text))
    path = given_file(text)
    if path is not None:
        return DataSpec(kind=DataKind.FILE, path=str(path))
    module, sep, function = text.partition(":")
    if sep and module and function.isidentifier() and all(part.isidentifier() for part in module.split(".")):
        return DataSpec(kind=DataKind.DATASET, reference=text)
    raise UserInputError(
        f"--data {text!r} is neither 'builtin', 'synthetic', an existing file nor a dataset 'package.module:function'"
    )


# SlurmSpec's fields that `launch` options set, by the option's name.
_SLURM_OPTIONS = {"partition": "--partition", "account": "--account", "time": "--time-limit"}


def _slurm_flags(**values: str | None) -> SlurmSpec:
    try:
        return SlurmSpec(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        option = _SLURM_OPTIONS.get(field, "/".join(_SLURM_OPTIONS.values()))
        raise UserInputError(f"{option} {values.get(field)!r}: {first['msg'].removeprefix('Value error, ')}") from None


def _tcp_port(port: int | None) -> int | None:
    if port is not None and not 1 <= port <= 65535:
        raise UserInputError(f"--master-port {port} is not a TCP port (1..65535)")
    return port


def _engine_log_tail(run_dir: Path, lines: int = 15) -> str:
    log = run_dir / LOGS_DIR / ENGINE_LOG
    if not log.is_file():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# CLI parameter -> LaunchOptions field, where the names differ.
_OPTION_OF_PARAMETER = {"lr": "learning_rate", "bf16": "precision"}


def register(app: typer.Typer) -> None:
    """Add `pipectl launch` to the root app."""

    @app.command("launch")
    def launch_command(
        ctx: typer.Context,
        plan_path: Annotated[Path, typer.Argument(help="plan.json from `pipectl plan`.", metavar="PLAN.json")],
        run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory to create, e.g. runs/demo.")],
        engine: Annotated[Engine, typer.Option(help="How to start the ranks.")] = Engine.LOCAL,
        model: Annotated[Optional[str], typer.Option(help="Model reference (default: the plan's model).")] = None,
        steps: Annotated[int, typer.Option(min=1, help="Optimizer steps in total.")] = 20,
        checkpoint_every: Annotated[
            str,
            typer.Option(
                help="Checkpoint every K steps, every wall time (15m, 90s, 2h), or 'auto' (Young/Daly from the "
                "measured stall and --mtbf-hours); 0: only at the end and on SIGTERM."
            ),
        ] = "0",
        mtbf_hours: Annotated[
            Optional[float],
            typer.Option(
                min=0.001,
                help="Expected hours between failures of the whole job, for --checkpoint-every auto "
                "(default: 50,000 device-hours / devices).",
            ),
        ] = None,
        keep_checkpoints: Annotated[int, typer.Option(min=1, help="Verified checkpoints to keep.")] = 3,
        data: Annotated[
            str,
            typer.Option(help="'builtin' corpus, 'synthetic', a token file (.npy, .bin), a text file (.txt, .md), or a "
                         "dataset function package.module:function."),
        ] = "builtin",
        seed: Annotated[int, typer.Option(help="Seed of weights and data order.")] = 0,
        lr: Annotated[float, typer.Option(min=0.0, max=10.0, help="AdamW (peak) learning rate.")] = TRAINING_DEFAULTS.learning_rate,
        weight_decay: Annotated[float, typer.Option(min=0.0, max=10.0, help="AdamW weight decay.")] = TRAINING_DEFAULTS.weight_decay,
        gradient_clipping: Annotated[
            float, typer.Option(min=0.0, help="Clip the global gradient norm to this (0: no clipping).")
        ] = TRAINING_DEFAULTS.gradient_clipping,
        lr_schedule: Annotated[
            LrSchedule, typer.Option(help="constant (WarmupLR with --warmup-steps), warmup-decay or warmup-cosine.")
        ] = TRAINING_DEFAULTS.lr_schedule,
        warmup_steps: Annotated[int, typer.Option(min=0, help="Steps of linear learning-rate warm-up.")] = TRAINING_DEFAULTS.warmup_steps,
        ds_config_overlay: Annotated[
            Optional[Path],
            typer.Option(
                help="JSON or YAML merged into the DeepSpeed config (monitor, optimizer params, ...); keys the plan "
                "owns are refused. Validated by DeepSpeed's parser.",
                metavar="FILE",
            ),
        ] = None,
        precision: Annotated[
            Optional[Precision],
            typer.Option("--precision", help="fp32, bf16 or fp16; default: the plan's (its profile's dtype), which it must match."),
        ] = None,
        bf16: Annotated[bool, typer.Option("--bf16", help="Same as --precision bf16.")] = False,
        elastic: Annotated[
            Optional[str], typer.Option(help="torchrun elastic node range MIN:MAX (engine torchrun).")
        ] = None,
        recover_in_memory: Annotated[
            bool,
            typer.Option(
                "--recover-in-memory",
                help="Engine local, d >= 2: one torchrun per data-parallel replica, each rank keeping a copy of its "
                "neighbour replica's state after every step, so that a lost replica is recovered from the survivors' "
                "memory without a checkpoint.",
            ),
        ] = False,
        nodes: Annotated[
            Optional[int],
            typer.Option(min=1, help="Nodes for torchrun/deepspeed/slurm (default: the plan's devices over the cluster's devices per node)."),
        ] = None,
        cluster: Annotated[
            Optional[str], typer.Option(help="Cluster name or YAML the job runs on (default: the plan's).")
        ] = None,
        partition: Annotated[Optional[str], typer.Option(help="slurm: #SBATCH --partition (over the cluster file's).")] = None,
        account: Annotated[Optional[str], typer.Option(help="slurm: #SBATCH --account (over the cluster file's).")] = None,
        time_limit: Annotated[
            Optional[str], typer.Option(help="slurm: #SBATCH --time, e.g. 2-00:00:00 (over the cluster file's).")
        ] = None,
        hosts: Annotated[
            Optional[str], typer.Option(help="Comma-separated hosts for the deepspeed hostfile.")
        ] = None,
        master_addr: Annotated[
            Optional[str],
            typer.Option(help="Rendezvous/master address (default: loopback on one node, this host for torchrun, "
            "the first --hosts entry for deepspeed, the allocation's first node for slurm)."),
        ] = None,
        master_port: Annotated[
            Optional[int],
            typer.Option(callback=_tcp_port, help="Rendezvous/master port 1..65535 (default: a free one)."),
        ] = None,
        resume: Annotated[bool, typer.Option("--resume", help="Continue an existing run from its checkpoint.")] = False,
        force: Annotated[bool, typer.Option("--force", help="Delete an existing run directory first.")] = False,
        change_global_batch: Annotated[
            bool,
            typer.Option(
                "--change-global-batch",
                help="With --resume: the plan's global batch differs from the run's on purpose (recorded in job.json).",
            ),
        ] = False,
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Validate and print the config and command; write and run nothing.")
        ] = False,
        timeout: Annotated[
            Optional[float], typer.Option(min=1.0, help="Stop the job after this many seconds.")
        ] = None,
        collective_timeout: Annotated[
            Optional[float],
            typer.Option(
                min=1.0,
                max=7 * 24 * 3600.0,
                help="Seconds a rank waits in a collective for a silent peer before the job fails "
                "(default: 10 predicted steps, at least 120 s, plus a checkpoint write).",
            ),
        ] = None,
        json_output: JsonFlag = False,
    ) -> None:
        """Run a plan inside DeepSpeed's pipeline engine (a plan for engine torch: PyTorch's pipelining
        runtime), with checkpoints and metrics."""
        plan = load_model(Plan, plan_path)
        check_schedule(plan.chosen)  # before anything else: a 2BW plan is another optimizer
        if resume and not is_run_dir(run_dir):  # checked here too: a dry run never reaches prepare_run_dir
            raise UserInputError(f"cannot resume {run_dir}: no such run (it holds no job.json)")
        data_spec = parse_data(data)  # checked against the model in `prepare_launch`, as the ranks will read it
        every_steps, every_seconds, every_auto = parse_checkpoint_interval(checkpoint_every)
        elastic_range = parse_elastic(elastic) if elastic else None
        if elastic_range is not None and engine is not Engine.TORCHRUN:
            raise UserInputError(f"--elastic needs --engine torchrun, not {engine.value}")
        if bf16 and precision not in (None, Precision.BF16):
            raise UserInputError(f"--bf16 contradicts --precision {precision.value}")
        options = LaunchOptions(
            engine=engine,
            model=model,
            steps=steps,
            checkpoint_every=every_steps,
            checkpoint_every_seconds=every_seconds,
            checkpoint_auto=every_auto,
            mtbf_hours=mtbf_hours,
            keep_checkpoints=keep_checkpoints,
            seed=seed,
            data=data_spec,
            precision=Precision.BF16 if bf16 else precision,
            learning_rate=lr,
            weight_decay=weight_decay,
            gradient_clipping=gradient_clipping,
            lr_schedule=lr_schedule,
            warmup_steps=warmup_steps,
            ds_config_overlay=read_mapping(ds_config_overlay) if ds_config_overlay is not None else {},
            elastic=elastic_range,
            recover_in_memory=recover_in_memory,
            nodes=nodes,
            hosts=parse_hosts(hosts) if hosts else None,
            master_addr=master_addr,
            master_port=master_port,
            cluster=cluster,
            slurm=_slurm_flags(partition=partition, account=account, time=time_limit),
            resume=resume,
            force=force,
            change_global_batch=change_global_batch,
            collective_timeout=collective_timeout,
            as_given={
                **({"model": model} if model else {}),
                **({"data": data} if data_spec.kind is not DataKind.BUILTIN else {}),
            },
        )
        # A resume continues the run: what the user did not pass keeps the run's value.
        passed = {
            _OPTION_OF_PARAMETER.get(name, name)
            for name in ctx.params
            if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")
        }
        if "checkpoint_every" in passed:  # one flag sets the interval in whichever unit it names
            passed |= {"checkpoint_every_seconds", "checkpoint_auto"}
        options = resumed_options(run_dir, options, passed, plan)
        if resume and "steps" in passed and is_run_dir(run_dir):
            check_steps_beyond_trained(run_dir, steps, steps)
        prepared = prepare_launch(plan, run_dir, options, plan_dir=plan_path.parent, write=not dry_run)
        try:
            _launch(prepared, plan_path, run_dir, timeout=timeout, dry_run=dry_run, json_output=json_output)
        finally:
            if prepared.lock is not None:  # the job has ended: the run directory is free again
                prepared.lock.release()


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
    }
    if prepared.job.node_groups and not json_output:
        console.print(placement_note(prepared.job.node_groups, prepared.hosts), soft_wrap=True, highlight=False, markup=False)
    if dry_run:
        if json_output:
            print_json({**described, "files": files})
        else:
            for name, text in files.items():  # a header line per file (a rule would span a piped console)
                console.print(f"── {prepared.run_dir / name} ──", style="dim", soft_wrap=True, highlight=False, markup=False)
                console.print(text.rstrip("\n"), soft_wrap=True, highlight=False, markup=False)
            console.print(f"[bold]command:[/] {prepared.command.shell_line()}", soft_wrap=True, highlight=False)
            console.print("[dim]dry run: nothing written, nothing started[/]")
        return
    if not prepared.command.runnable_here:
        if json_output:
            print_json({**described, "submitted": False, "hint": prepared.command.submit_hint})
        else:
            console.print(f"wrote {prepared.run_dir}; {prepared.command.submit_hint}")
        return
    if prepared.busier and not json_output:
        err_console.print(prepared.busier, style="yellow", highlight=False, markup=False, soft_wrap=True)
    started = time.time()
    watch = StallWatch(
        prepared.run_dir,
        since_unix=started - 1.0,
        collective_timeout_seconds=job_collective_timeout_seconds(prepared.job, prepared.plan.chosen),
    )
    try:
        exit_code = _run_with_progress(prepared, timeout, watch, quiet=json_output, since_unix=started - 1.0)
    except JobEnded as ended:
        done = run_status(prepared.run_dir).steps_done
        raise _failure(
            prepared, started, f"pipectl ended the job after {done} of {prepared.job.steps} steps: {ended.message}", watch
        ) from None
    status = run_status(prepared.run_dir)
    resumed = read_resume(prepared.run_dir, since_unix=started - 1.0)
    if exit_code != 0:
        stopped_at = stopped_cleanly(read_heartbeats(prepared.run_dir, since_unix=started - 1.0), prepared.job.world_size)
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
    if json_output:
        resume = None if resumed is None else resumed.model_dump(mode="json", exclude={"schema_version"})
        print_json({**described, "exit_code": exit_code, "resumed": resume, "status": status.to_dict()})
        return
    console.print(status_table(status, brief=True))
    if not status.finished:
        console.print(
            f"stopped at step {status.steps_done} of {prepared.job.steps} (signal or stop request), "
            f"checkpoint written; continue with: pipectl launch {plan_path} --run-dir {run_dir} --resume"
        )


def _failure(
    prepared: PreparedLaunch, started: float, progress: str, watch: StallWatch, *, log_tail: bool = False
) -> LaunchError:
    """The error for a job that failed or was ended: first the ranks that went silent (the ones
    their peers waited for), then `job_failure`'s account."""
    silent = watch.lines()
    if silent:
        waited = "; the other ranks waited for it" if len(silent) == 1 else "; the other ranks waited for them"
        silent[-1] += waited
    return job_failure(prepared.run_dir, started, progress, before=silent, log_tail=log_tail, go_on="resume with --resume")


def job_failure(
    run_dir: Path, started: float, progress: str, *, go_on: str, before: list[str] = (), log_tail: bool = False
) -> LaunchError:
    """The error for a job (`launch`'s or `resize`'s) whose ranks failed: what the ranks' own
    failure records say (the first one's exception), a replica lost for good, then `progress`;
    the hint says how to go on (`go_on`) only where a checkpoint exists to go on from. With
    `log_tail` and no record, the engine log's last lines go to stderr first."""
    logs = f"full traceback in {run_dir / LOGS_DIR / ENGINE_LOG}"
    failures = read_failures(run_dir, since_unix=started - 1.0)
    tail = _engine_log_tail(run_dir) if log_tail and not failures else ""
    if tail:
        err_console.print(tail, highlight=False, markup=False)
    failed, advice = failure_report(failures)
    recovery = read_recovery(run_dir, since_unix=started - 1.0)
    lost = [recovery_line(recovery)] if recovery is not None and not recovery.recovered else []
    message = "\n".join([*before, *([failed] if failed else []), *lost, progress])
    if advice:
        go_on = advice
    elif not has_checkpoint(run_dir):
        go_on = "no checkpoint was written: fix the cause and launch again with --force"
    return LaunchError(message, hint=f"{go_on}; {logs}")


def _run_with_progress(
    prepared: PreparedLaunch, timeout: float | None, watch: StallWatch, *, quiet: bool, since_unix: float
) -> int:
    """Run the engine; tail metrics.jsonl into a Rich progress bar with loss and samples/s, and say
    where the ranks resumed (and which checkpoints could not be loaded) as soon as they have."""
    total = prepared.job.steps
    tail = MetricsTail(prepared.run_dir)
    reported, lost = [], []
    checkpoints_seen = len(read_events(prepared.run_dir))
    with training_progress(quiet=quiet) as progress:
        task = progress.add_task(f"training {prepared.run_dir.name}", total=total, stats="starting ranks…")

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

        def tick() -> str | None:
            report()
            last = tail.latest()
            if last is not None:
                stats = f"loss {last.loss:.4f}  {last.samples_per_second:.1f} samples/s"
                progress.update(task, completed=min(last.step, total), stats=stats)
            return watch.check()

        def say(line: str) -> None:
            err_console.print(line, style="yellow", highlight=False, markup=False)

        try:
            return run_engine(
                prepared.command, prepared.run_dir, on_tick=tick, timeout_seconds=timeout, lock=prepared.lock, say=say
            )
        finally:
            report()  # what the job wrote after the last tick (a short job may end before the first)
