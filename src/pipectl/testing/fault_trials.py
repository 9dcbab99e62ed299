"""Fault trials on real `pipectl launch` runs: a fault, `launch --resume`, and the checks.

Shared by tests/faults/ (a few trials in CI) and benchmarks/fault_sweep.py (the full sweep). Every
launch is the real CLI started as a user would (`fault_harness`), its model gpt-tiny with fault
points (`pipectl_fault_model:build`, a user's factory). A trial:

1. faulted launch: `--steps T --checkpoint-every K` with a trigger (a rank SIGKILLs itself at a
   (rank, step, point, nth) event; or SIGTERMs itself; or a checkpoint write fails with ENOSPC),
   or a SIGTERM to the launching process, or a file-size limit, or two launches at once;
2. optionally damage the newest checkpoint (truncate or flip a byte of one of its files);
3. `launch --resume` until the run has trained T steps (a run faulted before its first complete
   checkpoint has none to resume from: the resume is refused, exit 2, and it starts over with
   `--force`, as that refusal's hint says);
4. checks against a fault-free reference run of the same plan and length: the resume started
   from the last complete checkpoint (`lost` = steps before it that were trained again), every
   loss in metrics.jsonl equals the reference's loss of that step (fp32, 1e-6 relative), the
   final checkpoint's tensors (weights and Adam moments, read with `torch.load(weights_only=True)`)
   equal the reference's to 1e-6 relative, no launch ran past its time limit (`hung`), and no
   traceback reached the user's terminal (stdout and stderr of the CLI; logs/ may hold them).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from pipectl.testing.fault_harness import (
    Launch, MODEL_FOLDER, Reference, TOLERANCE, descendants, final_tensors, finish, kill_tree,
    launch_argv, launch_env, max_relative_difference, read_losses, resumed_step, run_launch, start,
)


# --------------------------------------------------------------------------- trials


@dataclass
class Trial:
    """One fault and its outcome. `expected_resume`: the last complete checkpoint at the fault."""

    kind: str
    setup: str
    fault: dict
    expected_resume: int | None = None
    resumed: int | None = None
    lost: int = 0
    hung: bool = False
    traceback: bool = False
    fired: bool = True
    weights_max_rel_diff: float | None = None
    moments_max_rel_diff: float | None = None
    losses_max_rel_diff: float | None = None
    found_complete: bool = False  # the resume was refused: the run's newest checkpoint is its last step
    steps_trained: list[int] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    launch_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def survived(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {**asdict(self), "survived": self.survived}


def trigger_env(folder: Path, trigger: dict) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trigger.json").write_text(json.dumps(trigger))
    return launch_env(PIPECTL_FAULT_TRIGGER=str(folder / "trigger.json"), PIPECTL_FAULT_RECORDS=str(folder))


def check(trial: Trial, reference: Reference, run: Path, launches: list[Launch]) -> Trial:
    """Fill in the outcome of a trial whose launches have all run."""
    setup = reference.setup
    trial.exit_codes = [launch.exit_code for launch in launches]
    trial.launch_seconds = [round(launch.seconds, 2) for launch in launches]
    trial.seconds = sum(launch.seconds for launch in launches)
    trial.hung = any(launch.hung for launch in launches)
    trial.traceback = any(launch.traceback for launch in launches)
    if trial.hung:
        trial.problems.append("a launch ran past its time limit")
    if trial.traceback:
        trial.problems.append("a traceback reached the terminal")
    if not trial.fired:
        trial.problems.append("the fault never fired")
    if launches[-1].exit_code != 0 and not trial.found_complete:
        trial.problems.append(f"the last launch exited {launches[-1].exit_code}: {launches[-1].output[-1500:]}")
    if trial.expected_resume is not None:
        trial.resumed = setup.steps if trial.found_complete else resumed_step(run)
        if trial.resumed is None:
            trial.problems.append("no resume record")
        else:
            trial.lost = max(0, trial.expected_resume - trial.resumed)
            if trial.lost:
                trial.problems.append(f"resumed from step {trial.resumed}, not {trial.expected_resume}: {trial.lost} steps lost")
    losses = read_losses(run)
    trial.steps_trained = [step for step, _ in losses]
    if not set(range(1, setup.steps + 1)) <= set(trial.steps_trained):
        trial.problems.append(f"steps trained {trial.steps_trained} miss some of 1..{setup.steps}")
    errors = [abs(loss - reference.losses[step]) / abs(reference.losses[step]) for step, loss in losses if step in reference.losses]
    trial.losses_max_rel_diff = max(errors, default=None)
    if trial.losses_max_rel_diff is not None and trial.losses_max_rel_diff > TOLERANCE:
        trial.problems.append(f"losses differ from the fault-free run by up to {trial.losses_max_rel_diff:.3g} (relative)")
    if (run / "checkpoints" / f"step{setup.steps:08d}").is_dir():
        found = final_tensors(run, setup.steps)
        trial.weights_max_rel_diff = max_relative_difference(found, reference.tensors)
        trial.moments_max_rel_diff = max_relative_difference(found, reference.tensors, ("exp_avg", "exp_avg_sq"))
        if max(trial.weights_max_rel_diff, trial.moments_max_rel_diff) > TOLERANCE:
            trial.problems.append(
                f"final checkpoint differs from the fault-free run: weights {trial.weights_max_rel_diff:.3g}, "
                f"Adam moments {trial.moments_max_rel_diff:.3g} (relative)"
            )
    else:
        trial.problems.append(f"no final checkpoint of step {setup.steps}")
    return trial


COMPLETE = "nothing is left to train"
NO_CHECKPOINT = "it has no checkpoint, so it would start over from step 0"
UNLOADABLE = "can be loaded: checkpoint step"  # every checkpoint it has is refused, each named


def resume(reference: Reference, run: Path, launches: list[Launch], trial: Trial | None = None) -> None:
    """`launch --resume`; for a run whose fault came before its first complete checkpoint, the
    resume is refused (exit 2: it would start over) and the run starts over with `--force`; for a
    run already checkpointed at its last step it is refused too (exit 2: nothing is left to train)."""
    launches.append(run_launch(launch_argv(reference.plan, run, "--resume"), launch_env()))
    said = " ".join(launches[-1].output.split())
    if trial is not None and trial.expected_resume == reference.setup.steps:
        # A run checkpointed at its last step is complete: `launch --resume` refuses it (exit 2).
        trial.found_complete = launches[-1].exit_code == 2 and COMPLETE in said
        return
    if trial is None or trial.expected_resume != 0:
        return
    refused = launches[-1]
    if refused.exit_code != 2 or not (NO_CHECKPOINT in said or UNLOADABLE in said):
        trial.problems.append(f"a resume without a checkpoint exited {refused.exit_code}: {refused.output[-600:]}")
    setup = reference.setup
    argv = launch_argv(reference.plan, run, "--force", "--steps", str(setup.steps), "--checkpoint-every", str(setup.checkpoint_every))
    launches.append(run_launch(argv, launch_env()))


STOPPED_RANK_COLLECTIVE_TIMEOUT = 10  # seconds: what a stopped rank's peers wait in a collective


def fault_launch(reference: Reference, run: Path, env: dict[str, str], *extra: str, **kwargs) -> Launch:
    setup = reference.setup
    argv = launch_argv(reference.plan, run, "--steps", str(setup.steps), "--checkpoint-every", str(setup.checkpoint_every), *extra)
    return run_launch(argv, env, **kwargs)


def triggered_trial(kind: str, reference: Reference, folder: Path, trigger: dict, damage: dict | None = None) -> Trial:
    """A rank acts at `trigger` (kill, term, enospc); then, with `damage`, one file of the newest
    checkpoint is truncated or has a byte flipped; then the run is resumed to its end. A full disk
    at a checkpoint before the last one costs that checkpoint only: the launch trains on, exits 0
    and has said so; the resume then finds the run complete."""
    setup = reference.setup
    run = folder / "run"
    step = trigger["step"]
    trial = Trial(kind, setup.label, {**trigger, **({"damage": damage} if damage else {})})
    extra = ("--collective-timeout", str(STOPPED_RANK_COLLECTIVE_TIMEOUT)) if trigger["action"] == "stop" else ()
    first = fault_launch(reference, run, trigger_env(folder / "records", trigger), *extra)
    # SIGTERM: the ranks finish the step and checkpoint it. A full disk costs that checkpoint only:
    # before the last step the run finishes (its resume starts at the end), at the last one the
    # resume starts from the one before. Otherwise: the newest checkpoint written whole.
    if trigger["action"] == "term":
        trial.expected_resume = step
    elif trigger["action"] == "enospc":
        trial.expected_resume = setup.steps if step < setup.steps else setup.last_checkpoint_before(step)
    else:
        trial.expected_resume = setup.durable_checkpoint(run)
    trial.fired = (folder / "records" / f"fired-rank{trigger['rank']}.json").is_file()
    launches = [first]
    if trigger["action"] == "term":
        if first.exit_code != 0:
            trial.problems.append(f"the stopped launch exited {first.exit_code}, not 0")
    elif trigger["action"] == "enospc" and step < setup.steps:
        if first.exit_code != 0:  # a checkpoint that cannot be written is skipped; training goes on
            trial.problems.append(f"the launch exited {first.exit_code} after a checkpoint failed, not 0")
    elif first.exit_code in (0, None):
        trial.problems.append(f"the faulted launch exited {first.exit_code}")
    said = " ".join(first.output.split())
    if trigger["action"] == "enospc" and "no space left on device" not in said.lower():
        trial.problems.append("the terminal did not say the disk was full")
    if trigger["action"] == "enospc" and trigger["point"] == "metrics" and "metrics.jsonl could not be written" not in said:
        trial.problems.append("the terminal did not say metrics.jsonl waited for the disk")  # held, written later
    if trigger["action"] == "stop":
        said = " ".join(first.output.split())
        if f"rank {trigger['rank']} (" not in said or "stopped responding" not in said:
            trial.problems.append(f"the terminal did not name the stopped rank {trigger['rank']}: {said[-600:]}")
        left = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
        if left:
            trial.problems.append(f"processes of the job outlived it: pids {[p.pid for p in left]}")
            for process in left:
                process.kill()
    if damage is not None:
        damaged = damage_newest(run, damage, random.Random(damage["seed"]))
        trial.fault["damage"] = {**damage, **damaged}
        trial.expected_resume = setup.last_checkpoint_before(damaged["step"])
    resume(reference, run, launches, trial)
    return check(trial, reference, run, launches)


def damage_newest(run: Path, damage: dict, rng: random.Random) -> dict:
    """Truncate one data file of the newest committed checkpoint (to a random fraction), or flip a
    random byte of it; returns what was done. A checkpoint the faulted job wrote whole but did not
    commit is committed first, as the resume would (`recover_staged`): it is the newest."""
    from pipectl.rundir.checkpoints import recover_staged

    recover_staged(run)
    tags = sorted(p for p in (run / "checkpoints").glob("step*") if (p / "manifest.json").is_file())
    newest = tags[-1]
    files = sorted(newest.glob("rank-*.safetensors"))
    target = rng.choice(files)
    data = bytearray(target.read_bytes())
    if damage["how"] == "truncate":
        keep = rng.randrange(len(data))
        target.write_bytes(bytes(data[:keep]))
        done = {"kept_bytes": keep, "of_bytes": len(data)}
    else:
        offset = rng.randrange(len(data))
        data[offset] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        done = {"offset": offset}
    return {"step": int(newest.name[4:]), "file": target.relative_to(newest).as_posix(), **done}


LAUNCH_SIGNALS = {"SIGTERM": "sigterm-launch", "SIGHUP": "sighup-launch", "SIGKILL": "kill-launch"}
UNSUPERVISED_SECONDS = 90  # after kill -9 of pipectl: how long its ranks may take to stop by themselves


def signal_launch_trial(reference: Reference, folder: Path, after_step: int, signal_name: str = "SIGTERM") -> Trial:
    """A signal to the `pipectl launch` process once metrics.jsonl shows `after_step`: SIGTERM,
    SIGHUP (its terminal closed) or SIGKILL. The ranks finish their step, checkpoint and exit 0,
    pipectl 128 + the signal (after SIGKILL they see their supervisor gone and stop by
    themselves); the resume starts from the step they stopped at."""
    setup = reference.setup
    run = folder / "run"
    trial = Trial(LAUNCH_SIGNALS[signal_name], setup.label,
                  {"signal": signal_name, "to": "pipectl launch", "after_step": after_step})  # fmt: skip
    argv = launch_argv(reference.plan, run, "--steps", str(setup.steps), "--checkpoint-every", str(setup.checkpoint_every))
    started = time.monotonic()
    proc = start(argv, launch_env())
    while proc.poll() is None and max((s for s, _ in read_losses(run)), default=0) < after_step:
        time.sleep(0.05)
    ranks: list[int] = []
    if proc.poll() is None:
        ranks = descendants(proc.pid)
        proc.send_signal(getattr(signal, signal_name))
    else:
        trial.fired = False
    first = finish(proc, argv, started)
    if signal_name == "SIGKILL":
        deadline = time.monotonic() + UNSUPERVISED_SECONDS
        while any(psutil.pid_exists(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in ranks if psutil.pid_exists(pid)]
        if left:
            trial.problems.append(f"{len(left)} process(es) of the job still ran {UNSUPERVISED_SECONDS} s after pipectl was killed")
            for pid in left:
                kill_tree(pid)
    elif first.exit_code != 128 + getattr(signal, signal_name):  # stopped by a person's signal: 128 + it
        trial.problems.append(f"the stopped launch exited {first.exit_code}, not 128 + {signal_name}")
    trial.expected_resume = max((s for s, _ in read_losses(run)), default=0)  # the step it stopped after
    launches = [first]
    resume(reference, run, launches, trial)
    return check(trial, reference, run, launches)


def size_limit_trial(reference: Reference, folder: Path, stop_step: int, limit_kib: int) -> Trial:
    """Train to `stop_step` (a checkpoint), resume under `ulimit -f limit_kib`: the next
    checkpoint's files cannot be written; the terminal says so; a resume without it finishes."""
    setup = reference.setup
    run = folder / "run"
    trial = Trial("disk-full-ulimit", setup.label, {"ulimit_f_kib": limit_kib, "first_steps": stop_step},
                  expected_resume=stop_step)  # fmt: skip
    first = run_launch(launch_argv(reference.plan, run, "--steps", str(stop_step), "--checkpoint-every",
                                   str(setup.checkpoint_every)), launch_env())  # fmt: skip
    limited = run_launch(launch_argv(reference.plan, run, "--resume", "--steps", str(setup.steps)), launch_env(),
                         limit_kib=limit_kib)  # fmt: skip
    text = " ".join(limited.output.split())
    if limited.exit_code in (0, 2, None) or "file size limit reached" not in text:
        trial.problems.append(f"the limited launch exited {limited.exit_code} without naming the size limit: {text[-800:]}")
    trial.fired = "file size limit reached" in text
    launches = [first, limited]
    resume(reference, run, launches, trial)
    return check(trial, reference, run, launches)


