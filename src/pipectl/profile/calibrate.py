"""Fit a profile's engine terms to what real runs measured: `pipectl calibrate RUN [RUN ...]`.

A measured profile prices a step from its layers and from the engine terms it measured once on
one rank (`ModelProfile.runtime`, `profile.runtime_calibration`). Runs of the model then show,
per stage and step, how long each phase really took (`plan.phases`: forward, backward, pipeline
waits, end of step). Calibration adjusts the engine terms, in this order, so that the simulator
reproduces those phases on the runs it is given (Varuna, §4: calibrate a few short runs, then
predict the layouts not run):

0. the profile's engine compute ratios smoothed: each profiled b's re-set so that a
   micro-batch's compute through the model lies on a line a + c b per direction, robust to one
   stray profiled point (`smooth_compute_ratios`), so that runs at one b do not carry that b's
   profiling error to the others;
1. compute: the host slowdown of each kind of layout (one rank on its host, or several ranks
   sharing it: `alone_compute_slowdown`, `concurrent_compute_slowdown`) by the ratio of measured
   to predicted compute of the runs of that kind, and forward against backward by the ratio of
   each over both (every engine compute ratio and per-micro-batch overhead of that direction);
2. end of step: its fixed and per-parameter seconds (`step_fixed_seconds`,
   `step_seconds_per_parameter`) by least squares over every stage of every run, from the measured
   end of step less the predicted gradient reductions, divided by the run's slowdown; a single
   parameter count keeps the slope and refits the constant;
3. the blocking hand-off between busy ranks of one host (`busy_handoff_seconds`, what every send
   and receive waits on a shared host) by a golden-section search on the runs' step times; as it
   prices the gradient reductions too, steps 2 and 3 alternate three times.

Each term keeps its meaning, so the calibrated profile plans any layout: `pipectl plan --profile
calibrated.json`. The runs must have been made from the profile given (the same file: its sha256
is the plan's) and record the phases (pipectl runs from this version on). What is fitted and the
fit's residuals per run are returned with the profile (`CalibrationReport`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.plan import Candidate, Plan
from pipectl.artifacts.profile import ModelProfile
from pipectl.artifacts.run import JOB_FILE, JobSpec
from pipectl.cluster import plan_cluster_spec
from pipectl.errors import UserInputError
from pipectl.io import load_model
from pipectl.plan.costs import hardware_for, layer_seconds
from pipectl.plan.layer_table import layer_table
from pipectl.plan.phases import MeasuredPhases, measured_phases, simulated_phases
from pipectl.planfile import load_plan_profile
from pipectl.rundir.metrics import read_metrics
from pipectl.rundir.run import check_run_given
from pipectl.words import count

GOLDEN = (math.sqrt(5) - 1) / 2
HANDOFF_SEARCH_STEPS = 40
ALTERNATIONS = 3  # end of step, then hand-off, three times: the hand-off is also in the reductions


@dataclass(frozen=True)
class Observation:
    """One calibration run: its layout and what it measured."""

    run: str
    candidate: Candidate
    cluster: ClusterSpec  # read once: every fitting step re-simulates the run on it
    measured: MeasuredPhases
    shares_host: bool  # several of its ranks on one node (the concurrent slowdown applies)


@dataclass
class RunFit:
    run: str
    layout: str
    measured_step_seconds: float
    predicted_before: float
    predicted_after: float = 0.0

    @property
    def error_before(self) -> float:
        return abs(self.predicted_before - self.measured_step_seconds) / self.measured_step_seconds

    @property
    def error_after(self) -> float:
        return abs(self.predicted_after - self.measured_step_seconds) / self.measured_step_seconds


@dataclass
class CalibrationReport:
    runs: list[RunFit]
    fitted: dict[str, tuple[float, float]] = field(default_factory=dict)  # term -> (before, after)


def observe(run_dir: str | Path) -> tuple[Observation, ModelProfile]:
    """A run's layout and measured phases, and the profile its plan was made from."""
    run = check_run_given(run_dir)
    job = load_model(JobSpec, run / JOB_FILE)
    plan = load_model(Plan, run / job.plan_file)
    profile = load_plan_profile(run / job.plan_file, plan)
    candidate = plan.chosen
    if candidate.chunks != 1 or plan.kind_profiles or len(set(candidate.replica_kinds)) > 1:
        raise UserInputError(
            f"run {run} ({layout_label(candidate)}) is not a layout of one device kind and one chunk per rank, which "
            "calibration takes",
            hint="calibrate from runs of one kind of device",
        )
    label = layout_label(candidate)
    measured = measured_phases(read_metrics(run), label)
    if measured is None:
        raise UserInputError(f"run {run} has fewer than two steps of {label}: nothing to calibrate from")
    missing = [stage for stage, (phases, _) in measured.stages.items() if None in (*phases[:3], measured.end_of_step[stage])]
    if missing:
        raise UserInputError(
            f"run {run} does not record its pipeline waits and end of step (pipectl before this version)",
            hint="run the layout again with this pipectl",
        )
    cluster = plan_cluster_spec(plan)
    hardware = hardware_for(cluster, profile)
    shares = min(candidate.devices, hardware.devices_per_node) >= 2
    return Observation(str(run), candidate, cluster, measured, shares), profile


