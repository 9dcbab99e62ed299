"""Real `pipectl launch` runs for the fault trials (`fault_trials`): the run's setup and plan, the
launching process started as a user starts it, from the folder holding `pipectl_fault_model.py`
(user_model/, so that the ranks import `pipectl_fault_model:build` as a user's factory), the
process tree and its clean-up, and what a finished run left (losses, final tensors, the step a
resume started from), with the fault-free reference run they are checked against.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1]  # the folder holding the pipectl package, put on the ranks' PYTHONPATH
# The fault model is a user's factory, in a folder of its own that is not a package of pipectl
# (pipectl refuses a factory of its own modules): the CLI runs from that folder, as a user would.
MODEL_FOLDER = HERE / "user_model"
MODEL = "pipectl_fault_model:build"
TOLERANCE = 1e-6
LAUNCH_TIMEOUT_SECONDS = 150  # the CLI's --timeout; the driver waits 60 s longer before calling it hung
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Setup:
    """A layout of gpt-tiny and a run length: T steps, a checkpoint every K."""

    pipeline_parallel: int = 2
    data_parallel: int = 1
    micro_batch_size: int = 2
    micro_batches: int = 4
    steps: int = 8
    checkpoint_every: int = 2

    @property
    def label(self) -> str:
        return f"p{self.pipeline_parallel}d{self.data_parallel}"

    @property
    def checkpoint_steps(self) -> list[int]:
        every = self.checkpoint_every
        return sorted({s for s in range(every, self.steps + 1, every)} | {self.steps})

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel * self.data_parallel

    def last_checkpoint_before(self, step: int) -> int:
        """The newest checkpoint committed before anything of `step` (its forward or its save) ran."""
        return max([c for c in self.checkpoint_steps if c < step], default=0)

    def durable_checkpoint(self, run: Path) -> int:
        """The newest checkpoint the faulted launch left whole, read from the run directory as the
        fault left it: committed (its folder has a manifest), or every rank's report of its file in
        staging, none an error (whole on disk with its hashes: the next launch commits it).
        Checkpoints are written in the background while the next step trains, so a fault in that
        step may come before or after a rank reports; the report's atomic rename decides."""
        root = run / "checkpoints"
        whole = {c for c in self.checkpoint_steps if (root / f"step{c:08d}" / "manifest.json").is_file()}
        for c in self.checkpoint_steps:
            for reports in root.glob(f".staging/*/step{c:08d}.reports"):
                found = [reports / f"rank-{r:05d}.json" for r in range(self.world_size)]
                if all(p.is_file() and "error" not in json.loads(p.read_text()) for p in found):
                    whole.add(c)
        return max(whole, default=0)


def write_plan(setup: Setup, path: Path, morph: tuple[Setup, ...] = ()) -> Path:
    """A plan choosing `setup`'s layout for the fault model (gpt-tiny's shape, 1F1B, ZeRO-1, fp32);
    its morph table holds `setup` and `morph` (the layouts a resize may move it to)."""
    from pipectl.artifacts.plan import ModelShape, MorphEntry, Plan, PlanRequest
    from pipectl.io import write_json_atomic
    from pipectl.models import build_model
    from pipectl.models.base import shape_of

    candidate = _candidate(setup)
    shape: ModelShape = shape_of(build_model("gpt-tiny"))  # the fault model is gpt-tiny, hooks aside
    table = [MorphEntry(devices=s.world_size, candidate=_candidate(s)) for s in (setup, *morph)] if morph else []
    plan = Plan(
        model=MODEL, model_reference=MODEL, model_shape=shape, cluster="local",
        request=PlanRequest(global_batch=candidate.global_batch), chosen=candidate, morph_table=table,
    )  # fmt: skip
    return write_json_atomic(path, plan)