def tiny_disk_trial(reference: Reference, folder: Path, free_bytes: int) -> Trial:
    """A run directory whose disk has room for no checkpoint (it reports `free_bytes` free): the job
    says so at its first checkpoint and stops there, exit 1, instead of training every step for
    nothing; once space is freed, a resume is refused (nothing to resume) and `--force` trains the
    whole run."""
    setup = reference.setup
    run = folder / "run"
    trial = Trial("tiny-disk", setup.label, {"free_bytes": free_bytes}, expected_resume=0)
    first = fault_launch(reference, run, launch_env(PIPECTL_FAULT_DISK_FREE=str(free_bytes)))
    said = " ".join(first.output.split())
    trial.fired = f"checkpoint step {setup.checkpoint_every} skipped: it needs" in said
    trained = [step for step, _ in read_losses(run)]
    if first.exit_code in (0, None) or f"stopped after step {setup.checkpoint_every}" not in said:
        trial.problems.append(f"the launch on a tiny disk exited {first.exit_code} without stopping at its first checkpoint: {said[-800:]}")
    if trained and max(trained) > setup.checkpoint_every:
        trial.problems.append(f"it trained on to step {max(trained)} with no checkpoint possible")
    launches = [first]
    resume(reference, run, launches, trial)
    return check(trial, reference, run, launches)


