"""Heterogeneous clusters: split the global batch unevenly over replicas on different device kinds.

VirtualFlow (Or et al. 2022, §4; docs/design.md, 'The global batch'): with n_i devices of kind i, each replica processes v_i
virtual nodes (here: micro-batches of size b) and the split solves

    minimise max_i t_i(b, v_i)   subject to   Σ_i n_i · b · v_i = B.

Every replica runs the same pipeline (t, p and the stage cut of the best homogeneous plan), so
the data-parallel all-reduce still pairs stage with stage; only the number of micro-batches per
replica differs. The split is found by water-filling: each of the B/b micro-batches goes to the
replica that would finish it earliest under the closed-form bound (m + p − 1)-style of
`pipectl.plan.fast.bounds`; then every distinct (kind, m) is simulated and the step is the
slowest replica. One data-parallel ring spans every replica, so its all-reduce is priced on the
slowest inter-node link of any kind (`_on_one_ring`). Gradients are averaged with weights
samples_r / B (`ReplicaShare`), which the runtime applies (`runtime.engines.build.WeightedLoss`: each
rank's DeepSpeed engine runs its own replica's micro-batches); plain averaging of replica means
would over-weight slow replicas.

If the split is not faster (or, for the cost objectives, not cheaper) than the best homogeneous
subset, the plan recommends the homogeneous subset and says why.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.plan import Candidate, Engine, MorphEntry, Objective, Plan, PlanRequest, ReplicaShare
from pipectl.artifacts.profile import ModelProfile
from pipectl.errors import InfeasibleError, UserInputError
from pipectl.plan.candidates import ScheduleVariant, ShapeBuilder, Spec, SpecFigures, lower_bound_seconds
from pipectl.plan.spec_costs import data_parallel_costs, in_flight, state_bytes, step_bytes
from pipectl.plan.costs import Hardware, hardware_for, profile_for
from pipectl.plan.cost_table import replica_groups, stage_costs, stage_costs_for
from pipectl.plan.placement import tensor_parallel_placeable
from pipectl.plan.memory import state_dtype
from pipectl.plan.stage_costs import StageCosts
from pipectl.plan.evaluate import TWO_BW_NOTE, Evaluator, two_bw_steady_note
from pipectl.plan.homogeneous import SearchStats, plan_homogeneous
from pipectl.plan.space import tensor_parallel_possible
from pipectl.schedule import ScheduleKind
from pipectl.words import count


def _sub_cluster(cluster: ClusterSpec, kind: str) -> ClusterSpec:
    return cluster.model_copy(update={"node_types": cluster.nodes_of_kind(kind)})


def _kind_profile(cluster: ClusterSpec, kind: str, profile: ModelProfile, kind_profiles: Sequence[ModelProfile]) -> ModelProfile:
    """The profile that prices `kind`: the one made on its nodes' device (`profile_for`)."""
    return profile_for(cluster.nodes_of_kind(kind)[0].device, profile, kind_profiles)


def _profile_note(cluster: ClusterSpec, profile: ModelProfile, kind_profiles: Sequence[ModelProfile]) -> str:
    """Where each kind's layer times come from: its own profile, or another's scaled by peaks."""
    parts, scaled = [], []
    for kind in cluster.device_kinds:
        node = cluster.nodes_of_kind(kind)[0]
        device, slowdown = node.device, node.compute_slowdown
        mine = profile_for(device, profile, kind_profiles)
        if mine.device == device and slowdown != 1.0:
            parts.append(f"{kind}: the {device} {mine.source.value} profile x {slowdown:g} (emulated)")
        elif mine.device == device:
            parts.append(f"{kind}: its own {mine.source.value} profile")
        else:
            parts.append(f"{kind}: the {mine.device} profile scaled by the ratio of peak FLOP/s")
            scaled.append(device)
    note = "layer times per device kind: " + "; ".join(parts)
    if scaled:
        note += (
            " (a real model's ratio is not the peaks': profile each kind, or derive it with pipectl profile MODEL "
            f"--derive --device {scaled[0]}, and give every profile with plan --profile ... --profile ...)"
        )
    return note