def _predict(profile: ModelProfile, observation: Observation) -> tuple[list[tuple[float, ...]], float]:
    return simulated_phases(observation.candidate, profile, observation.cluster)


def _with(profile: ModelProfile, **changes) -> ModelProfile:
    return profile.model_copy(update={"runtime": profile.runtime.model_copy(update=changes)})


def _fit_compute(profile: ModelProfile, observations: Sequence[Observation], predictions) -> ModelProfile:
    runtime = profile.runtime
    sums = {"alone": [0.0, 0.0], "concurrent": [0.0, 0.0]}  # measured, predicted compute
    directions = [[0.0, 0.0], [0.0, 0.0]]  # forward, backward: measured, predicted
    for observation, (phases, _) in zip(observations, predictions):
        kind = "concurrent" if observation.shares_host else "alone"
        for stage, (measured, _) in observation.measured.stages.items():
            predicted = phases[stage]
            sums[kind][0] += measured[0] + measured[1]
            sums[kind][1] += predicted[0] + predicted[1]
            for k in (0, 1):
                directions[k][0] += measured[k]
                directions[k][1] += predicted[k]
    changes = {}
    if sums["alone"][1] > 0:
        changes["alone_compute_slowdown"] = runtime.alone_compute_slowdown * sums["alone"][0] / sums["alone"][1]
    if sums["concurrent"][1] > 0:
        changes["concurrent_compute_slowdown"] = (
            runtime.concurrent_compute_slowdown * sums["concurrent"][0] / sums["concurrent"][1]
        )
    total = sum(d[0] for d in directions) / sum(d[1] for d in directions)
    forward, backward = (d[0] / d[1] / total if d[1] > 0 else 1.0 for d in directions)
    changes["compute_ratios"] = [
        ratio.model_copy(update={"forward_ratio": ratio.forward_ratio * forward, "backward_ratio": ratio.backward_ratio * backward})
        for ratio in runtime.compute_ratios
    ]
    changes["forward_overhead_seconds"] = runtime.forward_overhead_seconds * forward
    changes["backward_overhead_seconds"] = runtime.backward_overhead_seconds * backward
    return _with(profile, **changes)


