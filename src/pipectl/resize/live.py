"""`pipectl resize RUN --devices N --live`: the running job takes the new layout without a restart.

The decision is the restart path's (`restart.decide_resize`: the morph table's entry for N, the same
global batch); what differs is how the job gets there (`runtime/elastic/live_resize.py` is the ranks' side):

1. check the job can move live: it runs here, on one host, under the local or torchrun engine,
   with no split over device kinds; otherwise `LiveUnavailable` says why (the CLI then restarts);
2. write plan.json, job.json and ds_config.json for the new layout into RUN/live/next (validated
   by DeepSpeed's parser, exactly as a restart would): the run's own files change only once the
   new layout has taken its first step, when rank 0 moves these in, so a resize that ends before
   (refused, timed out, killed) leaves the run as it was;
3. when N grows, start the N - W joining ranks (`python -m pipectl.runtime.worker --join`, new
   ranks W .. N-1, their logs in RUN/logs/join-rank{R}.log) and wait until each has imported torch
   and DeepSpeed and read the job (RUN/live/ready-rank{R}): the running ranks never wait for that;
4. write RUN/resize_requested.json; the ranks take it at their next step boundary, hand their
   state over in memory and go on; rank 0 moves the staged files in and appends the morph record
   after the first new step;
5. wait for that record (or for the job to end) and return it.

The joining ranks outlive this command once it has written the request: they belong to the job
from then on, and end with it. Before that, a joining rank leaves as soon as this command has
ended (`runtime.elastic.live_resize.JoinAbandoned`): no orphan waits for a hand-over no one asked for.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.morph import MorphRecord, MorphTrigger, LiveResizeRequest
from pipectl.artifacts.plan import Engine as PlanEngine
from pipectl.artifacts.run import JOB_FILE, LAUNCH_SCRIPT, LOGS_DIR, Engine
from pipectl.errors import LaunchError
from pipectl.io import write_json_atomic
from pipectl.launch.engines import rank_environment
from pipectl.rundir.processes import WORKER_MODULE, RunProcess, find_run_ranks
from pipectl.rundir.lock import lock_holder
from pipectl.launch.prepare import read_run
from pipectl.launch.prepare import write_run_files
from pipectl.launch.supervise import start_detached
from pipectl.resize.restart import PreparedRelaunch, ResizeDecision, prepare_relaunch
from pipectl.rundir.checkpoints import STOP_FILE
from pipectl.runtime.engines.dsconfig import check_candidate
from pipectl.runtime.engines.dsinit import free_port
from pipectl.rundir.morph_history import read_records
from pipectl.rundir.status import run_status
from pipectl.rundir.live_requests import JOIN_DIR, RESIZE_PID_VARIABLE, STAGED_DIR, ready_path, request_path
from pipectl.rundir.heartbeats import SUPERVISOR_VARIABLE, pid_alive
from pipectl.words import count


class LiveUnavailable(LaunchError):
    """This job cannot move live; the message says why (a restart can). `running` is False when no
    rank of it runs here at all (a stopped run: a restart is simply the way)."""

    def __init__(self, message: str, *, running: bool = True) -> None:
        super().__init__(message)
        self.running = running


class ResizeInterrupted(KeyboardInterrupt):
    """Ctrl-C during a live resize, after its clean-up: `asked` whether the request had been
    written (then withdrawn: a job whose ranks had taken it already moves all the same)."""

    def __init__(self, asked: bool) -> None:
        super().__init__()
        self.asked = asked


@dataclass
class LiveResult:
    record: MorphRecord
    joined: list[int] = field(default_factory=list)  # pids of the joining ranks started here


Phase = Callable[[str], None]


# How long a resize waits for the ranks a live shrink left out to exit (they do once the hand-over
# is done; a loaded host can take a few steps) before it calls the run busy.
DEPARTING_RANKS_SECONDS = 60.0


def check_live(decision: ResizeDecision, say: Phase | None = None,
               departing_seconds: float = DEPARTING_RANKS_SECONDS) -> None:  # fmt: skip
    """Raise `LiveUnavailable` naming why this run cannot be resized live, before anything changes."""
    files = read_run(decision.run_dir)
    job = files.job
    if PlanEngine.TORCH in (files.plan.chosen.engine, decision.candidate.engine):
        raise LiveUnavailable(
            f"the {'running' if files.plan.chosen.engine is PlanEngine.TORCH else 'new'} layout runs on the torch engine "
            "(PyTorch's pipelining runtime); a live resize hands DeepSpeed engines' state over in memory, the torch "
            "engine moves through its checkpoint (the same format: a restart resumes it in either engine)"
        )
    ranks = find_run_ranks(decision.run_dir)
    if not ranks:
        raise LiveUnavailable("no rank of the run is running on this machine", running=False)
    if job.engine not in (Engine.LOCAL, Engine.TORCHRUN) or job.nodes != 1 or job.elastic is not None:
        raise LiveUnavailable(
            f"a live resize moves ranks on one host under the local or torchrun engine; this run uses "
            f"{job.engine.value} on {count(job.nodes, 'node')}" + (" (elastic)" if job.elastic is not None else "")
        )
    if job.node_groups:
        raise LiveUnavailable("the run is split over device kinds; its node groups are fixed")
    if job.recover_in_memory and job.world_size > 1:
        raise LiveUnavailable(
            "the job recovers a lost replica in memory, one torchrun per replica; ranks moved live would "
            "be outside them"
        )
    if len(ranks) > files.plan.chosen.devices and _shrunk_live_to(decision.run_dir, files.plan.chosen.devices):
        ranks = _without_departing(decision.run_dir, files.plan.chosen.devices, say, departing_seconds)
    if files.plan.chosen.devices != len(ranks):
        raise LiveUnavailable(
            f"{count(len(ranks), 'rank')} running here for a layout of {files.plan.chosen.devices} "
            "(a resize or restart is already under way)"
        )
    if files.plan.chosen.device != decision.candidate.device:
        raise LiveUnavailable(f"the new layout runs on {decision.candidate.device}, the job on {files.plan.chosen.device}")


def _shrunk_live_to(path: Path, devices: int) -> bool:
    """Whether the run's last move was a live one down to `devices` ranks (the others then exit)."""
    records = read_records(path)
    return bool(records) and records[-1].path == "live" and records[-1].to_devices == devices < records[-1].from_devices


