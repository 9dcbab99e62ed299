"""The morph table: the fastest candidate for every device count, computed ahead (SPEC §5, §7).

A resize is then a look-up (Varuna's job morphing). Entry c holds the fastest spec using at most c
devices; when it uses fewer than c (no (d, b) divides B at c with memory to spare, or a smaller
configuration is simply faster), the entry's note says so. The global batch is the same in every
entry: m grows as devices shrink.

The table ranks by step time whatever the plan's objective: after a resize the job should run as
fast as the devices it has allow (the cost objective would otherwise leave devices idle).

It reuses the search's specs, cuts and simulations, and visits specs in the order of their lower
bound: a spec is simulated only if no spec with as many devices or fewer is already known to be
at least as fast as its bound, i.e. only if it could still improve some entry. A Fenwick tree
answers "fastest known with at most n devices" in O(log n). Specs that pass that check are
checked once more against the evaluator's tighter bound (`pipectl.plan.fast.bounds`: 1F1B's in-flight
loops, Varuna's warm-up and cool-down) before they are simulated; skipping a spec that cannot
improve any entry leaves the table unchanged. At GPT-1T scale on 3,072 GPUs (benchmarks/plan_scale.py)
the Varuna bound spares 17 of the 60 Varuna simulations, the dearest kind here (~10 ms each against
~2 ms for 1F1B); every 1F1B spec simulated improves an entry.
"""

from __future__ import annotations

from pipectl.artifacts.plan import Candidate, MorphEntry, PlanRequest
from pipectl.plan.candidates import Spec
from pipectl.plan.evaluate import Evaluator


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


_TIE = 1e-12  # relative: step times closer than this are equal


def fastest_per_device_count(specs: list[Spec], evaluator: Evaluator, max_devices: int) -> dict[int, tuple[float, Spec]]:
    """For each device count n that some spec uses exactly: its fastest spec, if it can matter.

    Only counts whose fastest spec beats every spec with fewer devices are guaranteed present; the
    others may be missing (they never improve an entry).
    """
    known = PrefixMinimum(max_devices)
    best: dict[int, tuple[float, Spec]] = {}
    for spec in sorted(specs, key=lambda s: (s.lower_bound_seconds, s.devices)):
        n = spec.devices
        if n > max_devices:
            continue
        fastest_known = known.minimum(n)
        if fastest_known <= spec.lower_bound_seconds:
            continue
        if fastest_known <= evaluator.tighter_bound_seconds(spec):
            continue  # cannot beat it either: see `pipectl.plan.fast.bounds`
        step = evaluator.step_seconds(spec)
        if n not in best or step < best[n][0] * (1 - _TIE):  # a tie keeps the first found
            best[n] = (step, spec)
            known.lower(n, step)
    return best


def morph_table(specs: list[Spec], evaluator: Evaluator, max_devices: int, request: PlanRequest) -> list[MorphEntry]:
    """One entry per device count from the smallest that fits up to `max_devices`."""
    pool = [s for s in specs if not request.for_deepspeed or s.deepspeed_runnable]
    best = fastest_per_device_count(pool, evaluator, max_devices)
    if not best:
        return []
    exact_counts = {spec.devices for spec in pool}
    entries: list[MorphEntry] = []
    candidates: dict[tuple, Candidate] = {}
    first = min(best)
    running = best[first]  # the fastest plan on at most `count` devices so far
    for count in range(first, max_devices + 1):
        # More devices only when faster beyond rounding: the step times come from different
        # evaluation orders (waves, skipped cycles), and a tie must keep the smaller job.
        if count in best and best[count][0] < running[0] * (1 - _TIE):
            running = best[count]
        spec = running[1]
        if spec.key not in candidates:
            candidates[spec.key] = evaluator.candidate(spec)
        note = ""
        if spec.devices < count:
            if count in exact_counts:
                note = f"uses {spec.devices} of {count} devices: faster than any configuration of all {count}"
            else:
                note = (
                    f"uses {spec.devices} of {count} devices: no configuration of exactly {count} "
                    f"devices divides the global batch {evaluator.global_batch} and fits in memory"
                )
        entries.append(MorphEntry(devices=count, candidate=candidates[spec.key], note=note))
    return entries
