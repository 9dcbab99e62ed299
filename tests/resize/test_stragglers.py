"""Straggler detection: robust against one slow step, flags a persistently slow rank among its peers."""

from __future__ import annotations

import random

import pytest

from pipectl.artifacts.run import RankTiming, StepMetrics
from pipectl.errors import UserInputError
from pipectl.rundir.stragglers import StragglerPolicy, find_stragglers, recent_window


def step(number, compute_by_rank, stages, *, layout="t1p2d2 1f1b b2 m2", world=None, samples=None):
    """A metrics line whose rank r spends compute_by_rank[r] seconds (1/3 forward, 2/3 backward) on
    samples[r] samples (None: not recorded)."""
    ranks = [
        RankTiming(rank=r, stage=stages[r], forward_seconds=c / 3, backward_seconds=2 * c / 3,
                   samples=samples[r] if samples else None)
        for r, c in enumerate(compute_by_rank)
    ]
    return StepMetrics(
        step=number, loss=1.0, step_seconds=max(compute_by_rank), samples_per_second=1.0,
        global_batch=8, world_size=world or len(compute_by_rank), layout=layout, ranks=ranks,
    )  # fmt: skip


def noisy_steps(count, base, stages, slow=None, factor=1.0, seed=0, noise=0.05, start=1):
    rng = random.Random(seed)
    rows = []
    for s in range(start, start + count):
        compute = [base * (1 + rng.uniform(-noise, noise)) for _ in stages]
        if slow is not None:
            compute[slow] *= factor
        rows.append(step(s, compute, stages))
    return rows


P2D2 = [0, 1, 0, 1]  # rank -> stage for p=2, d=2 (DeepSpeed's pipe-major topology)
P1D4 = [0, 0, 0, 0]


def test_a_persistently_slow_replica_is_flagged():
    report = find_stragglers(noisy_steps(10, 0.1, P2D2, slow=2, factor=2.0))
    assert report.straggler_ranks == [2]
    assert report.scores[2].median_slowdown == pytest.approx(2.0, rel=0.15)
    assert report.scores[2].peers == 1 and report.scores[2].median_z is None
    assert "rank 2 (stage 0)" in report.describe()[0]


def test_uneven_replicas_are_compared_per_sample():
    # d = 3 at B = 16: 6, 5 and 5 samples; the first replica's longer step is its larger share.
    shares = [6, 5, 5]
    rows = [step(s, [0.06 * n for n in shares], P1D4[:3], samples=shares) for s in range(1, 11)]
    assert find_stragglers(rows).straggler_ranks == []
    slow = [step(s, [0.06 * n * (2 if r == 1 else 1) for r, n in enumerate(shares)], P1D4[:3], samples=shares)
            for s in range(1, 11)]
    report = find_stragglers(slow)
    assert report.straggler_ranks == [1]
    assert report.scores[1].median_slowdown == pytest.approx(2.0)
    assert report.scores[0].median_compute_seconds == pytest.approx(0.36)  # the step's own seconds


def test_replicas_on_another_device_kind_are_not_peers():
    # A heterogeneous split: rank 1's replica runs on a kind twice as slow, by plan.
    rows = []
    for s in range(1, 11):
        row = step(s, [0.06 * 11, 0.12 * 5], P1D4[:2], samples=[11, 5])
        ranks = [r.model_copy(update={"device": kind}) for r, kind in zip(row.ranks, ["cpu", "cpu-slowed-2x"])]
        rows.append(row.model_copy(update={"ranks": ranks}))
    report = find_stragglers(rows)
    assert report.straggler_ranks == [] and [s.peers for s in report.scores.values()] == [0, 0]
    assert report.reason == "no data-parallel peers of the same kind to compare"


def test_noise_alone_flags_nobody():
    for seed in range(5):
        report = find_stragglers(noisy_steps(10, 0.1, P1D4, seed=seed, noise=0.2))
        assert report.straggler_ranks == [], seed