def _without_departing(path: Path, devices: int, say: Phase | None, seconds: float) -> list[RunProcess]:
    """The run's ranks once at most `devices` are left, or as they are after `seconds`."""
    if say is not None:
        say("waiting for the ranks the last live resize left out to exit")
    deadline = time.monotonic() + seconds
    while True:
        ranks = find_run_ranks(path)
        if len(ranks) <= devices or time.monotonic() >= deadline:
            return ranks
        time.sleep(0.2)


def live_resize(
    decision: ResizeDecision,
    *,
    requested_unix: float,
    say: Phase | None = None,
    ready_timeout_seconds: float = 300.0,
    handover_timeout_seconds: float = 600.0,
) -> LiveResult:
    """Steps 1-5 above. Raises `LiveUnavailable` before anything changes when the job cannot move
    live, `LaunchError` when the hand-over does not happen (the previous run files are restored
    if the request was never taken)."""
    say = say or (lambda _line: None)
    path = decision.run_dir
    check_candidate(decision.candidate, global_batch=decision.global_batch, layers=decision.layers)
    with _one_at_a_time(path):
        check_live(decision, say)
        return _move(decision, requested_unix, say, ready_timeout_seconds, handover_timeout_seconds)


@contextmanager
def _one_at_a_time(path: Path):
    """An exclusive lock on RUN/live/resize.lock: one live resize of a run at a time."""
    folder = path / JOIN_DIR
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "resize.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LaunchError("another live resize of this run is under way", hint="wait for it to finish") from None
        yield


