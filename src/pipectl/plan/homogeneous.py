"""The search on one kind of device: check the request, enumerate, rank, record, morph.

    plan_homogeneous(profile, cluster_name, hardware, request) -> Plan

1. Enumerate (`pipectl.plan.space`): every spec that fits, with counted rejections.
2. Rank: specs are visited in the order of a closed-form lower bound on their objective; each is
   timed until the lower bound of the next one cannot beat the k-th best found (branch and
   bound: the pruned ones provably cannot enter the top k, see `pipectl.plan.fast.bounds`).
3. The morph table (`pipectl.plan.morph_table`): the fastest spec for every device count, from the
   same specs.

Objectives (docs/design.md, 'Search and the morph table'): `time` (step seconds), `cost` (USD per sample = price * devices * step / B),
`cost-deadline` (cheapest that finishes the requested samples or tokens before the deadline;
when none does, the fastest, with a note).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipectl.artifacts.plan import Candidate, Engine, ModelShape, Objective, Plan, PlanRequest, runtime_runs_zero
from pipectl.artifacts.profile import ModelProfile
from pipectl.errors import InfeasibleError, UserInputError
from pipectl.plan.candidates import Rejection, Rejections, Spec, tied
from pipectl.plan.costs import TRANSFORMER_BLOCK, Hardware
from pipectl.plan.placement import tensor_parallel_placeable
from pipectl.plan.evaluate import Evaluator
from pipectl.plan.frameworks import check_framework_request
from pipectl.plan.morph_table import morph_table
from pipectl.plan.space import Enumeration, enumerate_specs, search_space, tensor_parallel_possible
from pipectl.plan.spec_pool import SpecPool
from pipectl.plan.workers import available_workers
from pipectl.schedule import ScheduleKind, deepspeed_runnable
from pipectl.words import count

SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)  # 2 and 3 at p = 1 only: DeepSpeed's pipeline engine runs 0 and 1
PIPELINE_ZERO_STAGES = (0, 1)


# --- validation ----------------------------------------------------------------------------------


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and (isinstance(value, bool) or value <= 0):
        raise UserInputError(f"{name} must be positive, got {value}")


def _even_hint(request: PlanRequest) -> str:
    if request.framework is not None:
        return f"{request.framework.value} gives every replica the same share: pin a d that divides it"
    return "without --even-replicas, replicas take uneven shares of the batch"


def check_request(request: PlanRequest, profile: ModelProfile, hardware: Hardware) -> None:
    """Bad input names the value: B <= 0, impossible pinned degrees, a missing deadline figure."""
    B = request.global_batch
    if B <= 0:
        raise UserInputError(f"global batch must be a positive number of samples, got {B}")
    for name in ("max_tensor_parallel", "tensor_parallel", "pipeline_parallel", "data_parallel",
                 "micro_batch_size", "devices", "deadline_hours", "samples", "tokens", "top", "workers"):
        _positive(name.replace("_", " "), getattr(request, name))
    check_framework_request(request, profile)  # before the checks below, which speak of pipectl's runtime
    if request.devices is not None and request.devices > hardware.devices:
        kind = f"'{hardware.kind}' device"
        raise UserInputError(f"--devices {request.devices} is more than the cluster's {count(hardware.devices, kind)}")
    layers = len(profile.layers)
    if request.pipeline_parallel is not None and request.pipeline_parallel > layers:
        blocks = sum(layer.kind == TRANSFORMER_BLOCK for layer in profile.layers)
        others = [layer.kind for layer in profile.layers if layer.kind != TRANSFORMER_BLOCK]
        parts = f" ({', '.join([count(blocks, 'transformer block'), *others])})" if blocks and others else ""
        raise UserInputError(  # the blocks are what a user counts as the model's layers; a stage holds one or more
            f"pipeline-parallel degree {request.pipeline_parallel} exceeds the model's {count(layers, 'layer')}{parts}: "
            "each stage needs one at least"
        )
    if request.tensor_parallel is not None:
        _check_tensor_parallel(request.tensor_parallel, profile, hardware)
    _check_batch_split(request)
    pinned = [x for x in (request.tensor_parallel, request.pipeline_parallel, request.data_parallel) if x]
    if math.prod(pinned) > (request.devices or hardware.devices):
        raise UserInputError(
            f"pinned degrees t x p x d = {math.prod(pinned)} need more than the "
            f"{count(request.devices or hardware.devices, 'device')} available"
        )
    engine = profile.engine
    if engine is not None and not engine.runnable_by_pipectl and request.target_engine is not Engine.ANY:
        raise UserInputError(
            f"the profile was derived for a run of {engine.name}, with features pipectl's runtimes do not run "
            f"(engine {request.target_engine.value} asked)",
            hint="plan it with --engine any (for comparison), or derive the profile without --engine",
        )
    _check_zero_stages(request)
    bad_chunks = [v for v in request.chunks if v < 2]
    if bad_chunks:
        raise UserInputError(f"interleaved chunks v must be >= 2, got {bad_chunks[0]}")
    if request.objective is Objective.COST_DEADLINE:
        if request.deadline_hours is None or (request.samples is None and request.tokens is None):
            raise UserInputError(
                "the cost-deadline objective needs --deadline-hours and --samples or --tokens"
            )
        if request.tokens is not None and not profile.seq_len:
            raise UserInputError("--tokens needs a profile with a sequence length; give --samples instead")
    if request.schedule is not None and request.schedules is not None and request.schedule not in request.schedules:
        raise UserInputError(
            f"pinned schedule '{request.schedule.value}' is not among --schedules "
            f"{','.join(s.value for s in request.schedules)}"
        )


def _check_tensor_parallel(t: int, profile: ModelProfile, hardware: Hardware) -> None:
    """A pinned t must place on the nodes and split the model (shard costs, when the profile has them)."""
    n = hardware.devices_per_node
    if not tensor_parallel_placeable(t, n):
        raise UserInputError(
            f"tensor-parallel degree {t} neither divides the {count(n, 'device')} of a node nor is a multiple of "
            "them: a tensor group sits inside one node or spans whole nodes",
            hint=f"use a divisor of {n} or a multiple of {n}",
        )
    if t > 1 and profile.has_shards and not tensor_parallel_possible(profile, t):
        raise UserInputError(
            f"tensor-parallel degree {t} has no shard costs in the profile (it has t = "
            f"{', '.join(map(str, profile.shard_degrees()))})",
            hint=f"profile or derive the model with --tensor-parallel including {t}",
        )
    if t > 1 and not tensor_parallel_possible(profile, t):
        raise UserInputError(
            f"tensor-parallel degree {t} does not divide the model's hidden size {profile.hidden} "
            "(or the model has no transformer blocks to split)"
        )


def _check_batch_split(request: PlanRequest) -> None:
    """A pinned d and b must leave every replica a micro-batch, and divide B unless replicas may be uneven."""
    B = request.global_batch
    d, b = request.data_parallel, request.micro_batch_size
    if d is not None and d > B:
        raise UserInputError(f"data-parallel degree {d} is more than the global batch's {count(B, 'sample')}")
    if d is not None and B % d and not request.uneven_replicas:
        raise UserInputError(f"global batch {B} is not divisible by data-parallel degree {d}", hint=_even_hint(request))
    if b is not None and B % b:
        raise UserInputError(f"global batch {B} is not divisible by micro-batch size {b}")
    if d is not None and b is not None and d * b > B:
        raise UserInputError(
            f"data-parallel degree {d} x micro-batch {b} is more than the global batch's {count(B, 'sample')}"
        )
    if d is not None and b is not None and B % (d * b) and not request.uneven_replicas:
        raise UserInputError(f"global batch {B} is not divisible by data-parallel degree {d} x micro-batch {b}",
                             hint=_even_hint(request))


def _check_zero_stages(request: PlanRequest) -> None:
    """Only stages 0 to 3, and with a pinned p > 1 at least one DeepSpeed's pipeline engine accepts."""
    bad_zero = [z for z in request.zero_stages if z not in SUPPORTED_ZERO_STAGES]
    if bad_zero or not request.zero_stages:
        raise UserInputError(
            f"ZeRO stage {bad_zero[0] if bad_zero else '(none)'} is not supported",
            hint="use ZeRO stages 0 to 3 (2 and 3 at p = 1 only)",
        )
    p = request.pipeline_parallel
    if p is not None and p > 1 and not any(z in PIPELINE_ZERO_STAGES for z in request.zero_stages):
        raise UserInputError(
            f"ZeRO stage {min(request.zero_stages)} is not supported with pipeline parallelism (p = {p})",
            hint="DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3: they are planned at p = 1 only; "
            "add ZeRO stage 0 or 1",
        )


