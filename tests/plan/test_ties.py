"""Layouts of equal step: one rule picks among them, in the ranking and in the morph table alike.

A stage-recomputing 1F1B ties the plain one whenever the last stage (never recomputed) sets the
step; the plan chose one and its morph table, for the same device count, the other (a resize to
that count then changed the layout, and an export refused the recomputing one)."""

from __future__ import annotations

import pytest

from pipectl.artifacts.plan import PlanRequest
from pipectl.cluster import load_cluster, local_cluster
from pipectl.plan.search import plan
from pipectl.testing.profiles import synthetic_profile


def _layout(candidate) -> tuple:
    return (candidate.schedule, candidate.recompute, candidate.checkpoint_layers, candidate.micro_batch_size,
            candidate.chunks, candidate.zero_stage, tuple(map(tuple, candidate.stage_layers)))


@pytest.mark.parametrize("top", [1, None])  # the kept few (pruned by bounds) or every candidate
@pytest.mark.parametrize("blocks, vocab, recomputing_ties", [
    (2, 200_000, True),  # a large head on the last stage sets the step: recomputing the first costs nothing
    (4, 256, True),  # GPipe a last bit faster than 1F1B (the same step summed in another order): the plan chose
    # GPipe, its table 1F1B
])
def test_a_tie_goes_to_no_recomputation_then_less_memory_in_the_plan_and_its_morph_table(blocks, vocab, recomputing_ties,
                                                                                        top):
    profile = synthetic_profile(blocks=blocks, micro_batch_sizes=[8], device="cpu", vocab=vocab)
    request = PlanRequest(global_batch=16, devices=2, pipeline_parallel=2, workers=1,
                          **({"top": top} if top else {"include_all": True}))
    made = plan(profile, local_cluster(2, load_cluster("local")), request)
    if top:  # which layout won is the same with one kept as with all (`--top 1` chose GPipe, `--all` 1F1B)
        every = plan(profile, local_cluster(2, load_cluster("local")), request.model_copy(update={"include_all": True}))
        assert _layout(made.chosen) == _layout(every.chosen)
        return
    best = made.chosen.predicted_step_seconds
    tied = [c for c in made.candidates if abs(c.predicted_step_seconds - best) <= 1e-12 * best]  # as the table ties
    assert len(tied) > 1 and any(c.recompute for c in tied) is recomputing_ties, [_layout(c) for c in tied]
    assert not made.chosen.recompute
    assert max(made.chosen.peak_memory_bytes) == min(max(c.peak_memory_bytes) for c in tied if not c.recompute)
    (row,) = [entry for entry in made.morph_table if entry.devices == 2]
    assert _layout(row.candidate) == _layout(made.chosen)