def _move(decision: ResizeDecision, requested_unix: float, say: Phase, ready_timeout_seconds: float,
          handover_timeout_seconds: float) -> LiveResult:  # fmt: skip
    path = decision.run_dir
    prepared = prepare_relaunch(decision)
    old_world, new_world = decision.previous.devices, decision.candidate.devices
    request = live_request(decision, prepared, requested_unix=requested_unix).model_copy(update={"staged": STAGED_DIR})
    joiners: list[subprocess.Popen] = []
    requested = False
    try:
        _stage(path, prepared)
        if new_world > old_world:
            joiners = _start_joiners(path, prepared.job, range(old_world, new_world))
            say(f"started {count(len(joiners), 'joining rank')}; waiting until they are ready")
            _wait_ready(path, joiners, old_world, ready_timeout_seconds)
        write_json_atomic(request_path(path), request)
        requested = True
        say(f"asked the running job to move to {count(new_world, 'rank')} ({request.record.to_layout}) at its next step boundary")
        record = _wait_record(path, request, joiners, handover_timeout_seconds)
    except BaseException as exc:
        # The run's own files were never touched: rank 0 moves the staged ones in after the first
        # step on the new layout. Not asked yet: the staged files and the joining ranks go. Asked
        # and not done (rank 0 removes the request after that step): the request is withdrawn; the
        # staged files stay, as the ranks may have taken it already (they read them), and so do
        # the joining ranks, which enter the job if it moves and leave once this command has ended
        # with no request written (`runtime.elastic.live_resize.JoinAbandoned`).
        if not requested:
            for proc in joiners:
                proc.kill()
            shutil.rmtree(path / STAGED_DIR, ignore_errors=True)
        else:
            request_path(path).unlink(missing_ok=True)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, ResizeInterrupted):
            raise ResizeInterrupted(asked=requested) from exc
        raise
    return LiveResult(record, [p.pid for p in joiners])


def live_request(
    decision: ResizeDecision,
    prepared: PreparedRelaunch,
    *,
    requested_unix: float,
    trigger: MorphTrigger = MorphTrigger.RESIZE,
    survivors: list[int] | None = None,
    excluded_ranks: list[int] | None = None,
    notes: list[str] | None = None,
) -> LiveResizeRequest:
    """RUN/resize_requested.json for `decision`, whose run files `prepared` holds: a planned live
    resize, or (`survivors`) the recovery of a lost replica (`resize/replicas.py`)."""
    old_world, new_world = decision.previous.devices, decision.candidate.devices
    return LiveResizeRequest(
        generation=len(read_records(decision.run_dir)) + 1,
        from_devices=old_world,
        to_devices=new_world,
        master_addr=prepared.job.master_addr,
        master_port=prepared.job.master_port,
        survivors=survivors or [],
        meeting_port=free_port() if survivors else None,
        record=MorphRecord(
            trigger=trigger,
            requested_unix=requested_unix,
            requested_devices=decision.requested_devices,
            from_devices=old_world,
            from_layout=layout_label(decision.previous),
            to_devices=new_world,
            to_layout=layout_label(decision.candidate),
            global_batch=decision.global_batch,
            resume_step=0,
            target_steps=decision.target_steps,
            stopped_running_job=False,
            plan_source=decision.choice.source,
            excluded_ranks=decision.excluded_ranks if excluded_ranks is None else excluded_ranks,
            notes=[*(notes or []), *decision.notes],
            path="live",
        ),
    )


def _stage(path: Path, prepared: PreparedRelaunch) -> None:
    """The new layout's run files into RUN/live/next (`rundir.live_requests.STAGED_DIR`), a leftover of a
    resize that ended early replaced."""
    staged = path / STAGED_DIR
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    write_run_files(
        staged, plan=prepared.plan, job=prepared.job, ds_config=prepared.ds_config, command=prepared.command,
        plan_dir=path,
    )