def _theil_sen(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Intercept and slope of the line through `points`, robust to one stray point among a few:
    the median of the pairwise slopes, then the median of y - slope x (Theil-Sen).

        >>> _theil_sen([(1, 3.0), (2, 5.0), (4, 20.0), (8, 17.0)])  # 1 + 2 b: the point at 4 is stray
        (1.0, 2.0)
    """
    slopes = [
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1
    ]
    slope = statistics.median(slopes)
    return statistics.median(y - slope * x for x, y in points), slope


def smooth_compute_ratios(profile: ModelProfile, cluster: ClusterSpec) -> ModelProfile:
    """The engine's compute ratio at every profiled b re-set so that a micro-batch's compute
    through the whole model lies on a line a + c b, per direction (Theil-Sen over the profiled b).

    A micro-batch's engine compute is close to a line in b on this kind of host (per-operator
    dispatch and autograd bookkeeping, then work in proportion to the samples), while the
    profile's ratio at each b comes from a few short steps of its own, and one of them can stand
    well off the others on a busy host. Calibration scales every b by what the runs measured at theirs: from a
    stray point, that error would reach every other b. Fewer than three profiled sizes: as is."""
    runtime = profile.runtime
    if runtime is None or len(runtime.compute_ratios) < 3:
        return profile
    hardware = hardware_for(cluster, profile)
    sizes = [ratio.micro_batch_size for ratio in runtime.compute_ratios]
    totals = []
    for b in sizes:
        seconds = layer_seconds(layer_table(profile, b, 1), hardware, 1)
        totals.append((sum(seconds.forward), sum(seconds.backward)))
    lines = [_theil_sen([(b, total[direction]) for b, total in zip(sizes, totals)]) for direction in (0, 1)]
    ratios = []
    for ratio, b, total in zip(runtime.compute_ratios, sizes, totals):
        scale = [
            max(intercept + slope * b, 0.1 * total[direction]) / total[direction] if total[direction] > 0 else 1.0
            for direction, (intercept, slope) in enumerate(lines)
        ]
        ratios.append(ratio.model_copy(update={
            "forward_ratio": ratio.forward_ratio * scale[0], "backward_ratio": ratio.backward_ratio * scale[1],
        }))  # fmt: skip
    return _with(profile, compute_ratios=ratios)


def _held_parameters(profile: ModelProfile, candidate: Candidate) -> list[float]:
    held = [0.0] * candidate.pipeline_parallel
    for stage, (start, end) in enumerate(candidate.stage_layers):
        held[stage % candidate.pipeline_parallel] += sum(layer.parameter_count for layer in profile.layers[start:end])
    return [h / candidate.tensor_parallel for h in held]


def _fit_end_of_step(profile: ModelProfile, observations: Sequence[Observation], predictions) -> ModelProfile:
    """y = (measured end - predicted reductions) / slowdown = fixed + per_parameter x held, the end
    of the step being the reductions and the optimizer step together (as every run records it).

    One point per run: its stage with the shortest such y. A stage that finishes its backwards
    before another waits for it in their gradient reductions, which the simulator does not count
    there; the stage finishing last waits for nobody."""
    runtime = profile.runtime
    points = []
    for observation, (phases, _) in zip(observations, predictions):
        slowdown = runtime.concurrent_compute_slowdown if observation.shares_host else runtime.alone_compute_slowdown
        held = _held_parameters(profile, observation.candidate)
        candidates = []
        for stage in observation.measured.stages:
            optimizer = (runtime.step_fixed_seconds + runtime.step_seconds_per_parameter * held[stage]) * slowdown
            reductions = max(0.0, phases[stage][3] + phases[stage][4] - optimizer)
            end = observation.measured.end_of_step[stage]
            candidates.append((max(0.0, end - reductions) / slowdown, held[stage]))
        y, x = min(candidates)
        points.append((x, y))
    xs = [x for x, _ in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = runtime.step_seconds_per_parameter
    if spread > 0:
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)
    fixed = max(0.0, mean_y - slope * mean_x)
    return _with(profile, step_fixed_seconds=fixed, step_seconds_per_parameter=slope)


def _step_error(profile: ModelProfile, observations: Sequence[Observation]) -> float:
    total = 0.0
    for observation in observations:
        _, step = _predict(profile, observation)
        total += ((step - observation.measured.step_seconds) / observation.measured.step_seconds) ** 2
    return total


def _fit_handoff(profile: ModelProfile, observations: Sequence[Observation]) -> ModelProfile:
    if not any(observation.shares_host for observation in observations):
        return profile  # no run had ranks sharing a host: nothing measured the hand-off
    largest = max(
        10 * profile.runtime.busy_handoff_seconds,
        max(max(m[0][2] for m in o.measured.stages.values()) for o in observations),
        1e-4,
    )
    low, high = 0.0, largest

    def error(handoff: float) -> float:
        return _step_error(_with(profile, busy_handoff_seconds=handoff), observations)

    a, b = high - GOLDEN * (high - low), low + GOLDEN * (high - low)
    fa, fb = error(a), error(b)
    for _ in range(HANDOFF_SEARCH_STEPS):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - GOLDEN * (high - low)
            fa = error(a)
        else:
            low, a, fa = a, b, fb
            b = low + GOLDEN * (high - low)
            fb = error(b)
    best = (low + high) / 2
    current = profile.runtime.busy_handoff_seconds
    return _with(profile, busy_handoff_seconds=best if error(best) < error(current) else current)


TERMS = (
    "alone_compute_slowdown", "concurrent_compute_slowdown", "forward_overhead_seconds", "backward_overhead_seconds",
    "step_fixed_seconds", "step_seconds_per_parameter", "busy_handoff_seconds",
)  # fmt: skip


def calibrate(run_dirs: Sequence[str | Path]) -> tuple[ModelProfile, CalibrationReport]:
    """The profile the runs were planned from, its engine terms fitted to what they measured."""
    if not run_dirs:
        raise UserInputError("give at least one run directory to calibrate from")
    resolved = [Path(run).resolve() for run in run_dirs]
    repeated = next((run for i, run in enumerate(run_dirs) if resolved[i] in resolved[:i]), None)
    if repeated is not None:
        raise UserInputError(f"run {repeated} is given twice: each run counts once")
    observed = [observe(run) for run in run_dirs]
    profile = observed[0][1]
    for (observation, other) in observed[1:]:
        if other != profile:
            raise UserInputError(
                f"run {observation.run} was planned from another profile than {observed[0][0].run}",
                hint="calibrate runs planned from one profile",
            )
    if profile.runtime is None:
        raise UserInputError(
            f"the runs' profile ({profile.model} on {profile.device}, {profile.source.value}) has no measured engine "
            "terms to fit",
            hint="calibrate a profile measured with pipectl profile (its engine calibration included)",
        )
    observations = [observation for observation, _ in observed]
    before = [_predict(profile, o) for o in observations]
    smoothed = smooth_compute_ratios(profile, observations[0].cluster)
    fitted = _fit_compute(smoothed, observations, [_predict(smoothed, o) for o in observations])
    # The hand-off prices the reductions too: fit it and the end of step in turn.
    for _ in range(ALTERNATIONS):
        fitted = _fit_end_of_step(fitted, observations, [_predict(fitted, o) for o in observations])
        fitted = _fit_handoff(fitted, observations)
    runs = [
        RunFit(o.run, layout_label(o.candidate), o.measured.step_seconds, step, _predict(fitted, o)[1])
        for o, (_, step) in zip(observations, before)
    ]
    terms = {name: (getattr(profile.runtime, name), getattr(fitted.runtime, name)) for name in TERMS}
    note = f"calibrated from {count(len(observations), 'run')}: " + ", ".join(
        f"{Path(r.run).name} ({r.layout})" for r in runs
    )
    return fitted.model_copy(update={"notes": [*fitted.notes, note]}), CalibrationReport(runs, terms)