def _candidate(setup: Setup):
    from pipectl.artifacts.plan import Candidate

    p, d = setup.pipeline_parallel, setup.data_parallel
    return Candidate(
        devices=p * d, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=d,
        micro_batch_size=setup.micro_batch_size, micro_batches=setup.micro_batches, schedule="1f1b",
        recompute=False, zero_stage=1, stage_layers=[(0, 9)] if p == 1 else [(0, 4), (4, 9)],
        predicted_step_seconds=0.05, samples_per_second=160.0, tflops_per_device=0.0,
        peak_memory_bytes=[1] * p, bubble_fraction=0.0, communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip


# --------------------------------------------------------------------------- launching


@dataclass
class Launch:
    """One `pipectl launch` as the user saw it."""

    argv: list[str]
    exit_code: int | None  # None: it ran past its limit (hung) and was killed
    output: str
    seconds: float

    @property
    def hung(self) -> bool:
        return self.exit_code is None

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.output


def launch_argv(plan: Path, run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipectl.cli.main", "launch", str(plan), "--run-dir", str(run),
            "--timeout", str(LAUNCH_TIMEOUT_SECONDS), *extra]  # fmt: skip


def launch_env(**fault: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPECTL_FAULT_")}
    env.update(PYTHONPATH=str(SRC), COLUMNS="300", OMP_NUM_THREADS="1", **fault)
    return env


def start(argv: list[str], env: dict[str, str], *, limit_kib: int | None = None) -> subprocess.Popen:
    """Start the CLI from the fault model's folder (the ranks import it from there); with `limit_kib`,
    under `ulimit -f` (a shell wrapper, as an administrator or a full disk would impose it)."""
    if limit_kib is not None:
        argv = ["bash", "-c", f'ulimit -f {limit_kib} && exec "$@"', "limited", *argv]
    return subprocess.Popen(argv, cwd=MODEL_FOLDER, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, argv: list[str], started: float) -> Launch:
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_SECONDS + 60)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        code = None
    return Launch(argv, code, output, time.monotonic() - started)


def run_launch(argv: list[str], env: dict[str, str], *, limit_kib: int | None = None) -> Launch:
    started = time.monotonic()
    return finish(start(argv, env, limit_kib=limit_kib), argv, started)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc): the launcher has its own session, the ranks theirs."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, frontier = [], list(children.get(pid, []))
    while frontier:
        child = frontier.pop()
        found.append(child)
        frontier.extend(children.get(child, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything it started (a hung launch of ours)."""
    for target in [*descendants(pid), pid]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------- reading runs


def read_losses(run: Path) -> list[tuple[int, float]]:
    """(step, loss) of every line of metrics.jsonl, retrained steps included."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [(line["step"], line["loss"]) for line in map(json.loads, path.read_text().splitlines()) if line]


def final_tensors(run: Path, step: int) -> dict:
    """Every parameter's fp32 weights and Adam moments in checkpoint `step`, whole, keyed 'name/state'."""
    from pipectl.runtime.checkpoint.shards import whole_state

    return whole_state(run / "checkpoints" / f"step{step:08d}", STATES)


def max_relative_difference(found: dict, reference: dict, states: tuple[str, ...] = ("fp32",)) -> float:
    """max over tensors of max|found - reference| / max|reference|; inf when a tensor is missing."""
    worst = 0.0
    for name, expected in reference.items():
        if name.rsplit("/", 1)[1] not in states:
            continue
        if name not in found or found[name].shape != expected.shape:
            return float("inf")
        scale = float(expected.detach().abs().max()) or 1.0
        worst = max(worst, float((found[name].detach().double() - expected.detach().double()).abs().max()) / scale)
    return worst


def resumed_step(run: Path) -> int | None:
    path = run / "logs" / "resume.json"
    return json.loads(path.read_text())["step"] if path.is_file() else None


def census(records: Path) -> dict[tuple[int, int, str], int]:
    """(rank, step, point) -> events counted by a census run's ranks."""
    counts = {}
    for path in sorted(records.glob("census-rank*.json")):
        data = json.loads(path.read_text())
        for step, points in data["events"].items():
            for point, count in points.items():
                counts[(data["rank"], int(step), point)] = count
    return counts


@dataclass
class Reference:
    """A fault-free run of a setup: its losses, final tensors and event census."""

    setup: Setup
    plan: Path
    run: Path
    losses: dict[int, float]
    tensors: dict
    events: dict[tuple[int, int, str], int]
    seconds: float


def reference_run(setup: Setup, folder: Path, morph: tuple[Setup, ...] = ()) -> Reference:
    folder.mkdir(parents=True, exist_ok=True)
    plan = write_plan(setup, folder / f"plan-{setup.label}.json", morph)
    run, records = folder / f"reference-{setup.label}", folder / f"census-{setup.label}"
    records.mkdir()
    env = launch_env(PIPECTL_FAULT_CENSUS="1", PIPECTL_FAULT_RECORDS=str(records))
    done = run_launch(launch_argv(plan, run, "--steps", str(setup.steps), "--checkpoint-every", str(setup.checkpoint_every)), env)
    if done.exit_code != 0:
        raise RuntimeError(f"the reference run failed ({done.exit_code}):\n{done.output[-3000:]}")
    losses = dict(read_losses(run))
    if sorted(losses) != list(range(1, setup.steps + 1)):
        raise RuntimeError(f"the reference run trained steps {sorted(losses)}")
    return Reference(setup, plan, run, losses, final_tensors(run, setup.steps), census(records), done.seconds)