def run_file_names(path: Path) -> list[str]:
    job = read_run(path).job
    names = [JOB_FILE, job.plan_file, job.ds_config_file, LAUNCH_SCRIPT]
    return [name for name in names if (path / name).is_file()]


def _start_joiners(path: Path, job, ranks: range) -> list[subprocess.Popen]:
    path = path.resolve()  # each rank starts in the run directory: a relative name would not be it
    logs = path / LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    ready = path / JOIN_DIR
    ready.mkdir(exist_ok=True)
    for stale in ready.glob("ready-rank*"):
        stale.unlink()
    supervisor = [pid for pid in lock_holder(path) if pid_alive(pid)]  # the launching pipectl first
    procs = []
    for rank in ranks:
        env = {
            **os.environ,
            **rank_environment(gpus=False, import_root=job.import_root),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(job.world_size),
            "LOCAL_WORLD_SIZE": str(job.world_size),
            "MASTER_ADDR": job.master_addr,
            "MASTER_PORT": str(job.master_port),
            # Until it is in the job, it leaves when this resize ends unasked; then it watches
            # the launching pipectl as every rank does (`liveness.watch_supervisor`).
            RESIZE_PID_VARIABLE: str(os.getpid()),
            **({SUPERVISOR_VARIABLE: str(supervisor[0])} if supervisor else {}),
        }
        procs.append(start_detached([sys.executable, "-m", WORKER_MODULE, "--run-dir", str(path), "--join"],
                                    cwd=path, env=env, log=logs / f"join-rank{rank}.log"))
    return procs


def _wait_ready(path: Path, joiners: list[subprocess.Popen], first_rank: int, timeout_seconds: float) -> None:
    """Until every joining rank has written RUN/live/ready-rank{R} with its pid."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        if all(_ready(path, first_rank + index, proc) for index, proc in enumerate(joiners)):
            return
        dead = [p for p in joiners if p.poll() is not None]
        if dead:
            raise LaunchError(
                f"a joining rank exited with code {dead[0].returncode} before the hand-over",
                hint=f"see {path / LOGS_DIR}/join-rank*.log",
            )
        if time.monotonic() > deadline:
            raise LaunchError(f"the joining ranks were not ready within {timeout_seconds:.0f} s")
        time.sleep(0.05)


def _ready(path: Path, rank: int, proc: subprocess.Popen) -> bool:
    try:
        return ready_path(path, rank).read_text().strip() == str(proc.pid)
    except OSError:
        return False


def _wait_record(
    path: Path, request: LiveResizeRequest, joiners: list[subprocess.Popen], timeout_seconds: float
) -> MorphRecord:
    """The record rank 0 appends after the first step on the new layout."""
    deadline = time.monotonic() + timeout_seconds
    joining = {proc.pid for proc in joiners}
    while True:
        for record in reversed(read_records(path)):
            if record.path == "live" and record.requested_unix == request.record.requested_unix:
                return record
        taken = not request_path(path).exists()  # the ranks remove the request as they take it
        if not any(p.pid not in joining for p in find_run_ranks(path)):
            if not taken:  # no rank can take it now: nothing of the move stays behind
                request_path(path).unlink(missing_ok=True)
                shutil.rmtree(path / STAGED_DIR, ignore_errors=True)
            status = run_status(path)
            again = (f"the run trained all its {status.steps_done} steps: to train on, resize with --steps TOTAL"
                     if status.trained else "resize again (a stopped run is resized by a restart)")
            raise LaunchError(
                "the job ended before the live resize completed" + ("" if taken else " (the request was not taken)"),
                hint=f"{again}; see {path / LOGS_DIR}",
            )
        if (path / STOP_FILE).exists() and not taken:
            raise LaunchError("the job is stopping; the live resize was withdrawn")
        if time.monotonic() > deadline:
            raise LaunchError(f"the running job did not take the live resize within {timeout_seconds:.0f} s")
        time.sleep(0.05)
