"""Resize a run: the same job, the same global batch, on another number of devices (docs/design.md, 'Resize and recovery').

    resize_run("runs/demo", devices=1)

1. decide the new layout first, so a bad request never disturbs a running job: the morph-table
   entry for N (re-planned from the plan's profile only if the table lacks N; fewer devices when
   B cannot be split over N, said so), minus straggler ranks when asked;
2. if the job is running, ask it to stop at the next step boundary (RUN/stop_requested; SIGTERM
   as a fallback) and wait, bounded, until its ranks have written their checkpoint and exited;
3. rewrite plan.json (chosen = the new candidate; the morph table is kept), ds_config.json (the
   launch part's validated config for it) and job.json (world size, schedule, total steps);
4. append a morph record to RUN/morphs.jsonl and relaunch with the same engine. The worker loads
   the newest verified checkpoint that loads (the record's `resume_step` is then corrected to the
   step the ranks report in RUN/logs/resume.json, should they have fallen back past one): each
   rank reads its new stage's parameters and Adam state out of the old layout's rank files
   (`runtime/checkpoint/shards.py`); RNG and data position come from the files' headers, and the data order
   depends on (seed, step, B) only;
5. the record's downtime (request -> first step completed on the new layout) is filled in as
   soon as metrics.jsonl shows that step.

A stopped or finished run is resized the same way (step 2 is skipped); it then trains up to
`steps` in total (default: the job's own total).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipectl.artifacts.cluster import ClusterSpec, SlurmSpec
from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.morph import MorphRecord, MorphTrigger
from pipectl.artifacts.plan import Candidate, Plan
from pipectl.artifacts.run import HOSTFILE, Engine, JobSpec, ResumeRecord
from pipectl.errors import CheckpointError, PipectlError, UserInputError
from pipectl.launch.engines import LaunchCommand, build_command, submit_slurm
from pipectl.launch.supervise import run_engine, signals_held
from pipectl.launch import check_data, check_model, job_node_type, plan_cluster, run_training, slurm_settings
from pipectl.paths import import_root
from pipectl.rundir.lock import RunLock, lock_run_dir
from pipectl.rundir.run import check_steps_beyond_trained, newest_complete_checkpoint
from pipectl.launch.prepare import read_run
from pipectl.launch.prepare import write_run_files
from pipectl.resize.choose import PINNED_DEGREES, LayoutChoice, choose_candidate, replanner, with_entry
from pipectl.rundir.checkpoints import STOP_FILE
from pipectl.runtime.engines.dsconfig import check_candidate, validated_config
from pipectl.runtime.engines.dsinit import free_port
from pipectl.rundir.failures import read_resume, resume_lines
from pipectl.rundir.morph_history import append_record, read_records, update_downtimes, with_downtime, write_history
from pipectl.rundir.metrics import newest_step, read_metrics
from pipectl.resize.stop import (
    RunProcess,
    StopOutcome,
    cancel_slurm_job,
    find_run_processes,
    request_stop,
    starting_launch,
    wait_for_start,
    wait_for_exit,
    wait_for_ranks,
)
from pipectl.rundir.heartbeats import live_ranks, read_heartbeats
from pipectl.words import count
from pipectl.rundir.stragglers import StragglerPolicy, StragglerReport, find_stragglers

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ResizeDecision:
    """What a resize will do, decided before anything is stopped or written."""

    run_dir: Path
    requested_devices: int  # what the user asked for
    usable_devices: int  # after leaving out stragglers
    choice: LayoutChoice
    previous: Candidate
    target_steps: int
    global_batch: int  # B, unchanged
    layers: int  # cuttable layers of the model
    stragglers: StragglerReport | None
    excluded_ranks: list[int]
    notes: list[str]
    # (ranks, layout label) of the newest step in metrics.jsonl: what the run last trained on, which
    # `previous` (its plan) is not after a relaunch that failed before its first step.
    trained: tuple[int, str] | None = None
    nodes: int | None = None  # the nodes the new layout runs on (`resized_nodes`); None: the job's

    @property
    def candidate(self) -> Candidate:
        return self.choice.candidate

    @property
    def from_devices(self) -> int:
        return self.trained[0] if self.trained else self.previous.devices

    @property
    def from_layout(self) -> str:
        return self.trained[1] if self.trained else layout_label(self.previous)


def decide_resize(
    run_dir: str | os.PathLike[str],
    devices: int,
    *,
    steps: int | None = None,
    exclude_stragglers: bool = False,
    straggler_policy: StragglerPolicy | None = None,
    replan: bool = True,
) -> ResizeDecision:
    """Read the run and choose the new layout; raises `UserInputError` naming any bad value.

    A device count the morph table lacks is re-planned from the plan's request and profile
    unless `replan` is off.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UserInputError(f"--devices must be a positive number of devices, got {devices!r}")
    files = read_run(run_dir)
    job = files.job
    if job.node_groups:
        raise UserInputError(
            f"the run is split over device kinds on {len(job.node_groups)} groups of nodes "
            f"({', '.join(g.node_type for g in job.node_groups)}); resize keeps a job's nodes and cannot regroup them",
            hint="plan again for the nodes you keep, then `pipectl launch NEW_PLAN --run-dir RUN --resume` "
            "(the checkpoint is re-cut to the new layout)",
        )
    target_steps = job.steps if steps is None else steps
    if target_steps < 1:
        raise UserInputError(f"--steps must be a positive total number of steps, got {target_steps}")
    notes: list[str] = []
    stragglers = None
    excluded: list[int] = []
    usable = devices
    metrics = read_metrics(files.path)
    if exclude_stragglers:
        stragglers = find_stragglers(metrics, straggler_policy)
        excluded = stragglers.straggler_ranks
        if excluded:
            usable = devices - len(excluded)
            notes += stragglers.describe()
            notes.append(
                f"leaving out straggler rank(s) {', '.join(map(str, excluded))}: "
                f"{usable} of the {devices} requested devices are used"
            )
            if usable < 1:
                raise UserInputError(
                    f"--devices {devices} minus {len(excluded)} straggler(s) leaves no device",
                    hint="ask for more devices or resize without --exclude-stragglers",
                )
        elif stragglers.reason:
            notes.append(f"no straggler left out: {stragglers.reason}")
        else:
            notes.append("no straggler found")
    choice = choose_candidate(files.plan, usable, replan=replanner(files.plan, files.path) if replan else None)
    notes += choice.notes
    # Refused here, before anything is stopped or locked, so that a dry run refuses it too.
    nodes = resized_nodes(job, choice.candidate, run_cluster(files.plan, job) if job.engine is Engine.SLURM else None)
    if nodes != job.nodes and job.engine is Engine.SLURM:
        per_node = choice.candidate.devices // nodes
        notes.append(f"the Slurm job is written anew for {count(nodes, 'node')} x {count(per_node, 'rank')} "
                     f"(was {job.nodes} x {job.ranks_per_node})")  # fmt: skip
    check_steps_beyond_trained(files.path, target_steps, job.steps, given=steps is not None, metrics=metrics)
    last = newest_step(metrics)
    return ResizeDecision(
        # Absolute: the ranks a resize starts run in the run directory, where a relative name is not it.
        run_dir=files.path.resolve(),
        requested_devices=devices,
        usable_devices=usable,
        choice=choice,
        previous=files.plan.chosen,
        target_steps=target_steps,
        global_batch=files.plan.global_batch,
        layers=files.plan.layers,
        stragglers=stragglers,
        excluded_ranks=excluded,
        notes=notes,
        trained=(last.world_size, last.layout) if last is not None and last.layout else None,
        nodes=nodes,
    )


