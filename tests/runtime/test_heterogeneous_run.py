"""A heterogeneous split run for real: two device kinds emulated on this CPU (`local-mixed`).

One rank runs as it is, the other as a kind twice as slow (`NodeType.compute_slowdown`: its engine
waits out each forward and backward once more). B = 16 split by speed — 11 micro-batches of one
sample on the fast kind, 5 on the slow one — gives the one-rank run's loss at
every step (each replica's gradient weighted by its samples), and the slow rank's heartbeats show
the emulation: twice the compute per sample, recorded under its own kind. A resize to one rank
(the fast kind) then continues the same losses. Real ranks through the
run-directory contract, as in `tests/resize/test_resize_uneven.py`, with the same warm-up and
tolerance. How much faster the split is than the fast kind alone is measured by
`benchmarks/hetero_split.py`, not here.
"""

from __future__ import annotations

import shutil

import pytest

from pipectl.artifacts.plan import MorphEntry
from pipectl.resize.restart import resize_run
from pipectl.rundir.metrics import read_metrics
from builders import gpt_tiny_candidate, mixed_candidate, plan_of, train_run

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 16
STEPS, RESIZED_STEPS = 10, 14
RUN_TIMEOUT_SECONDS = 150
RELATIVE_TOLERANCE = 1e-4
WARMUP_STEPS = 15


def test_a_split_over_emulated_kinds_gives_the_one_rank_losses_and_runs_slow_where_planned(tmp_path):
    one_rank = gpt_tiny_candidate(1, 1, b=1, global_batch=GLOBAL_BATCH)
    one = train_run(plan_of(one_rank), tmp_path / "one-rank",
                    RESIZED_STEPS, warmup_steps=WARMUP_STEPS, timeout_seconds=RUN_TIMEOUT_SECONDS)
    split = plan_of(mixed_candidate(), cluster="local-mixed", morph_table=[MorphEntry(devices=1, candidate=one_rank)])
    mixed = train_run(split, tmp_path / "mixed",
                      STEPS, warmup_steps=WARMUP_STEPS, timeout_seconds=RUN_TIMEOUT_SECONDS)
    expected = {m.step: m.loss for m in read_metrics(one)}
    metrics = read_metrics(mixed)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))
    assert {m.layout for m in metrics} == {"t1p1d2 1f1b b1 m11+5"}
    for m in metrics:
        assert m.loss == pytest.approx(expected[m.step], rel=RELATIVE_TOLERANCE), m.step

    per_sample = {}
    for m in metrics:
        for r in m.ranks:
            assert (r.device, r.samples) == (("cpu", 11) if r.rank == 0 else ("cpu-slowed-2x", 5))
            per_sample.setdefault(r.device, []).append((r.forward_seconds + r.backward_seconds) / r.samples)
    # 2 by construction; without the emulation about 1. Other jobs on the machine only add time,
    # and they slow the fast rank's compute more than the slow rank's waits, so each rank's least
    # disturbed step is compared. Under a full CI run's load (two tests training at once on two
    # cores) those came out at 1.28 once; 1.2 still tells the emulation from its absence, and
    # tests/runtime/test_executor.py holds the wait itself without timing two processes.
    ratio = min(per_sample["cpu-slowed-2x"]) / min(per_sample["cpu"])
    assert ratio >= 1.2, ratio

    resized = tmp_path / "resized"
    shutil.copytree(mixed, resized)
    result = resize_run(resized, 1, steps=RESIZED_STEPS, run_timeout_seconds=RUN_TIMEOUT_SECONDS)
    assert result.exit_code == 0, (resized / "logs" / "engine.log").read_text()[-3000:]
    after = [m for m in read_metrics(resized) if m.step > STEPS]
    assert [m.step for m in after] == list(range(STEPS + 1, RESIZED_STEPS + 1))
    for m in after:
        assert m.loss == pytest.approx(expected[m.step], rel=RELATIVE_TOLERANCE), m.step
        assert [(r.device, r.samples) for r in m.ranks] == [("cpu", GLOBAL_BATCH)]