def test_one_slow_step_is_not_a_straggler():
    rows = noisy_steps(10, 0.1, P1D4)
    spiked = [r.forward_seconds * 20 if r.rank == 1 else r.forward_seconds for r in rows[4].ranks]
    rows[4] = step(5, [f * 3 for f in spiked], P1D4)
    report = find_stragglers(rows)
    assert report.straggler_ranks == []
    assert report.scores[1].median_slowdown < 1.2


def test_groups_of_three_or_more_use_the_modified_z_score_too():
    slow = noisy_steps(10, 0.1, P1D4, slow=3, factor=1.6)
    report = find_stragglers(slow)
    assert report.straggler_ranks == [3]
    assert report.scores[3].median_z is not None and report.scores[3].median_z > 3.5
    # A slowdown over the ratio threshold but inside very wide scatter is not flagged by the z rule.
    strict = StragglerPolicy(slowdown_threshold=1.5, z_threshold=1e6)
    assert find_stragglers(slow, strict).straggler_ranks == []


def test_threshold_is_configurable():
    rows = noisy_steps(10, 0.1, P2D2, slow=1, factor=1.3, noise=0.01)
    assert find_stragglers(rows).straggler_ranks == []
    assert find_stragglers(rows, StragglerPolicy(slowdown_threshold=1.2)).straggler_ranks == [1]


def test_only_peers_of_the_same_stage_are_compared():
    # Stage 1 is twice as slow as stage 0 for every replica: an unbalanced cut, not a straggler.
    rows = [step(s, [0.1, 0.2, 0.1, 0.2], P2D2) for s in range(1, 9)]
    report = find_stragglers(rows)
    assert report.straggler_ranks == []
    assert all(score.median_slowdown == pytest.approx(1.0) for score in report.scores.values())


def test_without_data_parallel_peers_nothing_can_be_judged():
    rows = [step(s, [0.1, 0.5], [0, 1], layout="t1p2d1 1f1b b2 m4") for s in range(1, 9)]
    report = find_stragglers(rows)
    assert report.straggler_ranks == []
    assert "no data-parallel peers" in report.reason


def test_window_covers_only_the_newest_layout():
    before = noisy_steps(10, 0.1, P2D2, slow=0, factor=3.0)  # rank 0 was slow on the old layout
    after = [step(s, [0.1, 0.1], [0, 0], layout="t1p1d2 1f1b b2 m4") for s in range(11, 16)]
    window = recent_window(before + after, 10)
    assert [m.step for m in window] == list(range(11, 16))
    assert find_stragglers(before + after).straggler_ranks == []
    assert find_stragglers(before).straggler_ranks == [0]


def test_a_layout_moved_away_from_and_back_to_counts_from_its_return():
    """Steps 1-10 on a layout, 11-15 on another, 16-20 on the first again: the window is 16-20 (it
    was titled 'steps 1-20', pooling a placement of the ranks that no longer runs)."""
    first = noisy_steps(10, 0.1, P2D2, slow=0, factor=3.0)  # rank 0 slow there
    other = [step(s, [0.1, 0.1], [0, 0], layout="t1p1d2 1f1b b2 m4") for s in range(11, 16)]
    back = [step(s, [0.1, 0.1, 0.1, 0.1], P2D2) for s in range(16, 21)]
    assert [m.step for m in recent_window(first + other + back, 10)] == list(range(16, 21))
    assert find_stragglers(first + other + back).straggler_ranks == []


def test_too_few_steps_give_no_verdict():
    report = find_stragglers(noisy_steps(2, 0.1, P2D2, slow=1, factor=5.0))
    assert report.straggler_ranks == [] and "2 step(s)" in report.reason
    assert find_stragglers([]).reason.startswith("no per-rank heartbeats")


@pytest.mark.parametrize(
    "kwargs, word",
    [({"slowdown_threshold": 1.0}, "slowdown"), ({"window_steps": 0}, "window"), ({"z_threshold": 0}, "z-score")],
)
def test_bad_policy_values_are_named(kwargs, word):
    with pytest.raises(UserInputError, match=word):
        StragglerPolicy(**kwargs)
