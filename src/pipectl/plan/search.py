"""The planner's entry: every (t, p, d, b, v, schedule, recompute, ZeRO) that keeps B exactly.

    plan(profile, cluster, PlanRequest(global_batch=B)) -> Plan

A cluster of one device kind is searched by `pipectl.plan.homogeneous` (enumeration in
`pipectl.plan.space`, timing in `pipectl.plan.timing`, the morph table in `pipectl.plan.morph_table`);
one of several kinds by `pipectl.plan.hetero`, which searches each kind alone and then tries an
uneven split of the batch over all of them.

    >>> from pipectl.testing.profiles import synthetic_profile
    >>> from pipectl.cluster import load_cluster
    >>> result = plan(synthetic_profile(blocks=8), load_cluster("a100-8x8"), PlanRequest(global_batch=64, devices=8))
    >>> result.chosen.global_batch, result.chosen.devices <= 8
    (64, True)
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from contextlib import contextmanager

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.plan import Plan, PlanRequest
from pipectl.artifacts.profile import ModelProfile
from pipectl.plan.costs import hardware_for, profile_for
from pipectl.plan.hetero import plan_heterogeneous
from pipectl.plan.homogeneous import SearchStats, plan_homogeneous


def plan(
    profile: ModelProfile,
    cluster: ClusterSpec,
    request: PlanRequest,
    *,
    kind_profiles: Sequence[ModelProfile] = (),
    stats: SearchStats | None = None,
) -> Plan:
    """The ranked candidates, the chosen one and the morph table (see the module docstring).

    `kind_profiles`: profiles of the same model made on the cluster's other device kinds; each
    kind is priced with the profile made on it, else with `profile` scaled by peak FLOP/s.
    """
    with cyclic_gc_paused():
        if cluster.heterogeneous:
            return plan_heterogeneous(profile, cluster, request, kind_profiles=kind_profiles, stats=stats)
        profile = profile_for(cluster.node_types[0].device, profile, kind_profiles)
        hardware = hardware_for(cluster, profile, memory_headroom=request.memory_headroom)
        return plan_homogeneous(profile, cluster.name, hardware, request, stats=stats)


@contextmanager
def cyclic_gc_paused():
    """Python's cycle collector off for the search, back as it was afterwards.

    A large search allocates ~10^6 small objects (tuples, shapes, specs) and keeps most of them
    to the end, so each automatic collection rescans a heap that only grows, a large share of
    the search's time for nothing: it builds no reference cycles worth collecting meanwhile
    (reference counting frees the rest). The collector resumes as soon as it returns.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
