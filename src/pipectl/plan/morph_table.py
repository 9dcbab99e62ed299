"""The morph table: the fastest candidate for every device count, computed ahead (docs/design.md, 'Search and the morph table').

A resize is then a look-up (Varuna's job morphing). The table covers the counts a job on the
cluster is given (`table_counts`): every count up to one node's devices, whole nodes beyond, the
counts the request names, or every count on request; a resize to another count re-plans. Entry c
holds the fastest spec using at most c devices; when it uses fewer than c (nothing on exactly c
devices fits in memory, or a smaller configuration is simply faster), the entry's note says so.
The global batch is the same in every entry: m grows as devices shrink, and where d does not
divide B/b the replicas take uneven shares (`pipectl.artifacts.plan.balanced_shares`), so no
count is skipped for the batch's sake.

The table ranks by step time whatever the plan's objective: after a resize the job should run as
fast as the devices it has allow (the cost objective would otherwise leave devices idle).

It reuses the search's specs, cuts and simulations, and visits specs in the order of their lower
bound: a spec is simulated only if no spec with as many devices or fewer is already known to be
at least as fast as its bound, i.e. only if it could still improve some entry. A Fenwick tree
over the table's counts answers "fastest known up to the count serving n devices" in O(log n).
Specs that pass that check are checked once more against the evaluator's tighter bound (`pipectl.plan.fast.bounds`: 1F1B's in-flight
loops, Varuna's warm-up and cool-down) before they are simulated; skipping a spec that cannot
improve any entry leaves the table unchanged. At GPT-1T scale on 3,072 GPUs (benchmarks/plan_scale.py)
the Varuna bound spares a quarter of the Varuna simulations, the dearest kind to simulate; every
1F1B spec simulated improves an entry.

With several workers (`pipectl.plan.workers`) the specs are first timed in two processes
(`_time_ahead`), each running the same loop over one range of device counts: specs on at most n
devices are pruned only by specs on at most n devices, so the lower range visits exactly what the
whole loop visits there, and the upper one, missing the lower range's times, visits a superset
of what the whole loop visits there (its fastest known is never below the whole loop's). The
whole loop then runs here on the evaluator's cache, finding the times it asks for already known
(one it did not find, it would time itself): the table is the one loop's, whatever the number of
processes. The search as a whole simulates 197 specs at GPT-1T scale with one process or two,
and 370 against 368 for GPT-3 175B on 3,072 GPUs (benchmarks/plan_scale.py).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

import numpy as np

from pipectl.artifacts.plan import Candidate, MorphEntry, PlanRequest
from pipectl.plan.candidates import Spec, tied
from pipectl.plan.evaluate import Evaluator
from pipectl.plan.spec_pool import SpecPool
from pipectl.plan.workers import available_workers, share
from pipectl.words import count as count_words


class PrefixMinimum:
    """Fenwick tree over positions 1..size: lower a value, query the minimum of 1..n.

    >>> tree = PrefixMinimum(8)
    >>> tree.lower(5, 2.0); tree.lower(3, 4.0)
    >>> tree.minimum(4), tree.minimum(6), tree.minimum(2)
    (4.0, 2.0, inf)
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.tree = [float("inf")] * (size + 1)

    def lower(self, position: int, value: float) -> None:
        while position <= self.size:
            if value < self.tree[position]:
                self.tree[position] = value
            position += position & -position

    def minimum(self, position: int) -> float:
        best = float("inf")
        position = min(position, self.size)
        while position > 0:
            if self.tree[position] < best:
                best = self.tree[position]
            position -= position & -position
        return best




def table_counts(request: PlanRequest, devices_per_node: int, max_devices: int) -> list[int]:
    """The device counts the morph table covers, ascending: every count up to one node's devices
    and whole nodes beyond (what a job on that cluster is given), plus the counts the request
    names; every count with `morph_every_count`."""
    if request.morph_every_count:
        return list(range(1, max_devices + 1))
    per_node = max(devices_per_node, 1)
    counts = set(range(1, min(per_node, max_devices) + 1)) | set(range(per_node, max_devices + 1, per_node))
    counts |= {n for n in request.morph_counts if n <= max_devices}
    return sorted(counts)


