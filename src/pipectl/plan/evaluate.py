"""Time a spec and turn it into a `Candidate` (the predicted figures plan.json records).

The step time is that of the event-driven simulator (`pipectl.plan.simulate`) run on the very
schedule the runtime executes (`pipectl.schedule.generate`) with the spec's cost table, as
`pipectl.plan.timing` computes it: by an exact fast path equal to that simulation to 1e-12
relative where one applies, by the simulation itself otherwise or in reference mode. Bounds
(`tighter_bound_seconds`) only decide what need not be timed; no figure comes from them.

PipeDream-2BW has no flush: its "step" is the time per update (m micro-batches) in steady state,
`pipectl.plan.twobw_steady_state`'s figure (`timing.two_bw_summary_of`), and so are its samples/s, TFLOP/s,
cost, bubble and communication. Its notes give the flushed 1F1B step of the same layout beside it.

Reported figures:

- samples/s = B / step (with uneven replicas the step is the busiest replica's: it runs
  ⌈B/(d*b)⌉ micro-batches, the others wait for it at the gradient all-reduce);
- TFLOP/s per device = model FLOPs of the step / (step * devices), model FLOPs being the profile's
  forward FLOPs x 3 (forward + backward, docs/design.md, 'Parameters and FLOPs') or x 4 with recomputation (hardware FLOPs,
  Narayanan et al. 2021 §5.1; per-layer checkpointing: + every layer's forward but the head's;
  selective recomputation's attention cores are not added: the profile records their time and
  bytes, not their FLOPs, so its TFLOP/s is the model's, a slight under-count of the hardware's);
- cost per million samples = price per device-hour * devices * step / 3600 / B * 1e6;
- bubble % = mean over ranks of the simulator's idle / step; communication % = the simulator's
  exposed (not overlapped) transfer and all-reduce time / step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pipectl.artifacts.base import MAX_SECONDS
from pipectl.errors import UserInputError
from pipectl.artifacts.plan import Candidate, Engine, Framework, Recompute, ReplicaShare, replica_shares, runtime_runs_zero
from pipectl.plan.candidates import Spec
from pipectl.plan.costs import Hardware, host_compute_slowdown
from pipectl.plan.placement import ranks_share_node
from pipectl.plan.fast import bounds, varuna_flags, waves
from pipectl.plan.stage_costs import StageCosts
from pipectl.plan.simulate import StepSummary
from pipectl.plan.timing import actions_per_step, reference_mode, step_seconds_of, summary_of, two_bw_summary_of
from pipectl.schedule import ScheduleKind, deepspeed_runnable, stage_ranks
from pipectl.words import count

TWO_BW_NOTE = "PipeDream-2BW: 1-stale weight updates (a different optimizer than data-parallel Adam)"
NOT_DEEPSPEED_NOTE = "DeepSpeed's pipeline engine cannot run this schedule (plan and simulate only)"
TORCH_NOTE = (
    "engine torch: PyTorch's pipelining runtime runs it (pipectl launch starts it on torchrun, CPU ranks)"
)


def two_bw_steady_note(update_seconds: float, flushed_seconds: float, micro_batches: int,
                       costs: StageCosts | None = None) -> str:
    """The note on a 2BW candidate: its steady state per update beside the flushed step.

    >>> two_bw_steady_note(1.5, 2.0, 8)
    '2BW steady state 1.5 s per update of 8 micro-batches, no flush (flushed 1F1B: 2 s per step, 1.33x)'
    """
    note = (
        f"2BW steady state {update_seconds:.4g} s per update of {count(micro_batches, 'micro-batch')}, no flush "
        f"(flushed 1F1B: {flushed_seconds:.4g} s per step, {flushed_seconds / update_seconds:.2f}x)"
    )
    if costs is not None and (costs.jitter_seconds > 0 or costs.blocking_p2p):
        note += "; the steady state times transfers as asynchronous and exact, the flushed step as the links do"
    return note


def zero_stage_note(zero_stage: int, *, checkpoint_layers: bool = False) -> str:
    """The note on a candidate whose ZeRO stage pipectl's runtime does not train with."""
    if zero_stage == 3 and checkpoint_layers:
        return ("ZeRO-3: pipectl's runtime trains it with one stage and no tensor split, but not with per-layer "
                "checkpointing (plan and simulate only)")
    if zero_stage >= 2:
        return (f"ZeRO-{zero_stage}: pipectl's runtime trains with ZeRO-1, and ZeRO-2 and ZeRO-3 with one stage "
                "and no tensor split (plan and simulate only)")
    return f"ZeRO-{zero_stage}: pipectl's runtime trains with ZeRO-1 only (plan and simulate only)"