# --- ranking -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    """The objective as keys: smaller is better; `bound_key` never exceeds the true key."""

    objective: Objective
    hardware: Hardware
    global_batch: int
    steps_needed: int | None = None
    deadline_seconds: float | None = None

    def cost_per_sample(self, spec: Spec, step: float) -> float:
        return self.hardware.price_per_device_hour * spec.devices * step / 3600 / self.global_batch

    def key(self, spec: Spec, step: float) -> tuple:
        if self.objective is Objective.TIME:
            return (step,)
        cost = self.cost_per_sample(spec, step)
        if self.objective is Objective.COST:
            return (cost, step)
        if self.meets_deadline(step):
            return (0, cost, step)
        return (1, step)

    def best_words(self, key: tuple) -> tuple[str, str]:
        """How the entry with `key` is the best, and where: ('fastest', ''), ('cheapest', ''), or
        under a deadline ('cheapest', 'within the deadline'), or ('fastest', '') when it misses it
        (time ranks those)."""
        if self.objective is Objective.TIME:
            return "fastest", ""
        if self.objective is Objective.COST:
            return "cheapest", ""
        return ("cheapest", "within the deadline") if key[0] == 0 else ("fastest", "")

    def figures(self, spec: Spec, step: float) -> str:
        """The figures the objective ranks by: '0.0004615 s/step' (time), plus
        '$0.04 per 1M samples' (cost)."""
        seconds = f"{step:.4g} s/step"
        if spec.variant.kind is ScheduleKind.PIPEDREAM_2BW:
            seconds = f"{step:.4g} s per update, 2BW steady state"
        if self.objective is Objective.TIME:
            return seconds
        return f"${self.cost_per_sample(spec, step) * 1e6:,.2f} per 1M samples, {seconds}"  # as the table writes it

    def bound_key(self, spec: Spec) -> tuple:
        return self.key(spec, spec.lower_bound_seconds)

    def bound_order(self, pool: SpecPool) -> np.ndarray:
        """The pool's positions by `bound_key`, ties in the pool's order (as a stable sort by that
        key): its columns through the same float64 operations as `key`, so the same keys."""
        bounds = pool.bounds
        if self.objective is Objective.TIME:
            return np.argsort(bounds, kind="stable")
        cost = self.hardware.price_per_device_hour * pool.devices * bounds / 3600 / self.global_batch
        if self.objective is Objective.COST:
            return np.lexsort((bounds, cost))
        if self.steps_needed is None or self.deadline_seconds is None:
            meets = np.ones(len(bounds), dtype=bool)
        else:
            meets = bounds * self.steps_needed <= self.deadline_seconds
        # (0, cost, step) where the deadline is met, else (1, step): the same order as those tuples.
        return np.lexsort((np.where(meets, bounds, 0.0), np.where(meets, cost, bounds), ~meets))

    def meets_deadline(self, step: float) -> bool:
        if self.steps_needed is None or self.deadline_seconds is None:
            return True
        return step * self.steps_needed <= self.deadline_seconds


