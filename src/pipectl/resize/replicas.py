"""One torchrun per data-parallel replica, and the recovery of a lost one (`launch --recover-in-memory`).

torchrun stops every worker it started as soon as one fails: its agent has no other policy. A job
whose replicas should outlive each other therefore runs one torchrun per replica, as TorchFT runs
one per replica group: the local engine's command for such a job (its launch.sh) is

    python -m pipectl.resize.replicas --run-dir RUN

which starts torchrun `--standalone --nproc_per_node t*p` once per replica r, its ranks numbered
r*t*p + local rank in one job-wide group (`runtime.elastic.recovery.adopt_replica_environment`), and
waits. When a replica's torchrun exits with an error (a rank killed, a node lost: torchrun has
ended the replica's other ranks), this agent:

1. collects the replicas lost within a second of each other and checks the survivors can take
   over: some replica survives, each lost replica's right neighbour (which keeps a copy of its
   state) survives, no lost rank failed on its own (its failure record says so; the survivors
   would meet the same error), and no replica was recovered before in this launch;
2. chooses the survivors' layout as `pipectl resize` would (the morph table's entry for their
   count, the same global batch), rewrites the run files for it and asks the survivors to take
   over (RUN/resize_requested.json naming them: `runtime.elastic.recovery`);
3. marks the lost ranks' heartbeats `lost` and writes RUN/logs/recovery.json, read by the
   launching terminal and by `status`.

When the survivors cannot take over it says why there and in recovery.json, ends the other
replicas, and exits 1: `launch --resume` then restarts the job from its last checkpoint. The agent
exits 0 when every replica still in the job finished cleanly. A SIGTERM or SIGINT is passed to
each torchrun (the ranks finish their step and checkpoint).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.morph import RECOVERY_FILE, MorphTrigger, RecoveryRecord
from pipectl.artifacts.run import LOGS_DIR, RankState
from pipectl.errors import PipectlError
from pipectl.io import write_json_atomic
from pipectl.launch.engines import standalone_torchrun
from pipectl.launch.prepare import read_run
from pipectl.runtime.elastic import recovery
from pipectl.words import count

GATHER_SECONDS = 0.3  # replicas lost this close together are recovered from in one go
POLL_SECONDS = 0.1


class NoRecovery(PipectlError):
    """The survivors cannot take over; the message says why."""


def replica_ranks(replica: int, ranks_per_replica: int) -> list[int]:
    """The ranks of data-parallel replica `replica` (replica-major numbering, `planned_topology`).

    >>> replica_ranks(1, 2)
    [2, 3]
    """
    return list(range(replica * ranks_per_replica, (replica + 1) * ranks_per_replica))


def recovery_blocker(lost: set[int], replicas: int, failures: dict[int, str], ranks_per_replica: int,
                     recovered_before: bool) -> str | None:  # fmt: skip
    """Why the survivors cannot take over from the `lost` replicas (of `replicas`), else None.
    `failures`: rank -> the message of the failure record it wrote, if any.

    >>> recovery_blocker({1}, 2, {}, 1, False) is None
    True
    >>> recovery_blocker({0, 1}, 2, {}, 1, False)
    'no replica survived'
    >>> recovery_blocker({1, 2}, 3, {}, 1, False)
    'replicas 1 and 2 were both lost, and replica 2 held the only copy of replica 1'
    >>> recovery_blocker({1}, 2, {1: "CUDA out of memory"}, 1, False)
    'rank 1 failed on its own (CUDA out of memory): the survivors would meet the same error'
    """
    if recovered_before:
        return "one replica's loss is recovered in memory per launch, and this job has had one"
    for replica in sorted(lost):
        for rank in replica_ranks(replica, ranks_per_replica):
            message = failures.get(rank)
            if message is not None and not recovery.is_peer_loss(RuntimeError(message)):
                return f"rank {rank} failed on its own ({message}): the survivors would meet the same error"
    if len(lost) >= replicas:
        return "no replica survived"
    for replica in sorted(lost):
        neighbour = (replica + 1) % replicas
        if neighbour in lost:
            return f"replicas {replica} and {neighbour} were both lost, and replica {neighbour} held the only copy of replica {replica}"
    return None


def read_recovery(run_dir: str | os.PathLike[str], *, since_unix: float = 0.0) -> RecoveryRecord | None:
    """RUN/logs/recovery.json if a loss was seen at or after `since_unix` (this launch), else None."""
    from pipectl.io import load_model

    path = Path(run_dir) / LOGS_DIR / RECOVERY_FILE
    if not path.is_file():
        return None
    try:
        record = load_model(RecoveryRecord, path)
    except PipectlError:
        return None
    return record if record.time_unix >= since_unix else None


def recovery_line(record: RecoveryRecord) -> str:
    """What the launching terminal says of a lost replica."""
    if record.recovered:
        return record.reason
    replicas, ranks = (", ".join(map(str, values)) for values in (record.lost_replicas, record.lost_ranks))
    return f"replica {replicas} lost (rank {ranks}); not recovered in memory: {record.reason}"


class Agent:
    """The torchruns of one launch and what happens when one of them fails."""

    def __init__(self, run_dir: Path, python: str = sys.executable) -> None:
        files = read_run(run_dir)
        layout = files.plan.chosen
        self.run_dir = run_dir
        self.python = python
        self.replicas = layout.data_parallel
        self.per_replica = layout.tensor_parallel * layout.pipeline_parallel
        self.world = files.job.world_size
        self.master = (files.job.master_addr, files.job.master_port)
        self.started_unix = time.time()
        self.running: dict[int, subprocess.Popen] = {}
        self.codes: dict[int, int] = {}
        self.recovered: set[int] = set()  # replicas lost and taken over by the survivors
        self.pending: tuple[float, dict[str, bytes]] | None = None  # a recovery asked for, not yet done
        self.stopping = False  # signalled: torchruns exiting now are being stopped, not lost

    def start(self) -> None:
        for replica in range(self.replicas):
            env = {
                **os.environ,
                recovery.RANK_OFFSET_VARIABLE: str(replica * self.per_replica),
                recovery.WORLD_SIZE_VARIABLE: str(self.world),
                recovery.MASTER_ADDR_VARIABLE: self.master[0],
                recovery.MASTER_PORT_VARIABLE: str(self.master[1]),
            }
            argv = standalone_torchrun(self.python, self.per_replica, self.run_dir)
            self.running[replica] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)

    def signal(self, signum: int) -> None:
        """A signal to the agent (`pipectl launch` ending the job) goes to every torchrun; what
        exits from then on was stopped, not lost."""
        self.stopping = True
        for proc in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def wait(self) -> int:
        """Until every torchrun has exited; the agent's exit code: 0 when every replica not taken
        over by the survivors finished cleanly."""
        while self.running:
            lost = self._reap()
            self._settle_pending(lost)
            if lost and not self.stopping:
                time.sleep(GATHER_SECONDS)  # a node's loss may end several replicas
                lost |= self._reap()
                try:
                    self._recover(lost)
                except NoRecovery as refused:
                    self._refuse(lost, refused.message)
            time.sleep(POLL_SECONDS)
        self._settle_pending(set())
        return 0 if all(code == 0 for replica, code in self.codes.items() if replica not in self.recovered) else 1

    def _reap(self) -> set[int]:
        """The replicas whose torchrun has just exited with an error."""
        lost = set()
        for replica, proc in list(self.running.items()):
            code = proc.poll()
            if code is not None:
                del self.running[replica]
                self.codes[replica] = code
                if code != 0:
                    lost.add(replica)
        return lost

    def _settle_pending(self, lost: set[int]) -> None:
        """A recovery asked for is done once rank 0 has recorded its morph; a replica that fails
        before then (a survivor, or a second replica) means it failed: the run's files are put back
        as they were before it, so that `launch --resume` restarts the run as it was."""
        from pipectl.rundir.morph_history import read_records
        from pipectl.rundir.live_requests import request_path

        if self.pending is None:
            return
        requested, before = self.pending
        if any(record.requested_unix == requested for record in read_records(self.run_dir)):
            self.pending = None
        elif lost or (not self.running and any(self.codes[r] for r in self.codes if r not in self.recovered)):
            self.pending = None
            request_path(self.run_dir).unlink(missing_ok=True)
            for name, data in before.items():
                (self.run_dir / name).write_bytes(data)
            why = f"replica {', '.join(map(str, sorted(lost)))} failed too" if lost else "the survivors ended"
            self._refuse(self.recovered | lost, f"{why} before the survivors took over; the run's files are as they were")

    def _refuse(self, lost: set[int], why: str) -> None:
        self._say(f"replica {', '.join(map(str, sorted(lost)))} lost; not recovered in memory: {why}")
        self._record(lost, False, why)
        self.recovered.clear()  # the job fails: no replica counts as taken over
        self._end()

    def _recover(self, lost: set[int]) -> None:
        """Ask the survivors to take over from the `lost` replicas, or raise `NoRecovery`."""
        from pipectl.rundir.failures import read_failures

        failures = {f.rank: f.message or f.exception for f in read_failures(self.run_dir, since_unix=self.started_unix - 1.0)}
        gone = {replica for replica, code in self.codes.items() if code != 0}  # every replica lost so far
        why = recovery_blocker(gone if self.running else set(range(self.replicas)), self.replicas, failures,
                               self.per_replica, bool(self.recovered))  # fmt: skip
        if why is not None:
            raise NoRecovery(why)
        self._ask_survivors(lost)

    def _ask_survivors(self, lost: set[int]) -> None:
        """The survivors' layout, the run files rewritten for it (the old ones kept until the
        survivors have taken over), the request naming them."""
        from pipectl.resize.live import live_request, run_file_names
        from pipectl.resize.restart import decide_resize, prepare_relaunch, write_relaunch
        from pipectl.rundir.live_requests import request_path

        lost_ranks = self._ranks_of(lost)
        survivors = [rank for rank in range(self.world) if rank not in lost_ranks]
        requested = time.time()
        try:
            decision = decide_resize(self.run_dir, len(survivors))
            prepared = prepare_relaunch(decision)
        except PipectlError as exc:
            raise NoRecovery(f"no layout for the {count(len(survivors), 'surviving rank')}: {exc.message}") from None
        what = f"replica {', '.join(map(str, sorted(lost)))} lost (rank {', '.join(map(str, lost_ranks))})"
        request = live_request(
            decision, prepared, requested_unix=requested, trigger=MorphTrigger.FAILURE, survivors=survivors,
            excluded_ranks=lost_ranks, notes=[f"{what}: the survivors took over in memory"],
        )  # fmt: skip
        before = {name: (self.run_dir / name).read_bytes() for name in run_file_names(self.run_dir)}
        write_relaunch(self.run_dir, prepared)
        write_json_atomic(request_path(self.run_dir), request)
        self.recovered |= lost
        self.pending = (requested, before)
        self._mark_lost(lost_ranks)
        to_layout = layout_label(decision.candidate)
        reason = f"{what}; the survivors ({count(len(survivors), 'rank')}) take over in memory as {to_layout}"
        self._say(reason)
        self._record(lost, True, reason, to_layout)

    def _mark_lost(self, ranks: list[int]) -> None:
        """The lost ranks' heartbeats say so: a watcher must not wait for them."""
        from pipectl.rundir.heartbeats import heartbeat_path, read_heartbeats, write_heartbeat

        beats = read_heartbeats(self.run_dir, since_unix=self.started_unix - 1.0)
        for rank in ranks:
            beat = beats.get(rank)
            if beat is not None:
                write_heartbeat(self.run_dir, beat.model_copy(update={"state": RankState.LOST, "beat_unix": time.time()}))
            else:
                heartbeat_path(self.run_dir, rank).unlink(missing_ok=True)

    def _ranks_of(self, replicas: set[int]) -> list[int]:
        return [rank for replica in sorted(replicas) for rank in replica_ranks(replica, self.per_replica)]

    def _record(self, lost: set[int], recovered: bool, reason: str, to_layout: str | None = None) -> None:
        record = RecoveryRecord(time_unix=time.time(), lost_replicas=sorted(lost), lost_ranks=self._ranks_of(lost),
                                recovered=recovered, reason=reason, to_layout=to_layout)  # fmt: skip
        write_json_atomic(self.run_dir / LOGS_DIR / RECOVERY_FILE, record)

    def _end(self) -> None:
        """The other replicas: SIGTERM to their torchruns (which end their ranks), then SIGKILL."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + 40.0  # torchrun gives its ranks 30 s
        while self.running and time.monotonic() < deadline:
            self._reap()
            time.sleep(POLL_SECONDS)
        self.signal(signal.SIGKILL)
        for replica, proc in list(self.running.items()):
            self.codes[replica] = proc.wait()
        self.running.clear()

    @staticmethod
    def _say(line: str) -> None:
        print(f"pipectl replicas: {line}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipectl.resize.replicas", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="the run directory (job.json, plan.json, ...)")
    args = parser.parse_args(argv)
    agent = Agent(args.run_dir.resolve())
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, _frame: agent.signal(received))
    agent.start()
    # What a recovery runs (the resize decision; DeepSpeed's config parser validating the new
    # layout) is imported while the job trains, not after a loss, where it would lengthen the pause.
    import deepspeed.runtime.config  # noqa: F401

    import pipectl.resize.live  # noqa: F401
    import pipectl.resize.restart  # noqa: F401

    return agent.wait()


if __name__ == "__main__":
    sys.exit(main())