def _schedule_args(spec: Spec) -> tuple:
    """(kind, p, m, v, recompute): the schedule the runtime executes for this spec, as
    `pipectl.plan.timing` and `pipectl.schedule.generate` take it (R actions for whole-stage
    recomputation only: per-layer checkpointing is inside the backward's cost)."""
    shape = spec.shape
    recompute = shape.recompute is Recompute.STAGE
    return (spec.variant.kind, shape.pipeline_parallel, spec.micro_batches, spec.variant.chunks, recompute)


def costs_of(spec: Spec, hardware: Hardware) -> StageCosts:
    """The simulator's cost table for a spec (same rules as `cost_table.stage_costs`, from the shape)."""
    shape = spec.shape
    p, t, d = shape.pipeline_parallel, shape.tensor_parallel, spec.data_parallel
    sends = []
    jitter = 0.0
    inside_node = _boundaries_inside_node(len(shape.stage_layers), p, t, d, hardware.devices_per_node, shape.v_placement)
    for (_, end), inside in zip(shape.stage_layers[:-1], inside_node):
        link = hardware.links.intra if inside else hardware.links.inter
        jitter = max(jitter, link.jitter_seconds)
        sends.append(link.seconds(shape.table.output_activation_bytes[end - 1]))
    # Measured engine terms: a rank computes slower when the host runs several ranks at once.
    slowdown = host_compute_slowdown(hardware, p * t * d)
    forward = tuple((shape.forward * slowdown).tolist())
    return StageCosts(
        forward_seconds=forward,
        backward_seconds=tuple((shape.backward * slowdown).tolist()),
        recompute_seconds=forward,
        send_forward_seconds=tuple(sends),
        send_backward_seconds=tuple(sends),
        allreduce_seconds=spec.allreduce_seconds,
        optimizer_seconds=spec.optimizer_seconds,
        jitter_seconds=jitter,
        blocking_p2p=hardware.device.blocking_p2p,
    )


@lru_cache(maxsize=4096)
def _boundaries_inside_node(
    stages: int, p: int, t: int, d: int, devices_per_node: int, v_placement: bool = False
) -> tuple[bool, ...]:
    """Per stage boundary s → s + 1: whether the two ranks share a node (`ranks_share_node`;
    zbv's turn, stages p − 1 and p on one rank, does)."""
    ranks = stage_ranks(stages, p, v_placement)
    return tuple(ranks_share_node(ranks[stage], ranks[stage + 1], p, t, d, devices_per_node) for stage in range(stages - 1))