def fastest_per_device_count(specs: Sequence[Spec], evaluator: Evaluator, counts: list[int], *,
                             workers: int = 1) -> dict[int, tuple[float, Spec]]:
    """For each table count c (`counts`, ascending): the fastest spec on more devices than the
    count before c and at most c, if it can matter.

    Only counts whose fastest spec beats every spec on fewer devices are guaranteed present; the
    others may be missing (they never improve an entry). The answer does not depend on `workers`.
    """
    if not counts:
        return {}
    pool = SpecPool.of(specs)
    if workers > 1:
        _time_ahead(pool, evaluator, counts)
    known = PrefixMinimum(len(counts))
    lowest = np.full(len(counts), np.inf)  # per count, the fastest step found on exactly its devices
    best: dict[int, tuple[float, Spec]] = {}
    bounds, devices = pool.bounds, pool.devices
    # By bound, then devices (a stable sort: ties keep the specs' order); beyond the last count none serves.
    order = np.lexsort((devices, bounds))
    order = order[devices[order] <= counts[-1]]
    positions = np.searchsorted(np.asarray(counts), devices, side="left")  # the first count each serves, 0-based
    for start in range(0, len(order), _CHUNK):
        chunk = order[start:start + _CHUNK]
        # The fastest known up to each count only falls as the loop goes: a spec whose bound is
        # not below it now is skipped below too, so it is left out here at once.
        chunk = chunk[bounds[chunk] < np.minimum.accumulate(lowest)[positions[chunk]]].tolist()
        for index in chunk:
            spec, position = pool[index], int(positions[index]) + 1  # 1-based
            fastest_known = known.minimum(position)
            if fastest_known <= spec.lower_bound_seconds:
                continue
            if fastest_known <= evaluator.tighter_bound_seconds(spec):
                continue  # cannot beat it either: see `pipectl.plan.fast.bounds`
            step = evaluator.step_seconds(spec)
            count = counts[position - 1]
            held = best.get(count)
            # A tie keeps the preferred (`Spec.preference`: fewer devices first, a smaller job, as the table's).
            if held is None or tied(step) < tied(held[0]) or (
                tied(step) == tied(held[0]) and spec.preference < held[1].preference
            ):
                best[count] = (step, spec)
                known.lower(position, step)
                lowest[position - 1] = min(lowest[position - 1], step)
    return best


# Specs filtered at once against the fastest steps known (`fastest_per_device_count`): large enough
# that numpy's per-call cost is small beside the loop, small enough that the figures stay fresh.
_CHUNK = 4096


# Below this many specs the table is timed in one process: a fork would cost more than it saves.
PARALLEL_SPECS = 2000
# A spec whose bound is this close (relative) to the least bound on as many devices or fewer is
# likely to be bounded more tightly or timed (`_split_count`).
LIKELY_TIMED = 0.03


def _time_ahead(specs: SpecPool, evaluator: Evaluator, counts: list[int]) -> None:
    """Time in two processes what `fastest_per_device_count` will ask for (module docstring)."""
    pool = specs.take(specs.devices <= counts[-1])
    if len(pool) < PARALLEL_SPECS:
        return
    split = counts[bisect_left(counts, _split_count(pool))]  # at a table count: the parts share no entry
    parts = [pool.take(pool.devices <= split), pool.take(pool.devices > split)]
    if not all(len(part) for part in parts):
        return

    def here(part: SpecPool) -> bool:
        fastest_per_device_count(part, evaluator, counts)
        return True

    def elsewhere(part: SpecPool) -> tuple:
        simulations, actions = evaluator.simulations, evaluator.simulated_actions
        fastest_per_device_count(part, evaluator, counts)
        return evaluator.timings(), evaluator.simulations - simulations, evaluator.simulated_actions - actions

    for outcome in share(parts, [1.0, 1.0], here, elsewhere, workers=2):
        if outcome.remote is not None:
            evaluator.adopt(*outcome.remote)