def plan_heterogeneous(
    profile: ModelProfile,
    cluster: ClusterSpec,
    request: PlanRequest,
    *,
    kind_profiles: Sequence[ModelProfile] = (),
    stats: SearchStats | None = None,
) -> Plan:
    """The best homogeneous subset, or an uneven split over every kind when that is better; each
    kind priced with its own profile where `kind_profiles` (or `profile`) holds one. `--devices`
    bounds both; a pinned d is the split's replicas, or one kind's."""
    total = cluster.total_devices
    if request.devices is not None and request.devices > total:
        raise UserInputError(f"--devices {request.devices} is more than the cluster's {count(total, 'device')} "
                             f"({', '.join(cluster.device_kinds)})")
    _check_pins(cluster, request)
    homogeneous, templates = _kind_plans(profile, cluster, request, kind_profiles)
    key = _objective_key(request.objective)
    best_template = min(templates, key=lambda p: key(p.chosen))
    # A framework runs one layout on every device (`plan.frameworks`): no split over the kinds.
    split = None
    if request.framework is None:
        pipelines = ([best_template.chosen, *best_template.candidates] if request.data_parallel is None
                     else _pinned_split_templates(profile, cluster, request, kind_profiles))
        split = _best_split(profile, cluster, pipelines, request, kind_profiles, key)
    if not homogeneous and split is None:
        raise InfeasibleError(f"nothing fits on any device kind with d = {request.data_parallel} pinned, "
                              "nor split over them")
    if not homogeneous:  # only the split holds the pinned d
        made = best_template.model_copy(update={
            "cluster": cluster.name, "request": request, "chosen": split, "candidates": [split],
            "notes": [*best_template.notes, _profile_note(cluster, profile, kind_profiles)]})  # fmt: skip
        return made.model_copy(update={"morph_table": _with_split_entry(made, split, total)})
    best_plan, best_hardware = min(homogeneous, key=lambda item: key(item[0].chosen))
    notes = [*best_plan.notes, _profile_note(cluster, profile, kind_profiles)]
    chosen = best_plan.chosen
    candidates = list(best_plan.candidates)
    if split is not None and key(split) < key(chosen):  # _best_split returns only splits the engine can run
        notes.append(
            f"uneven split over {', '.join(cluster.device_kinds)}: {split.predicted_step_seconds:.4g} {_per(split)}, "
            f"{chosen.predicted_step_seconds / split.predicted_step_seconds:.2f}x as fast as the best homogeneous "
            f"subset ({chosen.devices} x {chosen.device}: {chosen.predicted_step_seconds:.4g} {_per(chosen)})"
        )
        chosen = split
        candidates.insert(0, split)
    else:
        if split is not None:
            candidates = sorted([*candidates, split], key=key)  # in the ranking, not after it
            notes.append(
                f"homogeneous subset of {chosen.devices} x {chosen.device} recommended: the uneven split over "
                f"{', '.join(cluster.device_kinds)} predicts {split.predicted_step_seconds:.4g} {_per(split)} "
                f"(${split.cost_per_million_samples:,.2f} per 1M samples)"
                + ("" if split.deepspeed_runnable else f", a schedule DeepSpeed's engine cannot run ({split.schedule.value})")
            )
        elif request.framework is not None:
            notes.append(f"no uneven split over the device kinds: {request.framework.value} runs one layout on every device")
        elif request.target_engine is Engine.TORCH:
            notes.append("no uneven split over the device kinds: its replicas are data parallelism, which "
                         "PyTorch's pipelining runtime does not have")
        else:
            notes.append("no uneven split over the device kinds fits the global batch and memory")
    made = best_plan.model_copy(
        update={"cluster": cluster.name, "request": request, "chosen": chosen, "candidates": candidates, "notes": notes}
    )
    return made.model_copy(update={"morph_table": _with_split_entry(made, chosen, total)})