class Evaluator:
    """Times specs, caching step times by spec key (the search asks again for the morph table).

    Where the step time's own pass already yields the bubble and the exposed communication (the
    wave pass of 1F1B-like schedules, Varuna's flat pass, the simulation itself; no jitter), that
    summary is kept too, so recording a ranked or morph-table spec as a `Candidate` costs no
    second pass. `reference` simulates every spec instead of taking a fast path (default: the
    `PIPECTL_PLAN_REFERENCE` environment variable, `pipectl.plan.timing.reference_mode`).
    """

    def __init__(self, hardware: Hardware, global_batch: int, *, reference: bool | None = None,
                 engine: Engine = Engine.DEEPSPEED, framework: Framework | None = None) -> None:
        self.hardware = hardware
        self.global_batch = global_batch
        self.engine = engine  # the request's: which engine each candidate is recorded as run by
        # Another framework the plan is for (`plan --emit`): its candidates carry no notes about
        # what pipectl's runtimes can run, which is not where they will run.
        self.framework = framework
        self.reference = reference_mode() if reference is None else reference
        self._steps: dict[tuple, float] = {}
        self._summaries: dict[tuple, StepSummary] = {}
        self._bounds: dict[tuple, float] = {}  # tighter bounds of specs not timed (yet)
        self._bound_costs: tuple[tuple | None, StageCosts | None] = (None, None)  # the last bound's
        self.simulations = 0
        self.simulated_actions = 0

    def step_seconds(self, spec: Spec) -> float:
        """The spec's step time (2BW: its time per update in steady state), cached by spec key."""
        key = spec.key
        step = self._steps.get(key)
        if step is None:
            args = _schedule_args(spec)
            costs = self._bound_costs[1] if self._bound_costs[0] == key else costs_of(spec, self.hardware)
            if spec.variant.kind is ScheduleKind.PIPEDREAM_2BW:
                summary = _two_bw_summary(spec, costs, self.reference)
                self._summaries[key] = summary
                step = summary.step_seconds
            elif self.reference or _summary_comes_free(spec.variant.kind, costs):
                summary = summary_of(*args, costs, reference=self.reference)
                self._summaries[key] = summary
                step = summary.step_seconds
            else:
                step = step_seconds_of(*args, costs)
            self._steps[key] = step
            self.simulations += 1
            self.simulated_actions += actions_per_step(*args)
        return step

    def timings(self) -> tuple[dict, dict, dict]:
        """The step times, kept summaries and tighter bounds known so far, by spec key, for `adopt`."""
        return dict(self._steps), dict(self._summaries), dict(self._bounds)

    def adopt(self, timings: tuple[dict, dict, dict], simulations: int, simulated_actions: int) -> None:
        """Take what another process's copy of this evaluator computed (`timings`), and count its
        simulations. A figure known here already is kept: both are the same computation."""
        for mine, theirs in zip((self._steps, self._summaries, self._bounds), timings, strict=True):
            for key, value in theirs.items():
                mine.setdefault(key, value)
        self.simulations += simulations
        self.simulated_actions += simulated_actions

    def tighter_bound_seconds(self, spec: Spec) -> float:
        """A lower bound on `step_seconds(spec)` at least as tight as the spec's own, for pruning.

        1F1B's order also gets the in-flight loops of `pipectl.plan.fast.bounds`, Varuna's its
        warm-up and cool-down paths (its order's ends from `varuna_flags.order_ends`), each lowered
        by the tie tolerance so that rounding never lifts it above the simulated step.
        """
        bound = spec.lower_bound_seconds
        step = self._steps.get(spec.key)
        if step is not None:
            return step
        known = self._bounds.get(spec.key)
        if known is not None:
            return known
        kind, p, m, v, recompute = _schedule_args(spec)
        # 2BW's price is its steady state, which 1F1B's in-flight loops (a flushed step) do not bound.
        pair_loops = kind is not ScheduleKind.PIPEDREAM_2BW and bounds.has_pair_loops(kind, p, m, v)
        if pair_loops or (kind is ScheduleKind.VARUNA and p > 1):
            costs = costs_of(spec, self.hardware)
            self._bound_costs = (spec.key, costs)  # the simulation, if one follows, reads them
            if costs.jitter_seconds == 0 and not costs.blocking_p2p:
                if pair_loops:
                    tighter = bounds.pair_loop_bound_seconds(m, recompute, costs)
                else:
                    tighter = bounds.varuna_bound_seconds(m, *varuna_flags.order_ends(p, m), costs)
                bound = max(bound, tighter * (1 - 1e-12))
        self._bounds[spec.key] = bound
        return bound

    def cost_per_sample(self, spec: Spec, step: float) -> float:
        return self.hardware.price_per_device_hour * spec.devices * step / 3600 / self.global_batch

    def summary(self, spec: Spec):
        """The step's summary (time, bubble and exposed communication per rank): one more simulation."""
        timeline = self._summaries.get(spec.key)
        if timeline is None and spec.variant.kind is ScheduleKind.PIPEDREAM_2BW:
            timeline = _two_bw_summary(spec, costs_of(spec, self.hardware), self.reference)
        elif timeline is None:
            timeline = summary_of(*_schedule_args(spec), costs_of(spec, self.hardware), reference=self.reference)
        self._steps.setdefault(spec.key, timeline.step_seconds)
        return timeline

    def flushed_step_seconds(self, spec: Spec) -> float:
        """One flushed step of the spec's schedule (for 2BW, 1F1B's order), whatever its pricing."""
        return step_seconds_of(*_schedule_args(spec), costs_of(spec, self.hardware), reference=self.reference)

    def candidate(self, spec: Spec, notes: list[str] | None = None) -> Candidate:
        """The full record: one more simulation for the bubble and the exposed communication."""
        timeline = self.summary(spec)
        step = timeline.step_seconds
        if step > MAX_SECONDS:  # no layout of a real device: a figure far off (a hand-edited catalog or calibration)
            raise UserInputError(
                f"the step of {spec.devices} devices' best layout is predicted at {step:.3g} s, beyond {MAX_SECONDS:.0e} s: "
                f"the figures of {self.hardware.kind} or its links cannot be a real device's",
                hint="check the catalog's GEMM efficiency and the cluster's or calibration's link figures",
            )
        shape = spec.shape
        table = shape.table
        per_micro_batch = table.total_forward_flops() * (4 if spec.recompute else 3)
        if spec.checkpoint_layers:  # each checkpointed layer's forward once more (not the head's)
            per_micro_batch += sum(f for i, f in enumerate(table.forward_flops) if table.checkpointed(i))
        step_flops = per_micro_batch * (self.global_batch // shape.micro_batch_size)
        bubble = sum(timeline.bubble_fraction) / len(timeline.bubble_fraction)
        notes = list(notes or [])
        if spec.variant.kind.changes_optimizer_semantics:
            notes.append(TWO_BW_NOTE)
        if spec.variant.kind is ScheduleKind.PIPEDREAM_2BW:
            notes.append(two_bw_steady_note(step, self.flushed_step_seconds(spec), spec.micro_batches,
                                            costs_of(spec, self.hardware)))
        engine = spec.engine_for(self.engine)
        features = self.hardware.features
        if features is not None and not features.runnable_by_pipectl:
            engine = None  # priced with another engine's features: for comparison only
            notes.append(engine_features_note(features))
        elif self.framework is not None:
            pass
        elif engine is Engine.TORCH:
            notes.append(TORCH_NOTE)
        elif not deepspeed_runnable(spec.variant.kind, spec.variant.chunks):
            notes.append(NOT_DEEPSPEED_NOTE)
        if self.framework is None and not runtime_runs_zero(
            spec.zero_stage, shape.pipeline_parallel, shape.tensor_parallel, checkpoint_layers=spec.checkpoint_layers
        ):
            notes.append(zero_stage_note(spec.zero_stage, checkpoint_layers=spec.checkpoint_layers))
        replicas = replica_shares(self.global_batch, spec.data_parallel, shape.micro_batch_size, self.hardware.kind)
        if replicas:
            notes.append(uneven_note(replicas))
        return Candidate(
            devices=spec.devices,
            device=self.hardware.kind,
            tensor_parallel=shape.tensor_parallel,
            pipeline_parallel=shape.pipeline_parallel,
            data_parallel=spec.data_parallel,
            micro_batch_size=shape.micro_batch_size,
            micro_batches=spec.micro_batches,
            chunks=spec.variant.chunks,
            schedule=spec.variant.kind,
            recompute=spec.recompute,
            checkpoint_layers=spec.checkpoint_layers,
            selective_recompute=spec.selective_recompute,
            zero_stage=spec.zero_stage,
            stage_layers=[tuple(stage) for stage in shape.stage_layers],
            predicted_step_seconds=step,
            samples_per_second=self.global_batch / step,
            tflops_per_device=step_flops / step / spec.devices / 1e12,
            peak_memory_bytes=list(spec.peak_memory_bytes),
            bubble_fraction=min(max(bubble, 0.0), 1.0),
            communication_fraction=min(timeline.communication_seconds / step, 1.0) if step > 0 else 0.0,
            cost_per_million_samples=self.cost_per_sample(spec, step) * 1e6,
            replicas=replicas,
            deepspeed_runnable=spec.deepspeed_runnable,
            engine=engine,
            notes=notes,
        )


def engine_features_note(features) -> str:
    """e.g. "priced as megatron-core runs it (sequence parallel, vocab parallel): pipectl's runtimes
    do not run these features (plan and simulate only)"."""
    return (f"priced as {features.name} runs it ({', '.join(features.named)}): pipectl's runtimes do not run these "
            "features (plan and simulate only)")


def uneven_note(replicas: list[ReplicaShare]) -> str:
    """e.g. 'uneven replicas: of 3, 2 run 5 micro-batches, 1 runs 6 micro-batches; each gradient
    weighted by its samples / B (VirtualFlow), the step set by the busiest'."""
    by_count: dict[int, int] = {}
    for share in replicas:
        by_count[share.micro_batches] = by_count.get(share.micro_batches, 0) + 1
    parts = [f"{n} {'runs' if n == 1 else 'run'} {count(m, 'micro-batch')}" for m, n in sorted(by_count.items())]
    return (
        f"uneven replicas: of {len(replicas)}, " + ", ".join(parts)
        + "; each gradient weighted by its samples / B (VirtualFlow), the step set by the busiest"
    )


def _two_bw_summary(spec: Spec, costs: StageCosts, reference: bool) -> StepSummary:
    """PipeDream-2BW's steady state per update for the spec (`timing.two_bw_summary_of`)."""
    return two_bw_summary_of(spec.shape.pipeline_parallel, spec.micro_batches, spec.shape.recompute is Recompute.STAGE, costs,
                             reference=reference)


def _summary_comes_free(kind: ScheduleKind, costs: StageCosts) -> bool:
    """Whether `summary_of` costs what `step_seconds_of` does (and gives the same step time).

    GPipe's step time is a closed form while its summary walks the waves; with jitter the summary
    keeps every record of the event-driven simulation.
    """
    if costs.jitter_seconds > 0 or costs.blocking_p2p:  # jitter, rendezvous: the full timeline
        return False
    return kind in (ScheduleKind.VARUNA, ScheduleKind.ZB_H1) or (kind is not ScheduleKind.GPIPE and waves.supported(kind, 0.0))


@dataclass(frozen=True)
class Ranked:
    """A simulated spec with its objective key (smaller is better)."""

    key: tuple
    spec: Spec
    step_seconds: float