def _split_count(pool: SpecPool) -> int:
    """A device count that about halves the timing work ahead: the specs likely to be evaluated
    (bound within `LIKELY_TIMED` of the least bound on as many devices or fewer), counted. Each
    costs about the same: most are checked against the evaluator's tighter bound and dropped, and
    the fast paths time the rest in about as long whatever p (GPT-3 175B on 3,072 GPUs,
    benchmarks/plan_scale.py: a split by p² left one process twice the other's work)."""
    counts, at = np.unique(pool.devices, return_inverse=True)
    least = np.full(len(counts), np.inf)
    np.minimum.at(least, at, pool.bounds)
    least = np.minimum.accumulate(least)  # the least bound on as many devices or fewer
    likely = np.sort(pool.devices[pool.bounds <= least[at] * (1 + LIKELY_TIMED)])
    if not len(likely):
        return int(pool.devices.max())
    return int(likely[(len(likely) - 1) // 2])  # the count at which half of them are on as many devices or fewer


def morph_table(
    specs: Sequence[Spec], evaluator: Evaluator, max_devices: int, request: PlanRequest, devices_per_node: int,
    chosen: tuple[float, Spec] | None = None,
) -> list[MorphEntry]:
    """One entry per table count (`table_counts`) from the smallest that fits up to `max_devices`;
    where the plan's `chosen` (step, spec) ties the fastest found on as many devices, the table
    names it: a search that prunes by bounds may leave a tie untimed, and one device count must
    not get two answers (the plan's layout, and a resize's to that count)."""
    pool = SpecPool.of(specs)
    pool = pool.take(pool.runs_on(request.target_engine))
    counts = table_counts(request, devices_per_node, max_devices)
    best = fastest_per_device_count(pool, evaluator, counts, workers=request.workers or available_workers())
    if not best:
        return []
    if chosen is not None and chosen[1].devices <= counts[-1]:
        count = counts[int(np.searchsorted(counts, chosen[1].devices))]
        held = best.get(count)
        if held is not None and held[1].devices == chosen[1].devices and tied(chosen[0]) <= tied(held[0]):
            best[count] = chosen
    exact_counts = set(pool.devices.tolist())
    entries: list[MorphEntry] = []
    candidates: dict[tuple, Candidate] = {}
    first = min(best)
    running = best[first]  # the fastest plan on at most `count` devices so far
    for count in counts[counts.index(first):]:
        # More devices only when faster beyond rounding: the step times come from different
        # evaluation orders (waves, skipped cycles), and a tie must keep the smaller job.
        if count in best and tied(best[count][0]) < tied(running[0]):
            running = best[count]
        spec = running[1]
        if spec.key not in candidates:
            candidates[spec.key] = evaluator.candidate(spec)
        note = ""
        if spec.devices < count:
            if count in exact_counts:
                every = "both" if count == 2 else f"all {count}"
                note = f"uses {spec.devices} of {count} devices: faster than any configuration of {every}"
                runtime = evaluator.hardware.runtime  # CPU ranks: more of them than cores share the cores
                if runtime is not None and count > runtime.host_cores:
                    note += f" ({count} ranks would share this host's {count_words(runtime.host_cores, 'core')})"
            elif count % (product := _pinned_product(request)):
                note = f"uses {spec.devices} of {count} devices: {count} is not a multiple of {product} (pinned {_pins(request)})"
            else:
                why = (f"gives each replica samples of the global batch {evaluator.global_batch} and fits in memory"
                       if request.uneven_replicas
                       else f"divides the global batch {evaluator.global_batch} and fits in memory")
                note = f"uses {spec.devices} of {count} devices: no configuration of exactly {count} devices{_pinned(request)} {why}"
        entries.append(MorphEntry(devices=count, candidate=candidates[spec.key], note=note))
    return entries


def _pinned_product(request: PlanRequest) -> int:
    """What every device count must be a multiple of under the request's pinned t, p and d."""
    return (request.tensor_parallel or 1) * (request.pipeline_parallel or 1) * (request.data_parallel or 1)


def _pinned(request: PlanRequest) -> str:
    """' with p = 2 pinned': the degrees the request fixed, which may be what rules a count out.

    >>> _pinned(PlanRequest(global_batch=16, pipeline_parallel=2))
    ' with p = 2 pinned'
    """
    pins = _pins(request)
    return f" with {pins} pinned" if pins else ""


def _pins(request: PlanRequest) -> str:
    """'t = 2, p = 2': the degrees the request fixed ('' for none)."""
    letters = (("tensor_parallel", "t"), ("pipeline_parallel", "p"), ("data_parallel", "d"), ("micro_batch_size", "b"))
    return ", ".join(f"{letter} = {getattr(request, name)}" for name, letter in letters if getattr(request, name) is not None)