def goal_for(request: PlanRequest, profile: ModelProfile, hardware: Hardware) -> Goal:
    if request.objective is not Objective.COST_DEADLINE:
        return Goal(request.objective, hardware, request.global_batch)
    samples = request.samples if request.samples is not None else math.ceil(request.tokens / profile.seq_len)  # type: ignore[operator]
    return Goal(
        request.objective,
        hardware,
        request.global_batch,
        steps_needed=math.ceil(samples / request.global_batch),
        deadline_seconds=request.deadline_hours * 3600,  # type: ignore[operator]
    )


@dataclass
class Ranking:
    """The top specs by the goal (simulated), the top ones the engine runs, and how many were
    simulated."""

    top: list[tuple[tuple, Spec, float]]
    top_runnable: list[tuple[tuple, Spec, float]]
    simulated: int

    @property
    def best_runnable(self) -> tuple[tuple, Spec, float] | None:
        return self.top_runnable[0] if self.top_runnable else None


def rank(specs: Sequence[Spec], goal: Goal, evaluator: Evaluator, *, keep: int, exhaustive: bool,
         engine: Engine) -> Ranking:
    """Branch and bound over specs sorted by their bound key; see the module docstring. The best
    `keep` specs `engine` runs are kept too (`top_runnable`; any engine: those one of pipectl's
    engines runs), so that a plan lists alternatives it can launch even where faster ones no engine
    runs fill the top (`--any-engine --schedules 1f1b,2bw`: the top all 2BW)."""
    pool = SpecPool.of(specs)
    if engine is Engine.ANY:
        runs = (pool.runs_on(Engine.DEEPSPEED) | pool.runs_on(Engine.TORCH)).tolist()
    else:
        runs = pool.runs_on(engine).tolist()
    heap: list[_Worst] = []  # the kept entries, the worst on top (a max-heap by rank)
    runnable: list[_Worst] = []  # the same for the specs `engine` runs
    simulated = 0
    for position in goal.bound_order(pool).tolist():
        spec = pool[position]
        bound = _tied_key(goal.bound_key(spec))
        # Pruned only beyond the worst kept: a spec that may tie it is timed, and the tie decided
        # by preference, not by which was found first (`--top 1` chose otherwise than `--top 10`).
        if not exhaustive and len(heap) >= keep and bound > heap[0].key:
            if len(runnable) >= keep and bound > runnable[0].key:
                break
            if not runs[position]:
                continue  # it can enter neither the top k nor the runnable top k: not timed
        step = evaluator.step_seconds(spec)
        simulated += 1
        entry = _Worst(_tied_key(goal.key(spec, step)), spec, step)
        _keep(heap, entry, keep, exhaustive)
        if runs[position]:
            _keep(runnable, entry, keep, exhaustive)
    return Ranking(_best_first(heap), _best_first(runnable), simulated)