def unloadable_trial(reference: Reference, folder: Path, trigger: dict) -> Trial:
    """A kill, then the newest checkpoint's manifest made to list one rank's file only (the other
    file removed with its entry): `status --verify` refuses it (the manifest does not cover its
    layout) and the resume falls back to the checkpoint before it."""
    setup = reference.setup
    run = folder / "run"
    trial = Trial("unloadable", setup.label, dict(trigger))
    first = fault_launch(reference, run, trigger_env(folder / "records", trigger))
    trial.fired = (folder / "records" / f"fired-rank{trigger['rank']}.json").is_file()
    from pipectl.rundir.checkpoints import recover_staged

    recover_staged(run)
    newest = sorted(p for p in (run / "checkpoints").glob("step*") if (p / "manifest.json").is_file())[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    dropped = sorted(manifest["files"])[-1]
    (newest / dropped).unlink()
    manifest["bytes"] -= manifest["file_bytes"].pop(dropped)
    del manifest["files"][dropped]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    trial.fault["dropped"] = f"{newest.name}/{dropped}"
    trial.expected_resume = setup.last_checkpoint_before(int(newest.name[4:]))
    verify = subprocess.run([sys.executable, "-m", "pipectl", "status", str(run), "--verify"], capture_output=True,
                            text=True, env=launch_env(), timeout=120)  # fmt: skip
    if verify.returncode == 0:
        trial.problems.append(f"status --verify passed a checkpoint missing {dropped}")
    launches = [first]
    resume(reference, run, launches, trial)
    return check(trial, reference, run, launches)


RUN_FILES = ("job.json", "plan.json", "ds_config.json", "launch.sh")
JOINER_GONE_SECONDS = 120  # its warm-up (imports, the model), then it sees the resize gone


def killed_resize_trial(reference: Reference, folder: Path, at_step: int, delay: float) -> Trial:
    """kill -9 of `pipectl resize RUN --devices 2` while its joining rank warms up (`delay`
    seconds after the joiner appeared), the job held busy in step `at_step` meanwhile: the run's
    files still describe the running layout, the joiner leaves (its heartbeat says so, no failure
    record), and the job trains to its end as if no resize had been tried."""
    from pipectl.artifacts.run import RankState
    from pipectl.rundir.processes import find_run_processes
    from pipectl.rundir.heartbeats import read_heartbeats

    setup = reference.setup
    run = folder / "run"
    held = {"rank": 0, "step": at_step, "point": "forward", "nth": 0, "action": "sleep", "seconds": 30}
    trial = Trial("killed-resize", setup.label, {"at_step": at_step, "delay_seconds": round(delay, 2)})
    argv = launch_argv(reference.plan, run, "--steps", str(setup.steps), "--checkpoint-every", str(setup.checkpoint_every))
    started = time.monotonic()
    proc = start(argv, trigger_env(folder / "records", held))
    fired = folder / "records" / "fired-rank0.json"
    while proc.poll() is None and not fired.is_file():
        time.sleep(0.05)
    before = {name: (run / name).read_bytes() for name in RUN_FILES if (run / name).is_file()}
    resize = subprocess.Popen([sys.executable, "-m", "pipectl", "resize", str(run), "--devices", "2"], cwd=MODEL_FOLDER,
                              env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    joiners = []
    while resize.poll() is None and time.monotonic() < deadline and not joiners:
        joiners = [p.pid for p in find_run_processes(run) if "--join" in p.argv]
        time.sleep(0.05)
    time.sleep(delay)
    trial.fired = bool(joiners) and resize.poll() is None and proc.poll() is None
    resize.kill()
    said, _ = resize.communicate()
    if not trial.fired:
        trial.problems.append(f"no joining rank while the resize ran (it exited {resize.returncode}): {said[-600:]}")
    after = {name: (run / name).read_bytes() for name in RUN_FILES if (run / name).is_file()}
    if after != before:
        trial.problems.append(f"the killed resize changed {sorted(n for n in after if after[n] != before.get(n))}")
    gone = time.monotonic() + JOINER_GONE_SECONDS
    while any(psutil.pid_exists(pid) for pid in joiners) and time.monotonic() < gone:
        time.sleep(0.2)
    for pid in joiners:
        if psutil.pid_exists(pid):
            trial.problems.append(f"the joining rank (pid {pid}) still ran {JOINER_GONE_SECONDS} s after the resize was killed")
            kill_tree(pid)
    launches = [finish(proc, argv, started)]
    beats = read_heartbeats(run)
    if joiners and (1 not in beats or beats[1].state is not RankState.LEFT):
        trial.problems.append(f"the joining rank's heartbeat says {beats[1].state if 1 in beats else 'nothing'}, not left")
    if list((run / "logs").glob("failure-rank*.json")):
        trial.problems.append("a failure record was written")
    return check(trial, reference, run, launches)


IN_USE = "is in use by a running job"


def race(argv: list[str], trial: Trial, what: str) -> tuple[list[Launch], list[Launch]]:
    """The same launch twice at once: (the ones that ran, the ones refused); one of each is right."""
    started = time.monotonic()
    procs = [start(argv, launch_env()), start(argv, launch_env())]
    pair = [finish(proc, argv, started) for proc in procs]
    winners = [launch for launch in pair if launch.exit_code == 0]
    refused = [launch for launch in pair if launch.exit_code != 0]
    if len(winners) != 1:
        trial.problems.append(f"exit codes {[l.exit_code for l in pair]}: not one {what} and one refusal")
    return winners, refused


def concurrent_trial(reference: Reference, folder: Path, variant: str) -> Trial:
    """Two launches on one run directory.

    `race`: two fresh launches started together: one trains, the other is refused (exit 2, naming
    the run as in use or existing) and changes nothing. `during`: while a launch trains, a
    `--resume` and a `--force` are refused. `resume-race`: after a kill, two `--resume` at once.
    In each, the run that trained must end as the fault-free run did.
    """
    setup = reference.setup
    run = folder / "run"
    trial = Trial("concurrent", setup.label, {"variant": variant})
    argv = launch_argv(reference.plan, run, "--steps", str(setup.steps), "--checkpoint-every", str(setup.checkpoint_every))
    launches: list[Launch] = []
    refused: list[Launch] = []
    if variant == "race":
        winners, refused = race(argv, trial, "run")
        launches = refused + winners  # the winner last: it must have finished the run
    elif variant == "during":
        # Rank 0 pauses in step 2 (results unchanged): the job is surely running while a
        # `--resume` and a `--force` of its run directory are tried, together.
        pause = {"rank": 0, "step": 2, "point": "forward", "nth": 0, "action": "sleep", "seconds": 25}
        trial.fault.update(pause)
        started = time.monotonic()
        proc = start(argv, trigger_env(folder / "records", pause))
        fired = folder / "records" / "fired-rank0.json"
        while proc.poll() is None and not fired.is_file():
            time.sleep(0.05)
        tries = [launch_argv(reference.plan, run, extra) for extra in ("--resume", "--force")]
        attempts = [(start(a, launch_env()), a, time.monotonic()) for a in tries]
        refused = [finish(p, a, t) for p, a, t in attempts]
        if proc.poll() is not None:
            trial.problems.append("the job ended before the second launches were decided: the trial shows nothing")
        launches = [*refused, finish(proc, argv, started)]
    else:  # resume-race
        # a step after the next one: the first checkpoint, written in the background, is whole by then
        trigger = {"rank": 0, "step": setup.checkpoint_every + 2, "point": "forward", "nth": 0, "action": "kill"}
        trial.fault.update(trigger)
        launches.append(fault_launch(reference, run, trigger_env(folder / "records", trigger)))
        trial.expected_resume = setup.durable_checkpoint(run)
        winners, refused = race(launch_argv(reference.plan, run, "--resume"), trial, "resume")
        launches += refused + winners
    for launch in refused:
        text = " ".join(launch.output.split())
        if launch.exit_code != 2 or not (IN_USE in text or "already exists" in text):
            trial.problems.append(f"a second launch was not refused as it should be ({launch.exit_code}): {text[-600:]}")
    return check(trial, reference, run, launches)


# --------------------------------------------------------------------------- drawing points


def draw_trigger(reference: Reference, rng: random.Random, point: str, action: str = "kill",
                 steps: range | None = None, rank: int | None = None) -> dict:  # fmt: skip
    """A random (rank, step, nth) among the census's events of `point` (in `steps`, on `rank`)."""
    choices = [
        (r, s, n) for (r, s, p), n in sorted(reference.events.items())
        if p == point and (steps is None or s in steps) and (rank is None or r == rank)
    ]  # fmt: skip
    if not choices:
        raise ValueError(f"the reference run has no {point} events in steps {steps} on rank {rank}")
    r, s, count = rng.choice(choices)
    return {"rank": r, "step": s, "point": point, "nth": rng.randrange(count), "action": action}
