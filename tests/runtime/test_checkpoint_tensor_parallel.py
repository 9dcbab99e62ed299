"""Checkpoints re-cut across tensor-parallel degrees.

Without processes: every slice of a split transformer block records its `TensorSplit`; joining
the slices of t=2 or t=4 gives the t=1 block's tensors, and cutting those gives exactly what a
block built at t holds.

With real ranks: a checkpoint written at t=2 resumes at t=1 and at t=2 x p=2, and one written at
t=1 resumes at t=2, with the losses of the uninterrupted run (1e-4 relative, fp32) and the same
weights and Adam moments at the end.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pipectl.models.tensor_parallel import TensorParallelBlock, TensorParallelGroup
from pipectl.models.transformer import TransformerBlock
from pipectl.rundir import checkpoints as ckpt
from pipectl.runtime.checkpoint.shards import whole_state
from pipectl.artifacts.layout import Layout
from pipectl.runtime.job import TrainingJob
from pipectl.runtime.worker import spawn_ranks
from builders import plan_of, training_config

HIDDEN, HEADS = 64, 4
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def block_at(tensor_parallel: int, rank: int) -> torch.nn.Module:
    """Layer 3 of a model, as rank `rank` of `tensor_parallel` holds it (same seed at every t)."""
    torch.manual_seed(7)
    if tensor_parallel == 1:
        return TransformerBlock(HIDDEN, HEADS)
    group = TensorParallelGroup(group=None, rank=rank, size=tensor_parallel)
    return TensorParallelBlock(HIDDEN, HEADS, tensor_group=group)


@pytest.mark.parametrize("tensor_parallel", [2, 4])
def test_recorded_splits_join_slices_whole_and_cut_any_degree_from_them(tensor_parallel):
    whole = dict(block_at(1, 0).named_parameters())
    ranks = [dict(block_at(tensor_parallel, r).named_parameters()) for r in range(tensor_parallel)]
    assert set(ranks[0]) == set(whole)  # the same names at every t
    split_names = set()
    for name, parameter in ranks[0].items():
        split = getattr(parameter, "tensor_parallel_split", None)
        if split is None:  # replicated: every rank holds the whole tensor
            assert all(torch.equal(r[name], whole[name]) for r in ranks), name
            continue
        split_names.add(name)
        assert torch.equal(split.join([r[name].detach() for r in ranks]), whole[name]), name
        for rank in range(tensor_parallel):
            assert torch.equal(split.cut(whole[name].detach(), tensor_parallel, rank), ranks[rank][name]), name
    assert split_names == {"qkv.weight", "qkv.bias", "proj.weight", "fc_in.weight", "fc_in.bias", "fc_out.weight"}


# --------------------------------------------------------------------------- real processes

STEPS, SAVED_STEP = 6, 3
T1 = Layout(1, 1, 2, 4, ((0, 9),))
T2 = Layout(1, 1, 2, 4, ((0, 9),), tensor_parallel=2)
T2_P2 = Layout(2, 1, 2, 4, ((0, 5), (5, 9)), tensor_parallel=2)


def run(layout: Layout, run_dir: Path, checkpoint_every: int = 0) -> list[float]:
    config = training_config(layout)
    job = TrainingJob(
        "gpt-tiny", layout, config, steps=STEPS, seed=1, run_dir=run_dir, checkpoint_every=checkpoint_every
    )
    outcomes = spawn_ranks(job, timeout_seconds=120)
    return outcomes[max(outcomes)].losses  # the last rank computes the loss


def resume_from(source: Path, run_dir: Path, tag: str = ckpt.tag_for_step(SAVED_STEP)) -> Path:
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / tag, run_dir / "checkpoints" / tag)
    (run_dir / "checkpoints" / "latest").write_text(tag)
    return run_dir


def final_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / ckpt.tag_for_step(STEPS)


def assert_same_state(final: Path, reference: Path) -> None:
    """Weights and both Adam moments of every parameter, as the uninterrupted run has them."""
    want, got = whole_state(reference, STATES), whole_state(final, STATES)
    assert set(got) == set(want)
    for key, expected in want.items():
        assert got[key].shape == expected.shape, key
        # Summation order differs between t=1 and t=2 (~1e-4 after a few steps); a wrong slice or
        # fresh moments are off by order 1.
        assert (got[key] - expected).norm() <= 1e-3 * expected.norm(), key


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, tuple[Path, list[float]]]:
    """Uninterrupted runs at t=1 and t=2, checkpointing at step 3 and at the end."""
    root = tmp_path_factory.mktemp("tp")
    return {t: (root / f"t{t}", run(layout, root / f"t{t}", SAVED_STEP)) for t, layout in ((1, T1), (2, T2))}


def assert_continues(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == STEPS - SAVED_STEP
    for step, (got, want) in enumerate(zip(losses, reference[SAVED_STEP:], strict=True), start=SAVED_STEP + 1):
        assert abs(got - want) <= 1e-4 * want, f"step {step}: {got} vs {want}"


@pytest.mark.multiprocess
def test_t2_checkpoint_continues_at_t1_and_at_t2_p2(references, tmp_path):
    source, reference = references[2]
    assert reference[-1] < reference[0]
    for layout in (T1, T2_P2):
        run_dir = resume_from(source, tmp_path / layout.label().split()[0])
        assert_continues(run(layout, run_dir), reference)
        assert_same_state(final_checkpoint(run_dir), final_checkpoint(source))


@pytest.mark.multiprocess
def test_t1_checkpoint_continues_at_t2(references, tmp_path):
    source, reference = references[1]
    run_dir = resume_from(source, tmp_path / "t2")
    assert_continues(run(T2, run_dir), reference)
    assert_same_state(final_checkpoint(run_dir), final_checkpoint(source))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resize_moves_a_t2_job_to_one_rank_at_t1(tmp_path):
    """`pipectl resize` end to end (torchrun, run directory, morph table): t=2 on 2 ranks for 4
    steps, then 1 device, where the plan's morph table says t=1; steps 5..8 give the losses of the
    uninterrupted t=2 run."""
    from builders import gpt_tiny_candidate

    from pipectl.artifacts.plan import MorphEntry
    from pipectl.launch import LaunchOptions, prepare_launch, run_engine
    from pipectl.resize.restart import resize_run
    from pipectl.rundir.metrics import read_metrics

    one_rank = gpt_tiny_candidate(1, 1)
    two_tensor_ranks = one_rank.model_copy(update={"devices": 2, "tensor_parallel": 2})
    plan = plan_of(
        two_tensor_ranks,
        morph_table=[MorphEntry(devices=1, candidate=one_rank), MorphEntry(devices=2, candidate=two_tensor_ranks)],
    )

    def launch(run_dir: Path, steps: int) -> Path:
        prepared = prepare_launch(plan, run_dir, LaunchOptions(steps=steps, seed=0))
        assert run_engine(prepared.command, prepared.run_dir, timeout_seconds=150) == 0
        return prepared.run_dir

    reference = {m.step: m.loss for m in read_metrics(launch(tmp_path / "uninterrupted", 8))}
    run = launch(tmp_path / "resized", 4)
    result = resize_run(run, 1, steps=8, run_timeout_seconds=150)
    assert result.exit_code == 0, (run / "logs" / "engine.log").read_text()[-3000:]
    resumed = read_metrics(run)
    expected_layouts = [(step, "t2p1d1" if step <= 4 else "t1p1d1") for step in range(1, 9)]
    assert [(m.step, m.layout.split()[0]) for m in resumed] == expected_layouts
    for metric in resumed[4:]:
        assert abs(metric.loss - reference[metric.step]) <= 1e-4 * reference[metric.step], metric.step