def _tied_key(key: tuple) -> tuple:
    return tuple(tied(x) if isinstance(x, float) else x for x in key)


class _Worst:
    """A ranked entry ordered worst first (for a max-heap on heapq's min-heap): by its key (each
    figure `tied`), then by `Spec.preference`, read only for equal keys (it reads memory figures)."""

    __slots__ = ("key", "spec", "step")

    def __init__(self, key: tuple, spec: Spec, step: float) -> None:
        self.key, self.spec, self.step = key, spec, step

    def __lt__(self, other: "_Worst") -> bool:  # self ranks below other
        if self.key != other.key:
            return self.key > other.key
        return self.spec.preference > other.spec.preference


def _keep(heap: list[_Worst], entry: _Worst, keep: int, exhaustive: bool) -> None:
    """Put `entry` into the max-heap of the `keep` best (all of them when `exhaustive`)."""
    if exhaustive or len(heap) < keep:
        heapq.heappush(heap, entry)
    elif heap[0] < entry:  # the worst kept ranks below it
        heapq.heapreplace(heap, entry)


def _best_first(heap: list[_Worst]) -> list[tuple[tuple, Spec, float]]:
    """The kept entries, best first."""
    return [(entry.key, entry.spec, entry.step) for entry in sorted(heap, reverse=True)]


