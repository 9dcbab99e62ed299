"""The fault sweep: real `pipectl launch` runs of gpt-tiny hit by faults, resumed, and compared with
a fault-free run of the same length (issue "Reliability": lose nothing under faults).

Kinds of trial (src/pipectl/testing/fault_trials.py runs each; src/pipectl/testing/user_model/pipectl_fault_model.py is
the model whose ranks act at a named (rank, step, point, nth) event):

    kill             SIGKILL of one rank at a random point: forward, backward, all-reduce,
                     optimizer step, checkpoint file write, checkpoint commit (>= 20 trials on
                     p=2 d=1, and a few on p=1 d=2 where the all-reduce is data-parallel)
    sigterm-rank     SIGTERM of one rank at a random point of a step (not the last)
    sigterm-launch   SIGTERM to the `pipectl launch` process once a random step has been logged
    truncated        a kill, then one file of the newest checkpoint truncated at a random length
    bit-flipped      a kill, then one random bit of one file of the newest checkpoint flipped
    disk-full        a checkpoint file write that fails with ENOSPC (random rank, file, step)
    disk-full-ulimit a resume under `ulimit -f` too small for a checkpoint file
    metrics-enospc   a metrics line refused (ENOSPC): held, written later, named on the terminal
    tiny-disk        a disk with room for no checkpoint: the job stops at its first one, says so
    unloadable       a kill, then the newest manifest made to list one rank's file only: verify
                     refuses it, the resume falls back to the checkpoint before
    sighup-launch,   SIGHUP (a closed terminal) and SIGKILL of `pipectl launch`: the ranks stop at a
    kill-launch      step boundary after a checkpoint, and the run resumes
    concurrent       two launches on one run directory (together; one during a run; two resumes)
    stopped          SIGSTOP of one rank at a random point of a step: the job must end by its
                     collective timeout (10 s here), name the stopped rank, leave no process behind
    killed-resize    kill -9 of `pipectl resize --devices 2` on a 1-rank job (p=1 d=1) while the
                     joining rank warms up: the run's files unchanged, the joiner gone, the job
                     trains on as if never resized

Random points are drawn from a seeded RNG among the events a census of the fault-free reference
run counted, so every trial's fault fires (a trial whose fault never fired is reported as not
survived). Per kind the result gives trials, survived, lost (steps before the last complete
checkpoint that were trained again), hung (a launch past its time limit), tracebacks (on the
user's terminal; logs/ may hold them) and the final checkpoint's largest relative difference
from the fault-free run (weights; Adam moments beside them).

    scripts/fault-sweep.sh                 # or: python benchmarks/fault_sweep.py --seed 0
    -> benchmarks/results/faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pipectl.testing import fault_harness  # noqa: E402
from pipectl.testing import fault_trials as ft  # noqa: E402

IN_STEP_POINTS = ("forward", "backward", "allreduce", "optimizer")
KILL_POINTS = (*IN_STEP_POINTS, "save", "written", "commit")  # save, written: during a background write
SIZE_LIMIT_KIB = 48  # above every log and metrics file of these runs, below a checkpoint's larger files


def planned_trials(references: dict[str, fault_harness.Reference], rng: random.Random, kill_trials: int) -> list[tuple[str, Callable]]:
    """Every trial of the sweep, as (label, run(folder) -> Trial), drawn from `rng`."""
    main, dp = references["p2d1"], references.get("p1d2")
    setup = main.setup
    trials: list[tuple[str, Callable]] = []

    def triggered(kind: str, reference: fault_harness.Reference, trigger: dict, damage: dict | None = None):
        trials.append((f"{kind} {reference.setup.label} {trigger}", lambda folder: ft.triggered_trial(kind, reference, folder, trigger, damage)))

    points = [KILL_POINTS[i % len(KILL_POINTS)] for i in range(kill_trials)]
    rng.shuffle(points)
    for point in points:
        triggered("kill", main, ft.draw_trigger(main, rng, point))
    if dp is not None:
        for point in ("forward", "backward", "allreduce", "save", "written"):
            if any(p == point for (_, _, p) in dp.events):
                triggered("kill", dp, ft.draw_trigger(dp, rng, point))
    for _ in range(3):
        triggered("sigterm-rank", main, ft.draw_trigger(main, rng, rng.choice(IN_STEP_POINTS), "term", range(1, setup.steps)))
    after_second = range(2 * setup.checkpoint_every + 1, setup.steps + 1)  # two checkpoints exist: one to fall back to
    for how, kind in (("truncate", "truncated"), ("flip", "bit-flipped")):
        for _ in range(3):
            trigger = ft.draw_trigger(main, rng, rng.choice(IN_STEP_POINTS), "kill", after_second)
            triggered(kind, main, trigger, {"how": how, "seed": rng.randrange(2**32)})
    at_checkpoints = range(2 * setup.checkpoint_every, setup.steps + 1)
    for _ in range(3):
        triggered("disk-full", main, ft.draw_trigger(main, rng, rng.choice(("save", "commit")), "enospc", at_checkpoints))
    for _ in range(2):  # a metrics line refused: held, written with a later step's
        triggered("metrics-enospc", main, ft.draw_trigger(main, rng, "metrics", "enospc", range(1, setup.steps)))
    for name in ("SIGTERM", "SIGTERM", "SIGHUP", "SIGKILL"):  # to pipectl: Ctrl-C, a closed terminal, kill -9
        after = rng.randrange(1, setup.steps - 1)
        trials.append((f"{ft.LAUNCH_SIGNALS[name]} after step {after}",
                       lambda folder, after=after, name=name: ft.signal_launch_trial(main, folder, after, name)))  # fmt: skip
    trials.append(("tiny-disk 1 MiB free", lambda folder: ft.tiny_disk_trial(main, folder, 2**20)))
    for _ in range(2):
        trigger = ft.draw_trigger(main, rng, rng.choice(IN_STEP_POINTS), "kill", after_second)
        trials.append((f"unloadable {trigger}", lambda folder, trigger=trigger: ft.unloadable_trial(main, folder, trigger)))
    stop = setup.checkpoint_every * rng.randrange(1, setup.steps // setup.checkpoint_every)
    trials.append((f"disk-full-ulimit {SIZE_LIMIT_KIB} KiB from step {stop}",
                   lambda folder: ft.size_limit_trial(main, folder, stop, SIZE_LIMIT_KIB)))  # fmt: skip
    for variant in ("race", "during", "resume-race"):
        trials.append((f"concurrent {variant}", lambda folder, variant=variant: ft.concurrent_trial(main, folder, variant)))
    for _ in range(3):  # alive and silent: ends by the collective timeout, named by its heartbeat
        triggered("stopped", main, ft.draw_trigger(main, rng, rng.choice(IN_STEP_POINTS), "stop"))
    if (one := references.get("p1d1")) is not None:
        for _ in range(2):  # kill -9 of a live resize to 2 ranks while its joining rank warms up
            at, delay = rng.randrange(1, one.setup.steps - 1), rng.uniform(0.0, 2.0)
            trials.append((f"killed-resize at step {at} after {delay:.2f} s",
                           lambda folder, at=at, delay=delay: ft.killed_resize_trial(one, folder, at, delay)))  # fmt: skip
    return trials


def summary(trials: list[ft.Trial]) -> dict[str, dict]:
    kinds: dict[str, dict] = {}
    for trial in trials:
        row = kinds.setdefault(trial.kind, {"trials": 0, "survived": 0, "lost": 0, "hung": 0, "tracebacks": 0,
                                            "final_weights_max_rel_diff": 0.0, "final_moments_max_rel_diff": 0.0,
                                            "losses_max_rel_diff": 0.0})  # fmt: skip
        row["trials"] += 1
        row["survived"] += trial.survived
        row["lost"] += trial.lost
        row["hung"] += trial.hung
        row["tracebacks"] += trial.traceback
        for key, value in (("final_weights_max_rel_diff", trial.weights_max_rel_diff),
                           ("final_moments_max_rel_diff", trial.moments_max_rel_diff),
                           ("losses_max_rel_diff", trial.losses_max_rel_diff)):  # fmt: skip
            if value is not None:
                row[key] = max(row[key], value)
        if trial.kind == "kill":
            points = row.setdefault("points", {})
            points[trial.fault["point"]] = points.get(trial.fault["point"], 0) + 1
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-trials", type=int, default=24, help="kill trials on p=2 d=1 (at least 20)")
    parser.add_argument("--no-data-parallel", action="store_true", help="skip the p=1 d=2 and p=1 d=1 layouts")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "faults.json")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="pipectl-faults-"))
    rng = random.Random(args.seed)
    p1d2 = fault_harness.Setup(pipeline_parallel=1, data_parallel=2, micro_batch_size=2, micro_batches=2)
    setups = {"p2d1": fault_harness.Setup()}
    if not args.no_data_parallel:
        setups["p1d2"] = p1d2
        setups["p1d1"] = fault_harness.Setup(pipeline_parallel=1, data_parallel=1)  # resized live towards p1d2
    references = {}
    for label, setup in setups.items():
        morph = (p1d2,) if label == "p1d1" else ()
        references[label] = fault_harness.reference_run(setup, work / "references", morph)
        print(f"reference {label}: {references[label].seconds:.1f} s", flush=True)
    trials: list[ft.Trial] = []
    planned = planned_trials(references, rng, args.kill_trials)

    def write() -> None:
        import deepspeed
        import torch

        result = {
            "benchmark": "fault_sweep",
            "command": "scripts/fault-sweep.sh --seed " + str(args.seed),
            "seed": args.seed,
            "model": "gpt-tiny (src/pipectl/testing/user_model/pipectl_fault_model.py), fp32, CPU ranks (gloo)",
            "setups": {
                label: {**vars(s), "global_batch": s.micro_batch_size * s.micro_batches * s.data_parallel}
                for label, s in setups.items()
            },
            "tolerance_relative": fault_harness.TOLERANCE,
            "host": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "deepspeed": deepspeed.__version__,
                "cpus": os.cpu_count(),
            },
            "trials_planned": len(planned),
            "trials_run": len(trials),
            "seconds": round(time.monotonic() - started, 1),
            "kinds": summary(trials),
            "trials": [t.to_dict() for t in trials],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    for index, (label, run) in enumerate(planned):
        folder = work / f"trial{index:02d}"
        try:
            trial = run(folder)
        except Exception as exc:  # the driver's own failure: recorded, the sweep goes on
            trial = ft.Trial(label.split()[0], "?", {"label": label}, problems=[f"driver error: {type(exc).__name__}: {exc}"])
        trials.append(trial)
        verdict = "ok" if trial.survived else "FAILED: " + "; ".join(p[:300] for p in trial.problems)
        print(f"[{index + 1}/{len(planned)}] {label}: {verdict} ({trial.seconds:.0f} s)", flush=True)
        write()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    write()
    failed = [t for t in trials if not t.survived]
    print(f"{len(trials) - len(failed)} of {len(trials)} trials survived; {args.out}" + (f"; runs in {work}" if args.keep else ""))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
