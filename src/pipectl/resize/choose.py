"""Which layout a job gets on N devices: a morph-table look-up, a re-plan only when the table lacks N.

The global batch B never changes (docs/design.md, 'The global batch' and 'Resize and recovery').
When no layout on exactly N devices keeps B and fits in memory (or one on fewer devices is
faster), the planner's morph-table entry for N holds the best plan on *fewer* devices; the
choice says so in its notes.

    >>> from pipectl.artifacts.plan import Candidate, ModelShape, MorphEntry, Plan, PlanRequest
    >>> def cand(p, d, m):
    ...     cuts = [(0, 9)] if p == 1 else [(0, 4), (4, 9)]
    ...     return Candidate(devices=p * d, device="cpu", tensor_parallel=1, pipeline_parallel=p,
    ...         data_parallel=d, micro_batch_size=2, micro_batches=m, schedule="1f1b", recompute=False,
    ...         zero_stage=1, stage_layers=cuts, predicted_step_seconds=0.1, samples_per_second=80.0,
    ...         tflops_per_device=0.0, peak_memory_bytes=[1] * p, bubble_fraction=0.0,
    ...         communication_fraction=0.0, cost_per_million_samples=0.0)
    >>> plan = Plan(model="gpt-tiny", model_shape=ModelShape(parameter_count=9, layer_parameter_counts=[1] * 9),
    ...     cluster="local", request=PlanRequest(global_batch=8), chosen=cand(2, 1, 4), morph_table=[MorphEntry(devices=1, candidate=cand(1, 1, 4)),
    ...     MorphEntry(devices=2, candidate=cand(2, 1, 4)), MorphEntry(devices=3, candidate=cand(2, 1, 4))])
    >>> choice = choose_candidate(plan, 3)
    >>> choice.candidate.devices, choice.source, choice.fewer_devices
    (2, 'morph-table', True)
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from pipectl.artifacts.plan import Candidate, MorphEntry, Plan, PlanRequest
from pipectl.artifacts.run import PLAN_FILE
from pipectl.cluster import local_cluster, plan_cluster_file
from pipectl.errors import InfeasibleError, UserInputError
from pipectl.plan.search import plan as search_plan
from pipectl.planfile import count_ranges, load_kind_profiles, load_plan_profile
from pipectl.words import count

log = logging.getLogger(__name__)

PlanSource = Literal["morph-table", "re-planned"]
# Re-plans the plan being resized for a device count; returns the entry for it (see `replanner`).
Replanner = Callable[[int], MorphEntry]


@dataclass(frozen=True)
class LayoutChoice:
    """The candidate a job gets on `requested_devices`, where it came from, and what to tell the user."""

    requested_devices: int
    candidate: Candidate
    source: PlanSource
    entry: MorphEntry
    notes: list[str] = field(default_factory=list)

    @property
    def fewer_devices(self) -> bool:
        return self.candidate.devices < self.requested_devices


def cluster_capacity(plan: Plan) -> int | None:
    """Devices the plan's cluster has, or None when it has no fixed size (the local cluster: any
    number of CPU ranks) or its description cannot be read any more."""
    try:
        cluster = plan_cluster_file(plan)
    except UserInputError:
        return None
    return None if cluster.local else cluster.total_devices


def _fewer_devices_note(plan: Plan, entry: MorphEntry, requested: int) -> str:
    used = entry.candidate.devices if entry.candidate else 0
    reason = entry.note or (
        f"the global batch {plan.global_batch} cannot be split over {requested} devices "
        f"(d x b x m = {plan.global_batch} with t x p x d = {requested})"
    )
    if f"uses {used} of {requested} devices" in reason:  # the morph table's or a re-plan's note says it already
        return reason
    return f"{reason}; the best plan that keeps B = {plan.global_batch} uses {used} of {requested} devices"


def choose_candidate(plan: Plan, devices: int, *, replan: Replanner | None = None) -> LayoutChoice:
    """The plan for `devices` from `plan.morph_table`, or from `replan` when the table lacks it.

    Errors name the value: `devices` < 1, beyond a fixed-size cluster and not in the table, a
    table entry where nothing fits, or a missing entry with no way to re-plan.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UserInputError(f"--devices must be a positive number of devices, got {devices!r}")
    entry = plan.for_devices(devices)
    source: PlanSource = "morph-table"
    if entry is None:
        capacity = cluster_capacity(plan)
        known = sorted(e.devices for e in plan.morph_table)
        if capacity is not None and devices > capacity:
            raise UserInputError(
                f"--devices {devices} exceeds cluster '{plan.cluster}' ({capacity} devices) and the plan's "
                f"morph table has no entry for it (it covers {count_ranges(known) or 'no counts'})",
                hint="re-plan for a bigger cluster with pipectl plan, then resize",
            )
        if replan is None:
            raise UserInputError(
                f"the plan's morph table has no entry for {count(devices, 'device')} "
                f"(it covers {count_ranges(known) or 'no counts'}) and the plan cannot be re-planned here",
                hint="re-plan with pipectl plan --devices ... and launch that plan",
            )
        entry = replan(devices)
        source = "re-planned"
    if entry.candidate is None:
        raise InfeasibleError(
            f"no layout fits on {count(devices, 'device')}: {entry.note or 'the planner found none'}",
            hint="pick another --devices count (see the plan's morph table)",
        )
    notes = []
    if source == "re-planned":
        notes.append(f"the morph table had no entry for {count(devices, 'device')}: re-planned from the plan's request and profile")
    if entry.candidate.devices < devices:
        notes.append(_fewer_devices_note(plan, entry, devices))
    elif entry.note:
        notes.append(entry.note)
    return LayoutChoice(devices, entry.candidate, source, entry, notes)