# --- the plan ------------------------------------------------------------------------------------


@dataclass
class SearchStats:
    """What the search did (the benchmark reports these)."""

    specs: int = 0
    shapes: int = 0
    simulations: int = 0
    simulated_actions: int = 0
    rejected: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # enumerate, rank, morph, records


def plan_homogeneous(
    profile: ModelProfile,
    cluster_name: str,
    hardware: Hardware,
    request: PlanRequest,
    *,
    stats: SearchStats | None = None,
    notes: list[str] | None = None,
) -> Plan:
    check_request(request, profile, hardware)
    space = search_space(request, profile, hardware)
    devices = request.devices or hardware.devices
    max_devices = hardware.devices if request.morph else devices
    clock = time.perf_counter()
    phases: dict[str, float] = {}
    enumeration = enumerate_specs(
        profile, hardware, space, max_devices, workers=request.workers or available_workers()
    )
    phases["enumerate"], clock = time.perf_counter() - clock, time.perf_counter()
    engine = request.target_engine
    evaluator = Evaluator(hardware, request.global_batch, engine=engine, framework=request.framework)
    goal = goal_for(request, profile, hardware)
    pool = enumeration.specs.take(enumeration.specs.devices <= devices)
    plan_notes = [*(notes or []), *_hardware_notes(profile, hardware)]
    if not len(pool):
        rejections = enumeration.rejections
        if max_devices > devices:  # counted up to the morph table's counts too: say why none fits these
            rejections = enumerate_specs(profile, hardware, space, devices, workers=request.workers or available_workers()).rejections
        raise InfeasibleError(_nothing_fits(request, rejections, devices))
    ranking = rank(
        pool, goal, evaluator, keep=request.top, exhaustive=request.include_all, engine=engine
    )
    phases["rank"], clock = time.perf_counter() - clock, time.perf_counter()
    chosen_entry, fallback_notes = _choose_runnable(ranking, goal, engine)
    plan_notes += fallback_notes
    if goal.objective is Objective.COST_DEADLINE and not goal.meets_deadline(chosen_entry[2]):
        plan_notes.append(
            f"no candidate finishes {goal.steps_needed:,} step{'' if goal.steps_needed == 1 else 's'} within "
            f"{request.deadline_hours} h: chose the fastest"
        )
    if goal.objective is Objective.COST_DEADLINE:
        missed = sum(1 for key, _, _ in ranking.top if key[0] == 1)
        if missed:
            enumeration.rejections.add(Rejection.DEADLINE, count=missed)
    sharded_entries, sharded_notes = _gradient_sharded_comparison(pool, goal, evaluator, chosen_entry, request)
    plan_notes += sharded_notes
    chosen = evaluator.candidate(chosen_entry[1], _device_note(chosen_entry[1], devices, hardware))
    if chosen.engine is Engine.TORCH and profile.dtype != "float32":  # `launch.planned_precision` refuses it
        plan_notes.append(f"the torch engine trains in fp32 only: launch refuses this plan of a {profile.dtype} profile "
                          "(profile again with --dtype float32 to run it)")  # fmt: skip
    candidates = _candidate_records(ranking, sharded_entries, chosen_entry[1], chosen, evaluator, devices, hardware)
    phases["records"], clock = time.perf_counter() - clock, time.perf_counter()
    morph = (
        morph_table(enumeration.specs, evaluator, hardware.devices, request, hardware.devices_per_node,
                    chosen=(chosen_entry[2], chosen_entry[1]))
        if request.morph else []
    )
    phases["morph"] = time.perf_counter() - clock
    for reason, example in enumeration.rejections.examples.items():
        if reason is Rejection.MEMORY:
            plan_notes.append(f"e.g. {example}")
    if stats is not None:
        _record_stats(stats, enumeration, evaluator, phases)
    return Plan(
        model=profile.model,
        model_reference=profile.model_reference,
        model_shape=ModelShape.of_profile(profile),
        cluster=cluster_name,
        request=request,
        chosen=chosen,
        candidates=candidates,
        infeasible=enumeration.rejections.summary(),
        morph_table=morph,
        notes=plan_notes,
    )