def run_cluster(plan: Plan, job: JobSpec) -> ClusterSpec | None:
    """The cluster the run was launched for: its `--cluster`, else the plan's (None if neither can be
    read here)."""
    asked = (job.options or {}).get("cluster", {}).get("name")
    try:
        return plan_cluster(plan, asked)
    except PipectlError:  # a --cluster file moved since the launch: the plan's own copy
        return plan_cluster(plan, None)


def resized_nodes(job: JobSpec, candidate: Candidate, cluster: ClusterSpec | None) -> int:
    """The nodes the new layout runs on. A Slurm job is submitted anew, so it asks for as many
    nodes as the new layout fills, as `launch` counts them (`launch.job_nodes`): its devices over
    the devices per node of the cluster's node type (the job's ranks per node where the cluster is
    not readable). Other engines keep their nodes (named hosts, an elastic range); the local engine
    runs one. Raises `UserInputError` when the ranks cannot be spread evenly."""
    world = candidate.devices
    if job.engine is Engine.LOCAL:
        return 1
    if job.engine is not Engine.SLURM or job.elastic is not None:
        if world % job.nodes:
            raise UserInputError(
                f"the new layout's {world} ranks cannot be split evenly over the job's {job.nodes} nodes",
                hint="resize to a multiple of the node count",
            )
        return job.nodes
    kinds = cluster.nodes_of_kind(candidate.device) if cluster is not None else []
    per_node = max((n.devices_per_node for n in kinds), default=job.ranks_per_node)
    nodes = -(-world // per_node)
    if world % nodes:
        fewer, more = world // per_node * per_node, nodes * per_node
        raise UserInputError(
            f"the new layout's {world} ranks ({layout_label(candidate)}) cannot be spread evenly over the "
            f"{nodes} nodes of {per_node} devices they need",
            hint=f"resize to a device count that fills whole nodes, e.g. --devices {more}"
            + (f" or {fewer}" if fewer else ""),
        )
    return nodes


# --------------------------------------------------------------------------- rewriting the run


def resized_plan(plan: Plan, choice: LayoutChoice) -> Plan:
    """plan.json after the resize: chosen = the new candidate, the morph table kept (and completed
    with a re-planned entry), a note of the change, and the request as the new layout answers it:
    the device count asked for, without the degrees it pinned that the new layout does not keep
    (`launch --print-config` writes the request back as the keys that re-plan the job)."""
    morph_table = with_entry(plan, choice.entry) if choice.source == "re-planned" else plan.morph_table
    note = (
        f"resized to {choice.candidate.devices} devices ({layout_label(choice.candidate)}) "
        f"from the {choice.source} entry for {choice.requested_devices}"
    )
    unpinned = {
        name: None for name in PINNED_DEGREES if getattr(plan.request, name) not in (None, getattr(choice.candidate, name))
    }
    request = plan.request.model_copy(update={"devices": choice.requested_devices, **unpinned})
    data = plan.model_dump()
    data.update(chosen=choice.candidate.model_dump(), morph_table=[e.model_dump() for e in morph_table],
                request=request.model_dump())  # fmt: skip
    data["notes"] = [*plan.notes, note]
    return Plan.model_validate(data)


def resized_job(job: JobSpec, candidate: Candidate, target_steps: int, nodes: int | None = None) -> JobSpec:
    """job.json for the new layout: world size, nodes (`resized_nodes` unless given), ranks per
    node and total steps."""
    world = candidate.devices
    nodes = resized_nodes(job, candidate, None) if nodes is None else nodes
    port = free_port() if job.master_addr in LOOPBACK else job.master_port
    data = job.model_dump()
    every = min(job.checkpoint_every, target_steps)
    data.update(
        world_size=world,
        nodes=nodes,
        ranks_per_node=world // nodes,
        steps=target_steps,
        checkpoint_every=every,
        master_port=port,
    )
    if data["options"]:  # the stored options a resume reads back train to the new total too
        data["options"].setdefault("training", {})["steps"] = target_steps
        if data["options"].get("cluster", {}).get("nodes"):  # and run on the new layout's nodes
            data["options"]["cluster"]["nodes"] = nodes
        if str(data["options"].get("checkpoint", {}).get("every", "")).isdigit():
            data["options"]["checkpoint"]["every"] = str(every)
    return JobSpec.model_validate(data)


def resized_ds_config(plan: Plan, job: JobSpec, previous: dict[str, Any]) -> dict[str, Any]:
    """The launch part's validated DeepSpeed config for the new chosen candidate (batch keys,
    pipeline cut), with the run's precision, training settings and overlay."""
    return validated_config(
        plan,
        precision=job.precision,
        training=run_training(job, previous),
        total_steps=job.steps,
        overlay=job.ds_config_overlay,
        stored_overlay=job.ds_config_overlay,
    )


def hosts_of(run_dir: Path) -> list[str] | None:
    """Hosts in the run's DeepSpeed hostfile (`host slots=N` lines), if it has one."""
    path = run_dir / HOSTFILE
    if not path.is_file():
        return None
    hosts = [line.split()[0] for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return hosts or None


@dataclass(frozen=True)
class PreparedRelaunch:
    plan: Plan
    job: JobSpec
    ds_config: dict[str, Any]
    command: LaunchCommand


def check_model_and_data(decision: ResizeDecision) -> None:
    """The model and the data as the new layout's ranks will load them (from the run's import root),
    checked as `launch` checks them before any process starts: a data file moved away since the
    launch is refused here, before the running job is stopped or a file rewritten."""
    files = read_run(decision.run_dir)
    with import_root(files.job.import_root):
        plan = resized_plan(files.plan, decision.choice)
        check_model(plan, files.job.model)
        check_data(plan, files.job.data, files.job.model)


def prepare_relaunch(decision: ResizeDecision) -> PreparedRelaunch:
    """The new plan, job, DeepSpeed config (validated by DeepSpeed's parser) and engine command.
    Nothing is written."""
    files = read_run(decision.run_dir)
    plan = resized_plan(files.plan, decision.choice)
    job = resized_job(files.job, decision.candidate, decision.target_steps, decision.nodes)
    ds_config = resized_ds_config(plan, job, files.ds_config)
    slurm = None
    if job.engine is Engine.SLURM:  # the script `launch` wrote, with the cluster file's and launch's settings
        cluster = run_cluster(plan, job)
        stored = SlurmSpec.model_validate((job.options or {}).get("slurm", {}))
        slurm = slurm_settings(cluster, stored, job_node_type(plan, cluster))
    command = build_command(job, files.path, hosts=hosts_of(files.path), slurm=slurm)
    return PreparedRelaunch(plan, job, ds_config, command)


def write_relaunch(run_dir: Path, prepared: PreparedRelaunch) -> None:
    """plan.json, job.json, ds_config.json, launch.sh (and the engine's side files) of the new layout."""
    write_run_files(
        run_dir, plan=prepared.plan, job=prepared.job, ds_config=prepared.ds_config, command=prepared.command
    )


# --------------------------------------------------------------------------- the whole resize


@dataclass
class ResizeResult:
    """What a resize did."""

    run_dir: Path
    decision: ResizeDecision
    record: MorphRecord
    stopped: StopOutcome | None
    prepared: PreparedRelaunch
    exit_code: int | None = None  # None: not relaunched here (slurm, or relaunch=False)
    submit_hint: str = ""
    submitted_job: str | None = None  # the Slurm job id, when the new script was submitted
    notes: list[str] = field(default_factory=list)
    signals: list[int] = field(default_factory=list)  # a person's signals to pipectl while the relaunch ran

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "requested_devices": self.decision.requested_devices,
            "devices": self.decision.candidate.devices,
            "from_layout": self.record.from_layout,
            "to_layout": self.record.to_layout,
            "plan_source": self.record.plan_source,
            "resume_step": self.record.resume_step,
            "target_steps": self.record.target_steps,
            "stopped_running_job": self.record.stopped_running_job,
            "stop_seconds": self.record.stop_seconds,
            "downtime_seconds": self.record.downtime_seconds,
            "excluded_ranks": self.record.excluded_ranks,
            "exit_code": self.exit_code,
            "command": self.prepared.command.shell_line(),
            "submit_hint": self.submit_hint or None,
            "submitted_job": self.submitted_job,
            "notes": self.notes,
        }


Phase = Callable[[str], None]


def resize_run(
    run_dir: str | os.PathLike[str],
    devices: int,
    steps: int | None = None,
    exclude_stragglers: bool = False,
    *,
    straggler_policy: StragglerPolicy | None = None,
    replan: bool = True,
    relaunch: bool = True,
    stop_timeout_seconds: float = 300.0,
    signal_after_seconds: float = 60.0,
    run_timeout_seconds: float | None = None,
    on_phase: Phase | None = None,
    on_tick: Callable[[], None] | None = None,
    decision: ResizeDecision | None = None,
    requested_unix: float | None = None,
    lock_wait_seconds: float = 30.0,
    cancel_slurm: bool = False,
    submit: bool = False,
) -> ResizeResult:
    """Resize the run at `run_dir` to `devices` devices and (unless `relaunch=False`) train it there.

    Blocks until the relaunched job exits (its exit code is in the result; a non-zero code is
    not raised here: the caller reports it). `on_phase` receives one line per phase (stopping,
    relaunching), `on_tick` is called while the new job runs (to tail metrics). A `decision`
    from `decide_resize` (e.g. shown to the user first) is used as is; `requested_unix` is when
    the resize was asked for (default: now), the start of its downtime. The run is rewritten and
    relaunched under its lock (`rundir.lock.lock_run_dir`), waited for up to `lock_wait_seconds`.

    A job running on other hosts (no process here; its heartbeats live: a Slurm job seen from the
    login node) is stopped through the same stop file and waited for through its heartbeats; with
    `cancel_slurm` its Slurm job is cancelled once its ranks have stopped. A Slurm run's new script
    is submitted with `submit`.
    """
    requested_unix = time.time() if requested_unix is None else requested_unix
    say = on_phase or (lambda _line: None)
    if decision is None:
        decision = decide_resize(
            run_dir,
            devices,
            steps=steps,
            exclude_stragglers=exclude_stragglers,
            straggler_policy=straggler_policy,
            replan=replan,
        )
    path = decision.run_dir
    notes = list(decision.notes)
    stopping = _Stopping()
    try:
        # What pipectl itself can check is checked before the running job is disturbed.
        check_candidate(decision.candidate, global_batch=decision.global_batch, layers=decision.layers)
        if relaunch:
            check_model_and_data(decision)
        stopping.processes = find_run_processes(path)
        stopping.remote = [] if stopping.processes else live_ranks(read_heartbeats(path), time.time())
        stopping.starting = [] if stopping.processes or stopping.remote else starting_launch(path)
        prepared, stopped = _stop_job(decision, stopping, signal_after_seconds, stop_timeout_seconds, cancel_slurm, say)
        # One job per run directory: the stopped job's launching process lets go of the lock once
        # its launcher has exited (moments after its ranks); a job that still holds it is not ours.
        lock = lock_run_dir(path, wait_seconds=lock_wait_seconds, role="resize")
    except KeyboardInterrupt as interrupt:
        raise RestartInterrupted(asked=stopping.asked, stopped=stopping.done) from interrupt
    try:
        # From here a Ctrl-C must not leave the run half rewritten, nor a launcher started and not
        # supervised: it is held, and acted on once the job is started (or instead of starting it).
        with signals_held() as held:
            return _rewrite_and_relaunch(decision, prepared, stopped, notes, lock, requested_unix, relaunch,
                                         run_timeout_seconds, say, on_tick, submit, held)  # fmt: skip
    finally:
        lock.release()


class RestartInterrupted(KeyboardInterrupt):
    """Ctrl-C during a resize by restart, before the new job was started: `asked` whether a stop
    request had been written for the running job, `stopped` whether that job had stopped (the run
    then stands at its checkpoint, in its old layout); a request not yet taken is withdrawn."""

    def __init__(self, *, asked: bool, stopped: bool) -> None:
        super().__init__()
        self.asked = asked
        self.stopped = stopped


@dataclass
class _Stopping:
    """The job a resize stops first: its processes here, its ranks elsewhere (seen by their
    heartbeats), or a launch still starting; whether it was asked to stop and has stopped."""

    processes: list[RunProcess] = field(default_factory=list)
    remote: list = field(default_factory=list)
    starting: list[int] = field(default_factory=list)
    asked: bool = False
    done: bool = False


def _stop_job(
    decision: ResizeDecision,
    job: _Stopping,
    signal_after_seconds: float,
    stop_timeout_seconds: float,
    cancel_slurm: bool,
    say: Phase,
) -> tuple[PreparedRelaunch, StopOutcome | None]:
    """Steps 1-2 of a resize: ask the running job (if any) to stop at its next step boundary,
    prepare the relaunch while it finishes the step, wait until it has stopped (`job.done`), and
    withdraw the stop request, also when interrupted or failed."""
    path = decision.run_dir
    stopped = None
    stop_started = time.monotonic()

    def ask(line: str) -> None:
        say(line)
        job.asked = True  # before the request is written: an interruption may come between
        request_stop(path, STOP_FILE)

    try:
        if job.starting:
            # A launch that holds the run but has no rank yet (`launch --resume` a moment ago): its
            # ranks find the stop request at their first step boundary.
            ask(f"a job is starting in {path} (pid {job.starting[0]}): stopping it at its first step boundary")
            job.processes = wait_for_start(path, timeout_seconds=stop_timeout_seconds)
        if job.processes:
            ask(f"stopping the running job at its next step boundary ({len(job.processes)} processes)")
        elif job.remote:
            hosts = ", ".join(sorted({b.host for b in job.remote}))
            ask(f"stopping the job running on {hosts} at its next step boundary "
                f"({count(len(job.remote), 'rank')}, seen by their heartbeats)")  # fmt: skip
        # DeepSpeed's parser validates the new config while the old ranks finish their step.
        prepared = prepare_relaunch(decision)
        if job.processes:
            stopped = wait_for_exit(path, job.processes, signal_after_seconds=signal_after_seconds,
                                    timeout_seconds=stop_timeout_seconds, started=stop_started,
                                    include_launchers=prepared.job.elastic is not None)  # fmt: skip
            say(f"stopped in {stopped.seconds:.1f} s" + (" (SIGTERM was needed)" if stopped.signalled else ""))
        elif job.remote:
            stopped = wait_for_ranks(path, job.remote, timeout_seconds=stop_timeout_seconds, started=stop_started)
            say(f"stopped in {stopped.seconds:.1f} s")
        job.done = True
        if cancel_slurm and (job.processes or job.remote):
            say(f"cancelled Slurm job {cancel_slurm_job(path)}")
    finally:
        # A stop request left behind (by this resize or an earlier one) would stop the new job at
        # once; one the job has not taken yet (interrupted, failed) must not stop it, or a later
        # resume of it, at some step boundary to come.
        (path / STOP_FILE).unlink(missing_ok=True)
    return prepared, stopped


def check_resumable(decision: ResizeDecision) -> None:
    """Refuse a resize of a run that trained steps but holds no complete checkpoint: the new layout
    would start over from step 0 (as `launch --resume` refuses, a resize must not quietly throw the
    steps away). Checked before anything is printed for a stopped run, and again under the lock
    once a running job has stopped (it may have checkpointed meanwhile)."""
    path = decision.run_dir
    if newest_complete_checkpoint(path) is not None:
        return
    trained = max((m.step for m in read_metrics(path)), default=0)
    if trained:
        raise UserInputError(
            f"cannot resize {path}: it trained {count(trained, 'step')} but wrote no checkpoint, so the new layout "
            "would start over from step 0",
            hint=f"start over deliberately: plan for {count(decision.requested_devices, 'device')}, then pipectl "
            f"launch NEW_PLAN --run-dir {path} --force",
        )


def _rewrite_and_relaunch(
    decision: ResizeDecision,
    prepared: PreparedRelaunch,
    stopped: StopOutcome | None,
    notes: list[str],
    lock: RunLock,
    requested_unix: float,
    relaunch: bool,
    run_timeout_seconds: float | None,
    say: Phase,
    on_tick: Callable[[], None] | None,
    submit: bool,
    held: list[int],
) -> ResizeResult:
    """Steps 3-5 of a resize, under the run's lock. `held`: the signals a person sent meanwhile
    (`signals_held`); one sent before the new job starts keeps it from starting."""
    path = decision.run_dir
    latest = newest_complete_checkpoint(path)
    resume_step = latest.step if latest is not None and latest.step is not None else 0
    if latest is None:
        check_resumable(decision)
        notes.append("the run has no verified checkpoint: the new layout starts from step 0")
    if decision.target_steps <= resume_step:
        raise CheckpointError(
            f"the job reached step {resume_step} while stopping: nothing is left to train up to "
            f"--steps {decision.target_steps} on the new layout",
            hint=f"resize again with --steps larger than {resume_step}",
        )

    write_relaunch(path, prepared)
    record = MorphRecord(
        trigger=MorphTrigger.RESIZE,
        requested_unix=requested_unix,
        requested_devices=decision.requested_devices,
        from_devices=decision.from_devices,
        from_layout=decision.from_layout,
        to_devices=decision.candidate.devices,
        to_layout=layout_label(decision.candidate),
        global_batch=prepared.plan.global_batch,
        resume_step=resume_step,
        target_steps=decision.target_steps,
        stopped_running_job=stopped is not None,
        stop_seconds=stopped.seconds if stopped else None,
        plan_source=decision.choice.source,
        excluded_ranks=decision.excluded_ranks,
        notes=notes,
    )
    result = ResizeResult(path, decision, record, stopped, prepared, notes=notes)
    if held:  # stopped by its user before it started again (or was submitted): the run stands at its
        append_record(path, record)  # checkpoint, in its new layout
        result.signals.extend(held)
        result.submit_hint = "" if prepared.command.runnable_here else prepared.command.submit_hint
        return result
    if not relaunch or not prepared.command.runnable_here:
        append_record(path, record)
        if relaunch and submit and prepared.job.engine is Engine.SLURM:
            result.submitted_job = submit_slurm(path)  # said once, by the caller
        else:
            result.submit_hint = prepared.command.submit_hint
        return result
    say(
        f"relaunching on {count(decision.candidate.devices, 'rank')} ({record.to_layout}); "
        f"newest complete checkpoint: step {resume_step}"
    )
    record = record.model_copy(update={"relaunched_unix": time.time()})
    append_record(path, record)
    result.record = record
    index = len(read_records(path)) - 1
    resumed: list[ResumeRecord] = []

    def tick() -> None:
        if not resumed:
            _fill_resume_step(path, result, index, resumed, say)
        if result.record.downtime_seconds is None:
            _fill_downtime(path, result, index)
        if on_tick is not None:
            on_tick()

    result.exit_code = run_engine(
        prepared.command, path, on_tick=tick, timeout_seconds=run_timeout_seconds, lock=lock, signals=result.signals,
        held=held,
    )
    if not resumed:
        _fill_resume_step(path, result, index, resumed, say)
    records = update_downtimes(path)
    if index < len(records):
        # A person's stop before the first step is no failure of the new layout (nothing ran on it).
        if result.exit_code != 0 and records[index].first_step_unix is None and not result.signals:
            # Not one step on the new layout: the run still stands where its checkpoint is, and a
            # later step (another resize's) must not be taken for this move's downtime.
            records[index] = records[index].model_copy(update={"failed_exit_code": result.exit_code})
            write_history(path, records)
        result.record = records[index]
    return result


def _fill_resume_step(run_dir: Path, result: ResizeResult, index: int, resumed: list, say: Phase) -> None:
    """Once the ranks have recorded where they resumed (logs/resume.json), store that step in the
    morph record (they fall back past a checkpoint that does not load) and say it."""
    record = read_resume(run_dir, since_unix=(result.record.relaunched_unix or 0.0) - 1.0)
    if record is None:
        return
    resumed.append(record)
    for line in resume_lines(record) or ["started from step 0"]:
        say(line)
    update: dict[str, Any] = {"resume_step": record.step}
    if record.skipped:
        update["notes"] = [*result.record.notes, *record.skipped]
        result.notes.extend(record.skipped)
    result.record = result.record.model_copy(update=update)
    records = read_records(run_dir)
    if index < len(records):
        records[index] = records[index].model_copy(update=update)
        write_history(run_dir, records)


def _fill_downtime(run_dir: Path, result: ResizeResult, index: int) -> None:
    """Once metrics show the new layout's first step, store the downtime in the record."""
    filled = with_downtime(result.record, read_metrics(run_dir))
    if filled.downtime_seconds is None:
        return
    result.record = filled
    records = read_records(run_dir)
    if index < len(records):
        records[index] = filled
        write_history(run_dir, records)
