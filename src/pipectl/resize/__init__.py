"""Job morphing (Varuna; docs/design.md, 'Resize and recovery'): move a run to another device count with the same global batch.

- `restart`: `resize_run` (stop at a step boundary, morph-table look-up, rewrite the run, relaunch);
- `live`: the live resize (the ranks hand their state over in memory at a step boundary);
- `choose`: the layout for N devices (morph table, re-plan only when the table lacks N);
- `stop`: find a run's live processes, stop them at a step boundary;
- `replicas`: the replicas agent (one torchrun per replica; the survivors' layout after a loss).

Stragglers (fail-stutter ranks from the per-rank heartbeats) are `rundir.stragglers`.

A run's morph history (RUN/morphs.jsonl) is `rundir.morph_history`: the worker records elastic restarts
there too. Elastic restarts take their layout from the same morph table (`runtime.elastic`).
"""

from pipectl.resize.restart import resize_run
from pipectl.rundir.stragglers import StragglerPolicy, find_stragglers

__all__ = ["StragglerPolicy", "find_stragglers", "resize_run"]