def _hardware_notes(profile: ModelProfile, hardware: Hardware) -> list[str]:
    """What the layer times were scaled by: another device's peak FLOP/s, or an emulated slowdown."""
    notes = []
    if profile.device != hardware.device.name and hardware.peak_ratio != 1.0:
        notes.append(
            f"profile measured on '{profile.device}', planned for '{hardware.device.name}': layer times "
            f"scaled by {hardware.peak_ratio:.3g} (ratio of peak FLOP/s)"
        )
    if hardware.emulated_slowdown != 1.0:
        notes.append(
            f"'{hardware.kind}' emulates a slower kind: layer times x {hardware.emulated_slowdown:g} "
            "(the worker waits out the difference)"
        )
    return notes


def _choose_runnable(ranking: Ranking, goal: Goal, engine: Engine) -> tuple[tuple[tuple, Spec, float], list[str]]:
    """The best entry `engine` can run: the top one, or the best runnable one with a note saying
    what was passed over; infeasible when the engine runs none that fits."""
    chosen_entry = ranking.top[0]
    plan_notes: list[str] = []
    if engine is Engine.TORCH and not chosen_entry[1].runs_on(engine):
        if ranking.best_runnable is None:
            raise InfeasibleError(
                "no candidate PyTorch's pipelining runtime can run fits (it runs 1f1b, gpipe, interleaved, "
                f"zb-h1 and zbv without recomputation, tensor or data parallelism; best: {chosen_entry[1].describe(goal.global_batch)})",
                hint="plan with --engine deepspeed (or --engine any to see what fits)",
            )
        plan_notes.append(_fallback_note(goal, chosen_entry, ranking.best_runnable,
                                         "which PyTorch's pipelining runtime cannot run", "candidate it can run"))
        chosen_entry = ranking.best_runnable
    if engine is Engine.DEEPSPEED and not chosen_entry[1].deepspeed_runnable:
        zero_only = _zero_not_run(chosen_entry[1])  # its schedule runs; its ZeRO stage does not
        if ranking.best_runnable is None:
            if zero_only:
                raise InfeasibleError(
                    f"only ZeRO stages pipectl's runtime cannot run fit (best: {chosen_entry[1].describe(goal.global_batch)})",
                    hint="plan with --any-engine to see them; pipectl's runtime trains with ZeRO-1, and ZeRO-2 "
                    "and ZeRO-3 with one stage and no tensor split",
                )
            torch_runs_it = chosen_entry[1].runs_on(Engine.TORCH)  # pipectl launches it there: say so first
            raise InfeasibleError(
                "only schedules DeepSpeed's pipeline engine cannot run fit "
                f"(best: {chosen_entry[1].describe(goal.global_batch)})",
                hint=("plan with --engine torch (its torch runtime launches it), " if torch_runs_it else "plan ")
                + "with --any-engine to see them all, or allow 1f1b/gpipe/varuna",
            )
        if zero_only:
            why = f"which pipectl's runtime cannot run (ZeRO-{chosen_entry[1].zero_stage})"
            plan_notes.append(_fallback_note(goal, chosen_entry, ranking.best_runnable, why, "candidate it can run"))
        else:
            plan_notes.append(_fallback_note(goal, chosen_entry, ranking.best_runnable, "which DeepSpeed cannot run",
                                             "DeepSpeed-runnable candidate"))  # fmt: skip
        chosen_entry = ranking.best_runnable
    return chosen_entry, plan_notes