def _kind_plans(
    profile: ModelProfile, cluster: ClusterSpec, request: PlanRequest, kind_profiles: Sequence[ModelProfile]
) -> tuple[list[tuple[Plan, Hardware]], list[Plan]]:
    """Each kind's own best plan within `--devices`: those that keep a pinned d (candidates for the
    choice), and every one (templates of the split, whose replicas may hold a d no kind holds alone)."""
    homogeneous: list[tuple[Plan, Hardware]] = []
    templates: list[Plan] = []
    failures = []
    for kind in cluster.device_kinds:
        sub = _sub_cluster(cluster, kind)
        mine = _kind_profile(cluster, kind, profile, kind_profiles)
        hardware = hardware_for(sub, mine, memory_headroom=request.memory_headroom)
        update: dict = {"devices": None if request.devices is None else min(request.devices, hardware.devices)}
        if _pinned_pipeline(request) > (update["devices"] or hardware.devices):
            continue  # not one replica of the pinned pipeline here (`_check_pins`: another kind holds one)
        pinned = _pinned_pipeline(request) * (request.data_parallel or 1)
        if request.data_parallel is not None and pinned > hardware.devices:
            update["data_parallel"] = None  # more replicas than this kind holds: a split's to hold
        try:
            result = plan_homogeneous(mine, f"{cluster.name}[{kind}]", hardware, request.model_copy(update=update))
        except InfeasibleError as exc:
            failures.append(f"{kind}: {exc.message}")
            continue
        templates.append(result)
        if "data_parallel" not in update:
            homogeneous.append((result, hardware))
    if not templates:
        raise InfeasibleError("nothing fits on any device kind: " + "; ".join(failures))
    return homogeneous, templates


def _pinned_pipeline(request: PlanRequest) -> int:
    """Devices one replica of the pinned pipeline takes: t x p pinned (1 for a degree left free)."""
    return (request.tensor_parallel or 1) * (request.pipeline_parallel or 1)


def _check_pins(cluster: ClusterSpec, request: PlanRequest) -> None:
    """Pinned degrees that no layout on the cluster holds, refused in one line naming what it holds.

    A pipeline replica (t x p devices) runs on devices of one kind: a split over the kinds gives each
    kind whole replicas (`uneven_split`). So a pinned t x p must fit in one kind, and t x p x d in all.
    """
    kinds = {kind: _sub_cluster(cluster, kind).total_devices for kind in cluster.device_kinds}
    holds = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    pipeline = _pinned_pipeline(request)
    if pipeline > max(kinds.values()):
        raise UserInputError(
            f"pinned t x p = {pipeline} needs {pipeline} devices of one device kind (a pipeline replica never spans "
            f"kinds), and {cluster.name} holds {holds}",
            hint=f"pin t x p of at most {max(kinds.values())}, or let the planner choose them",
        )
    needed = pipeline * (request.data_parallel or 1)
    available = min(request.devices or cluster.total_devices, cluster.total_devices)
    if needed > available:
        given = f"--devices {request.devices}" if request.devices else f"{cluster.name} holds {holds}"
        raise UserInputError(f"pinned t x p x d = {needed} needs {needed} devices, more than the {available} available ({given})")