def replanner(plan: Plan, plan_dir: str | os.PathLike[str]) -> Replanner:
    """Re-plans `plan` (whose plan.json lies in `plan_dir`) for a device count: see `replan_for_devices`."""
    return functools.partial(replan_for_devices, plan, plan_dir=Path(plan_dir))


# The request's pinned degrees, by the letter a note names them with.
PINNED_DEGREES = {"tensor_parallel": "t", "pipeline_parallel": "p", "data_parallel": "d"}


def replan_for_devices(plan: Plan, devices: int, *, plan_dir: Path) -> MorphEntry:
    """Re-plan for exactly `devices` from the plan's own request (every constraint kept: schedules,
    recomputation, pinned degrees, ZeRO stages), its profile (the verified copy in `plan_dir`) and
    its cluster.

    Used only when the morph table lacks the count (the table is meant to make a resize a look-up).
    """
    covered = count_ranges([e.devices for e in plan.morph_table]) or "no counts"
    if plan.profile is None:
        raise UserInputError(
            f"the plan's morph table has no entry for {count(devices, 'device')} (it covers {covered}) and the "
            f"plan records no profile to re-plan from",
            hint="re-plan with pipectl plan --devices ... and launch that plan",
        )
    profile = load_plan_profile(plan_dir / PLAN_FILE, plan)
    kind_profiles = load_kind_profiles(plan_dir / PLAN_FILE, plan)
    cluster = plan_cluster_file(plan)
    if cluster.local:
        cluster = local_cluster(devices, base=cluster)
    request = plan.request.model_copy(update={"devices": devices})
    # Degrees pinned for more devices than the resize leaves cannot hold; the global batch can: the
    # job moves without them, and says so.
    pinned = pins_beyond(request, devices)
    unpinned = ""
    if pinned:
        request = request.model_copy(update={name: None for name in pinned})
        unpinned = (f"the plan pinned {', '.join(f'{PINNED_DEGREES[name]} = {value}' for name, value in pinned.items())}, "
                    f"more than {count(devices, 'device')} can hold: re-planned without pinning "
                    + ("them" if len(pinned) > 1 else "it"))
    try:
        replanned = search_plan(profile, cluster, request, kind_profiles=kind_profiles)
    except (InfeasibleError, UserInputError) as exc:
        return MorphEntry(devices=devices, candidate=None, note=_joined(unpinned, exc.message))
    entry = replanned.for_devices(devices)
    if entry is not None:
        return entry.model_copy(update={"note": _joined(unpinned, entry.note)})
    note = "" if replanned.chosen.devices == devices else (
        f"the best plan that keeps B = {plan.global_batch} uses {replanned.chosen.devices} of {devices} devices"
    )
    return MorphEntry(devices=devices, candidate=replanned.chosen, note=_joined(unpinned, note))


def _joined(*notes: str) -> str:
    return "; ".join(note for note in notes if note)


def pins_beyond(request: PlanRequest, devices: int) -> dict[str, int]:
    """The request's pinned degrees (t, p, d by field name) when together they need more than
    `devices` devices, which a re-plan for that count then drops (`replan_for_devices`); else {}.

    >>> pins_beyond(PlanRequest(global_batch=16, pipeline_parallel=2), 1)
    {'pipeline_parallel': 2}
    >>> pins_beyond(PlanRequest(global_batch=16, pipeline_parallel=2), 3)
    {}
    """
    pinned = {name: getattr(request, name) for name in PINNED_DEGREES if getattr(request, name)}
    return pinned if math.prod(pinned.values()) > devices else {}


def with_entry(plan: Plan, entry: MorphEntry) -> list[MorphEntry]:
    """The morph table to keep with a re-planned `entry`: the plan's with `entry` added (or replacing
    the one for its count), sorted by count; only `entry` when its re-plan dropped the plan's pins.

    Every other entry was planned under those pins, which the resized plan's request no longer
    holds: kept, a later resize would take a pinned layout slower than one on fewer devices (a p = 2
    entry for 2 devices after a move to 1 device without the pin). Left out, those counts are
    re-planned from the request without the pins, as `entry` was.
    """
    if pins_beyond(plan.request, entry.devices):
        return [entry]
    others = [e for e in plan.morph_table if e.devices != entry.devices]
    return sorted([*others, entry], key=lambda e: e.devices)