def _candidate_records(
    ranking: Ranking,
    sharded_entries: list[tuple[tuple, Spec, float]],
    chosen_spec: Spec,
    chosen: Candidate,
    evaluator: Evaluator,
    devices: int,
    hardware: Hardware,
) -> list[Candidate]:
    """The plan's candidate list: the chosen one always among them, first when the ranking left it out."""
    # The top, then the runnable ones it left out, in the goal's order.
    ranked = sorted([*ranking.top, *[e for e in ranking.top_runnable if all(e[1] is not s for _, s, _ in ranking.top)]],
                    key=lambda entry: entry[0])  # fmt: skip
    # The best of each ZeRO-2/3 stage, when the top did not reach it: after the top (its key is
    # no better than theirs, or it would be among them).
    ranked += [entry for entry in sharded_entries if all(entry[1] is not spec for _, spec, _ in ranked)]
    candidates = [
        chosen if spec is chosen_spec else evaluator.candidate(spec, _device_note(spec, devices, hardware))
        for _, spec, _ in ranked
    ]
    if not any(c is chosen for c in candidates):
        candidates.insert(0, chosen)
    return candidates


def _record_stats(stats: SearchStats, enumeration: Enumeration, evaluator: Evaluator, phases: dict[str, float]) -> None:
    """Copy what the search did into `stats` (the benchmark reports it)."""
    stats.specs = len(enumeration.specs)
    stats.shapes = enumeration.shapes
    stats.simulations = evaluator.simulations
    stats.simulated_actions = evaluator.simulated_actions
    stats.rejected = sum(enumeration.rejections.counts.values())
    stats.phase_seconds = {name: round(seconds, 3) for name, seconds in phases.items()}


def _fallback_note(goal, best_entry, runnable_entry, why: str, what: str) -> str:
    """The plan note when the best candidate cannot run where the plan is for: "fastest overall is
    <best> (<figures>), <why>; chose the fastest <what> [scope]"."""
    best, scope = goal.best_words(best_entry[0])
    runnable, runnable_scope = goal.best_words(runnable_entry[0])
    return (
        f"{best} {scope or 'overall'} is {best_entry[1].describe(goal.global_batch)} ({goal.figures(best_entry[1], best_entry[2])}), "
        f"{why}; chose the {runnable} {what}{' ' + runnable_scope if runnable_scope else ''}"
    )


def _zero_not_run(spec: Spec) -> bool:
    """Whether the runtime cannot run the spec for its ZeRO stage alone (its schedule it can run)."""
    shape = spec.shape
    return not runtime_runs_zero(
        spec.zero_stage, shape.pipeline_parallel, shape.tensor_parallel, checkpoint_layers=spec.checkpoint_layers
    ) and deepspeed_runnable(
        spec.variant.kind, spec.variant.chunks
    )


def _best_of(pool: SpecPool, goal: Goal, evaluator: Evaluator) -> tuple[tuple, Spec, float] | None:
    """The best of the pool by the goal: branch and bound as `rank` with k = 1 (times a spec only
    while its bound can beat the best found)."""
    best = None
    for position in goal.bound_order(pool).tolist():
        spec = pool[position]
        if best is not None and goal.bound_key(spec) >= best[0]:
            break
        step = evaluator.step_seconds(spec)
        key = goal.key(spec, step)
        if best is None or key < best[0]:
            best = (key, spec, step)
    return best