def _pinned_split_templates(
    profile: ModelProfile, cluster: ClusterSpec, request: PlanRequest, kind_profiles: Sequence[ModelProfile]
) -> list[Candidate]:
    """With d pinned, the pipelines to split the batch with: every layout of every (t, p) whose
    replicas over all the kinds number exactly d (`_pools`), each kind's planned with t, p and its
    own replicas pinned and every candidate kept.

    Not the best kind's ranked candidates, as without a pin: with d pinned they often hold none of
    those (t, p) (16 replicas on 8 + 8 devices: t = p = 1 only, while the ten fastest layouts of one
    kind pipeline), and what `--top` and `--all` show would decide what fits. Pinning t, p and d
    bounds each search to the micro-batch sizes, schedules and recomputations of one pipeline.
    """
    d = request.data_parallel
    # Every device of each kind, as `_pools` counts replicas (a split beyond --devices is dropped later).
    kinds = [_sub_cluster(cluster, kind).total_devices for kind in cluster.device_kinds]
    layers = len(profile.layers)
    templates: list[Candidate] = []
    for replica in range(1, (request.devices or cluster.total_devices) // d + 1):  # t x p of one replica
        if sum(n // replica for n in kinds) != d:
            continue  # cheap first: placement only lowers the count
        for t in (t for t in range(1, replica + 1) if not replica % t):
            p = replica // t
            if request.tensor_parallel not in (None, t) or request.pipeline_parallel not in (None, p) or p > layers:
                continue
            pools = _pools(cluster, profile, kind_profiles, t, p, request.memory_headroom)
            if len(pools) < 2 or sum(replicas for *_, replicas in pools) != d:
                continue
            for kind, hardware, mine, replicas in pools:
                pinned = request.model_copy(update={
                    "tensor_parallel": t, "pipeline_parallel": p, "data_parallel": replicas,
                    "devices": t * p * replicas, "include_all": True, "morph": False})  # fmt: skip
                try:
                    made = plan_homogeneous(mine, f"{cluster.name}[{kind}]", hardware, pinned)
                except (InfeasibleError, UserInputError):
                    continue  # e.g. the layout fits no memory of this kind, or --even-replicas refuses its d
                templates += [made.chosen, *made.candidates]
    return templates


def _with_split_entry(plan: Plan, chosen: Candidate, total: int) -> list:
    """The best kind's morph table (its counts up to its own devices), with the cluster's whole
    count: the chosen layout there, a split over every kind or the subset it beat."""
    if plan.request.devices not in (None, total) or any(e.devices == total for e in plan.morph_table):
        return list(plan.morph_table)
    note = "" if chosen.devices == total else f"the best homogeneous subset uses {chosen.devices} of {total} devices"
    return sorted([*plan.morph_table, MorphEntry(devices=total, candidate=chosen, note=note)], key=lambda e: e.devices)


def _per(candidate: Candidate) -> str:
    """'s/step', or for PipeDream-2BW (priced in steady state) "s per update in 2BW's steady state"."""
    return "s per update in 2BW's steady state" if candidate.schedule is ScheduleKind.PIPEDREAM_2BW else "s/step"


def _best_split(
    profile: ModelProfile,
    cluster: ClusterSpec,
    templates: Sequence[Candidate],
    request: PlanRequest,
    kind_profiles: Sequence[ModelProfile],
    key,
) -> Candidate | None:
    """The best uneven split whose pipeline is one of `templates`: the best kind's ranked candidates,
    or with d pinned those of the pipelines that make d replicas (`_pinned_split_templates`).

    The fastest layout on one kind is not always the best to split: a smaller micro-batch deals
    the batch out in finer shares (at B = 16 over a kind and one twice as slow, 4 micro-batches of
    4 split 3 + 1, 16 of 1 split 11 + 5). So every distinct pipeline among the templates
    (t, p, b, cut, schedule, recomputation) is tried, a few dozen simulations at most.
    """
    seen, splits = set(), []
    for template in templates:
        pipeline = (template.tensor_parallel, template.pipeline_parallel, template.micro_batch_size, template.chunks,
                    template.schedule, template.recompute_granularity, template.zero_stage, tuple(map(tuple, template.stage_layers)))
        if pipeline in seen or template.zero_stage >= 2:
            continue  # ZeRO-2/3 (p = 1, planned only) are priced for even replicas of one kind only
        seen.add(pipeline)
        split = uneven_split(profile, cluster, template, request, kind_profiles=kind_profiles)
        if split is None or split.devices > (request.devices or cluster.total_devices):
            continue  # every replica of every kind: more devices than --devices gives
        if request.data_parallel is not None and split.data_parallel != request.data_parallel:
            continue
        if split.engine is not None or request.target_engine is Engine.ANY:
            splits.append(split)
    return min(splits, key=key, default=None)


def _pools(
    cluster: ClusterSpec, profile: ModelProfile, kind_profiles: Sequence[ModelProfile], t: int, p: int,
    memory_headroom: float = 0.0,
) -> list[tuple[str, Hardware, ModelProfile, int]]:
    """Per device kind that can hold a t x p pipeline: its hardware, the profile that prices it and
    how many such replicas it holds (before `_on_one_ring`)."""
    pools = []
    for kind in cluster.device_kinds:
        mine = _kind_profile(cluster, kind, profile, kind_profiles)
        hardware = hardware_for(_sub_cluster(cluster, kind), mine, memory_headroom=memory_headroom)
        replicas = hardware.devices // (t * p)
        splits = t == 1 or tensor_parallel_possible(mine, t)  # the kind's profile has the shards
        if replicas and splits and tensor_parallel_placeable(t, hardware.devices_per_node):  # in a node or whole nodes
            pools.append((kind, hardware, mine, replicas))
    return pools  # fmt: skip


def _on_one_ring(kinds: list, one_host: bool = False) -> list:
    """The kinds' hardware with one data-parallel ring for all: every replica's gradient goes round
    the same ring, which leaves each node and runs at the pace of its slowest hop, so every kind's
    data-parallel all-reduce is priced on the slowest inter-node link of any kind (the highest
    latency, the lowest bandwidth) instead of its own (`Hardware.replicas_span_nodes`). A kind's
    tensor-parallel all-reduces stay inside its nodes, on its own links.

    On a cluster of one host (`ClusterSpec.one_host`: kinds emulated on one machine) the ring never
    leaves it: every all-reduce is priced on the slowest intra-node all-reduce of any kind (the host's
    busy all-reduce where the profile measured one), and every kind's ranks count as sharing the host's
    cores (its devices per node are all the ranks of the split)."""
    links = [hardware.links for _, hardware, _, _ in kinds]
    side = "intra" if one_host else "inter"
    latency = max(getattr(link, f"allreduce_{side}_latency_seconds") for link in links)
    bandwidth = min(getattr(link, f"allreduce_{side}_bandwidth_bytes_per_second") for link in links)
    ring = dict(allreduce_inter_latency_seconds=latency, allreduce_inter_bandwidth_bytes_per_second=bandwidth)
    if one_host:
        ring.update(allreduce_intra_latency_seconds=latency, allreduce_intra_bandwidth_bytes_per_second=bandwidth)
    ranks = sum(hardware.devices for _, hardware, _, _ in kinds)
    return [
        (kind, replace(hardware, links=replace(hardware.links, **ring), replicas_span_nodes=not one_host,
                       devices_per_node=ranks if one_host else hardware.devices_per_node), shape, replicas)
        for kind, hardware, shape, replicas in kinds
    ]


def _split_note(shares: list[ReplicaShare], global_batch: int) -> str:
    """Per device kind: its replicas, the micro-batches (virtual nodes) each runs, its samples."""
    parts = []
    for kind in dict.fromkeys(share.device for share in shares):
        mine = [share for share in shares if share.device == kind]
        counts = sorted({share.micro_batches for share in mine}, reverse=True)
        samples = sum(share.samples for share in mine)
        parts.append(
            f"{kind}: {count(len(mine), 'replica')} x {'/'.join(map(str, counts))} "
            f"{'micro-batch' if counts == [1] else 'micro-batches'} of "
            f"{mine[0].micro_batch_size}, {samples} of the {global_batch} samples"
        )
    return "batch split " + "; ".join(parts) + "; each replica's gradient weighted by its samples / B (VirtualFlow)"


def _objective_key(objective: Objective):
    if objective is Objective.TIME:
        return lambda c: (c.predicted_step_seconds,)
    return lambda c: (c.cost_per_million_samples, c.predicted_step_seconds)


def _water_fill(
    kinds: list, total: int, d_total: int, variant: ScheduleVariant, zero_stage: int, dtype: str
) -> list[list[int]]:
    """Per kind and replica, its micro-batches: each of the `total` goes to the replica that would
    finish it earliest, with the closed-form bound as each replica's time for m micro-batches."""
    def bound(index: int, m: int) -> float:
        _, hardware, shape, _ = kinds[index]
        allreduce, optimizer = data_parallel_costs(shape, hardware, d_total, zero_stage, dtype)
        return lower_bound_seconds(shape, variant.kind, m, allreduce, optimizer)

    counts = [[0] * replicas for *_, replicas in kinds]
    heap = [(bound(i, 1), i, r) for i, (*_, replicas) in enumerate(kinds) for r in range(replicas)]
    heapq.heapify(heap)
    for _ in range(total):
        _, i, r = heapq.heappop(heap)
        counts[i][r] += 1
        heapq.heappush(heap, (bound(i, counts[i][r] + 1), i, r))
    return counts


def _schedule_runs_shares(variant: ScheduleVariant, p: int, dealt: list[int]) -> bool:
    """Whether the schedule's order runs with every replica's dealt micro-batch count."""
    if variant.kind is ScheduleKind.PIPEDREAM_2BW and any(m < p - 1 for m in dealt):
        return False  # two weight versions need m >= p - 1 on every replica (`pipectl.schedule.twobw`)
    if variant.kind is ScheduleKind.ZBV and any(m < 2 * p - 1 for m in dealt):
        return False  # rank 0 warms up with 2p - 1 forwards (`schedule.generators.zbv`)
    if variant.kind is ScheduleKind.INTERLEAVED and variant.chunks > 1 and any(m % p for m in dealt):
        return False  # the interleaved order runs micro-batches in groups of p (`plan.space`)
    return True


def _slowest_replica(
    kinds: list, counts: list[list[int]], template: Candidate, variant: ScheduleVariant, d_total: int, dtype: str,
    global_batch: int,
) -> tuple[float, tuple[Evaluator, Spec] | None, list[int]] | None:
    """(step, (evaluator, spec), peak memory per stage) of the slowest replica, every distinct
    (kind, m) simulated on its kind; None when one does not fit that kind's memory."""
    slowest = 0.0
    slowest_run = None
    peak = [0] * template.pipeline_parallel
    for i, (_, hardware, shape, _) in enumerate(kinds):
        evaluator = Evaluator(hardware, global_batch)
        for m in sorted({m for m in counts[i] if m > 0}):
            units = in_flight(shape, variant, m)
            held = state_dtype(dtype, hardware.features)
            per_device = state_bytes(held, template.zero_stage, d_total, variant.kind)
            per_step = step_bytes(held, template.zero_stage, d_total, variant.kind)
            if not shape.memory.fits(per_device, per_step, units, hardware.memory_bytes):
                return None
            allreduce, optimizer = data_parallel_costs(shape, hardware, d_total, template.zero_stage, dtype)
            allocated = shape.memory.per_rank_bytes(per_device, per_step, units)
            figures = SpecFigures.single(
                [int(x) for x in hardware.memory_budget.reserved(allocated)], allreduce.tolist(), optimizer.tolist()
            )
            spec = Spec(shape, d_total, m, variant, template.zero_stage, 0.0, figures)
            step = evaluator.step_seconds(spec)
            if step > slowest:
                slowest, slowest_run = step, (evaluator, spec)
            peak = [max(a, x) for a, x in zip(peak, spec.peak_memory_bytes)]
    return slowest, slowest_run, peak


def _slowest_fractions(slowest_run: tuple[Evaluator, Spec] | None, template: Candidate) -> tuple[float, float]:
    """The bubble and exposed communication of the slowest replica (its own m; not a candidate of
    d_total replicas of that kind, whose even shares would differ from this split's)."""
    if slowest_run is None:
        return template.bubble_fraction, template.communication_fraction
    summary = slowest_run[0].summary(slowest_run[1])
    bubble = min(max(sum(summary.bubble_fraction) / len(summary.bubble_fraction), 0.0), 1.0)
    exposed = min(summary.communication_seconds / summary.step_seconds, 1.0) if summary.step_seconds > 0 else 0.0
    return bubble, exposed


def uneven_split(
    profile: ModelProfile,
    cluster: ClusterSpec,
    template: Candidate,
    request: PlanRequest,
    *,
    kind_profiles: Sequence[ModelProfile] = (),
) -> Candidate | None:
    """Replicas of `template`'s pipeline on every device kind, with micro-batches water-filled;
    each kind's times from its own profile where there is one (`profile_for`)."""
    t, p, b = template.tensor_parallel, template.pipeline_parallel, template.micro_batch_size
    variant = ScheduleVariant(template.schedule, template.chunks)
    B = request.global_batch
    if B % b:
        return None
    total = B // b
    kinds = [
        (kind, hardware, ShapeBuilder(mine, hardware).shape_from_cuts(
            t, b, template.recompute_granularity, p, template.chunks, [tuple(s) for s in template.stage_layers],
            v_placement=variant.kind.v_placement), replicas)
        for kind, hardware, mine, replicas in _pools(cluster, profile, kind_profiles, t, p, request.memory_headroom)
    ]  # fmt: skip
    if len(kinds) < 2:
        return None
    kinds = _on_one_ring(kinds, cluster.one_host)
    d_total = sum(replicas for *_, replicas in kinds)
    if total < d_total:  # a replica without a micro-batch: fewer replicas would be another layout
        return None
    counts = _water_fill(kinds, total, d_total, variant, template.zero_stage, profile.dtype)
    if not _schedule_runs_shares(variant, p, [m for row in counts for m in row if m > 0]):
        return None
    # Simulate every distinct (kind, m) and check memory on that kind.
    slowest_replica = _slowest_replica(kinds, counts, template, variant, d_total, profile.dtype, B)
    if slowest_replica is None:
        return None
    slowest, slowest_run, peak = slowest_replica
    shares: list[ReplicaShare] = []
    price = 0.0
    used_devices = 0
    for i, (kind, hardware, _, _) in enumerate(kinds):
        for m in counts[i]:
            if m == 0:
                continue
            shares.append(ReplicaShare(replica=len(shares), device=kind, micro_batch_size=b, micro_batches=m,
                                       samples=b * m, gradient_weight=b * m / B))
            price += hardware.price_per_device_hour * t * p
            used_devices += t * p
    # The template's step does the same model FLOPs for the same B.
    step_flops = template.tflops_per_device * template.predicted_step_seconds * template.devices * 1e12
    bubble, exposed = _slowest_fractions(slowest_run, template)
    notes = [_split_note(shares, B)]
    if variant.kind is ScheduleKind.PIPEDREAM_2BW and slowest_run is not None:
        evaluator, spec = slowest_run  # the slowest replica's steady state, beside its flushed step
        notes += [TWO_BW_NOTE, two_bw_steady_note(slowest, evaluator.flushed_step_seconds(spec), spec.micro_batches)]
    return Candidate(
        devices=used_devices,
        device="mixed",
        tensor_parallel=t,
        pipeline_parallel=p,
        data_parallel=len(shares),
        micro_batch_size=b,
        micro_batches=max(s.micro_batches for s in shares),
        chunks=template.chunks,
        schedule=template.schedule,
        recompute=template.recompute,
        checkpoint_layers=template.checkpoint_layers,
        selective_recompute=template.selective_recompute,
        zero_stage=template.zero_stage,
        stage_layers=template.stage_layers,
        predicted_step_seconds=slowest,
        samples_per_second=B / slowest,
        tflops_per_device=step_flops / slowest / used_devices / 1e12,
        peak_memory_bytes=peak,
        bubble_fraction=bubble,  # of the slowest replica
        communication_fraction=exposed,
        cost_per_million_samples=price * slowest / 3600 / B * 1e6,
        replicas=shares,
        deepspeed_runnable=template.deepspeed_runnable,
        # replicas over kinds: data parallel, which only DeepSpeed's engine runs
        engine=Engine.DEEPSPEED if template.deepspeed_runnable and request.target_engine is not Engine.TORCH else None,
        notes=notes,
    )


def replica_stage_costs(
    candidate: Candidate, profile: ModelProfile, cluster: ClusterSpec, kind_profiles: Sequence[ModelProfile] = ()
) -> list[tuple[str, int, StageCosts]]:
    """Per distinct (kind, micro-batches) of the candidate's replicas (`replica_groups`), its cost
    table (`stage_costs`): for a split, each kind on its own nodes with its own profile and the
    split's one data-parallel ring (`_on_one_ring`), as `uneven_split` priced it; the step is the
    slowest replica's. One entry for an even layout (`stage_costs_for`); replicas of one kind that
    run uneven shares of the batch (ceiling and floor of B / (d x b)) are one pool, as the search
    priced them: one entry per share on the cluster's own links."""
    groups = replica_groups(candidate)
    if len({kind for kind, _ in groups}) == 1:
        return [
            (kind, micro_batches,
             stage_costs_for(candidate.model_copy(update={"micro_batches": micro_batches}), profile, cluster, kind_profiles))
            for kind, micro_batches in groups
        ]  # fmt: skip
    t, p = candidate.tensor_parallel, candidate.pipeline_parallel
    pools = _on_one_ring(_pools(cluster, profile, kind_profiles, t, p), cluster.one_host)
    priced = {kind: (hardware, mine) for kind, hardware, mine, _ in pools}
    result = []
    for kind, micro_batches in groups:
        hardware, mine = priced[kind]
        costs = stage_costs(mine, hardware, candidate.stage_layers, micro_batch_size=candidate.micro_batch_size,
                            tensor_parallel=t, data_parallel=candidate.data_parallel, pipeline_parallel=p,
                            zero_stage=candidate.zero_stage, checkpoint_layers=candidate.checkpoint_layers,
                            v_placement=ScheduleKind(candidate.schedule).v_placement,
                            selective_recompute=candidate.selective_recompute)  # fmt: skip
        result.append((kind, micro_batches, costs))
    return result
