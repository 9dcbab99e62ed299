"""Job morphing (SPEC §7): move a run to another device count with the same global batch.

- `morph`: `resize_run` (stop at a step boundary, morph-table look-up, rewrite the run, relaunch);
  `plan_for_world_size` / `ds_config_for_candidate` for elastic restarts;
- `choose`: the layout for N devices (morph table, re-plan only when the table lacks N);
- `stop`: find a run's live processes, stop them at a step boundary;
- `stragglers`: fail-stutter ranks from the per-rank heartbeats (pure);
- `history`: RUN/morphs.jsonl, with the downtime of each morph.
"""

from pipectl.resize.history import read_history
from pipectl.resize.morph import plan_for_world_size, resize_run
from pipectl.resize.stragglers import StragglerPolicy, find_stragglers

__all__ = ["StragglerPolicy", "find_stragglers", "plan_for_world_size", "read_history", "resize_run"]