def _gradient_sharded_comparison(
    pool: SpecPool, goal: Goal, evaluator: Evaluator, chosen: tuple[tuple, Spec, float], request: PlanRequest
) -> tuple[list[tuple[tuple, Spec, float]], list[str]]:
    """Per ZeRO stage 2 or 3 asked for: its best candidate (p = 1 only) and a note saying whether
    it beats the best candidate pipectl's runtime can run (the chosen one, unless --any-engine chose
    another), loses to it, or is it (no note in a plan for another framework). The runtime trains
    them with one stage and no tensor split; a best candidate with a tensor split is planned only,
    and its note says so."""
    entries: list[tuple[tuple, Spec, float]] = []
    notes: list[str] = []
    stages = sorted({z for z in request.zero_stages if z >= 2})
    if not stages:
        return entries, notes
    runnable = chosen if chosen[1].deepspeed_runnable else _best_of(
        pool.take(pool.runs_on(Engine.DEEPSPEED)), goal, evaluator
    )
    for stage in stages:
        label = f"ZeRO-{stage} (planned at p = 1 only: DeepSpeed's pipeline engine refuses it with p > 1)"
        best = _best_of(pool.take(pool.zero_stages == stage), goal, evaluator)
        if best is None:
            notes.append(f"{label}: no one-stage layout with ZeRO-{stage} fits")
            continue
        entries.append(best)
        if request.framework is not None:
            continue  # a plan for another framework (--emit): pipectl's runtime is not the question
        figures = f"{best[1].describe(goal.global_batch)} ({goal.figures(best[1], best[2])})"
        if runnable is not None and best[1] is runnable[1]:
            notes.append(f"{label}: best {figures}, the best candidate pipectl's runtime can run")
            continue
        if runnable is None:
            notes.append(f"{label}: best {figures}; no candidate pipectl's runtime can run fits")
            continue
        other = f"{runnable[1].describe(goal.global_batch)} ({goal.figures(runnable[1], runnable[2])})"
        ratio = _ratio(best, runnable, goal)
        if best[0] < runnable[0]:
            verdict = f"beats the best candidate pipectl's runtime can run, {other}{ratio}"
        else:
            verdict = f"loses to the best candidate pipectl's runtime can run, {other}{ratio}"
        chosen_it = " (chosen: --any-engine)" if best[1] is chosen[1] else ""
        planned_only = "" if best[1].deepspeed_runnable else (
            f"; pipectl's runtime trains ZeRO-{stage} with no tensor split only"
        )
        notes.append(f"{label}: best {figures}{chosen_it} {verdict}{planned_only}")
    return entries, notes


def _ratio(entry: tuple[tuple, Spec, float], other: tuple[tuple, Spec, float], goal: Goal) -> str:
    """', 0.82x its step time' (or its cost per sample under a cost objective); '' when they are
    ranked on different footings (one meets a deadline, the other not)."""
    if goal.objective is Objective.TIME:
        return f": {entry[2] / other[2]:.2f}x its step time"
    mine, theirs = goal.cost_per_sample(entry[1], entry[2]), goal.cost_per_sample(other[1], other[2])
    if goal.objective is Objective.COST_DEADLINE and entry[0][0] != other[0][0]:
        return ""
    return f": {mine / theirs:.2f}x its cost per sample" if theirs > 0 else ""


def _device_note(spec: Spec, devices: int, hardware: Hardware) -> list[str]:
    """Why a plan leaves devices idle, where the hardware says: CPU ranks beyond the host's cores
    share them (`costs.host_compute_slowdown`)."""
    if spec.devices >= devices:
        return []
    note = f"uses {spec.devices} of the {devices} devices"
    cores = hardware.runtime.host_cores if hardware.runtime is not None else 0
    if 0 < cores < min(devices, hardware.devices_per_node):
        note += f" (the host has {count(cores, 'core')}: more ranks than cores share them)"
    return [note]


def _nothing_fits(request: PlanRequest, rejections: Rejections, devices: int) -> str:
    reasons = "; ".join(f"{number} x {reason}" for reason, number in rejections.summary().items()) or "no candidates"
    examples = "; ".join(rejections.examples.values())
    message = f"nothing fits global batch {request.global_batch} on {count(devices, 'device')}: {reasons}"
    if examples:
        message += f" (e.g. {examples})"
    return message
