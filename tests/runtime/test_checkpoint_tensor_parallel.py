"""Checkpoints re-cut across tensor-parallel degrees.

Without processes: the slices of a split transformer block go through DeepSpeed's own universal
merge (`ds_to_universal.merge_tp_slices`) with pipectl's patterns and come back whole, and
DeepSpeed's own load (`load_hp_checkpoint_state`) cuts from the whole tensors exactly the slices a
block built at t=1, 2 or 4 holds -- for the weights and for each Adam moment.

With real ranks: a checkpoint written at t=2 resumes at t=1 and at t=2 x p=2, and one written at
t=1 resumes at t=2, with the losses of the uninterrupted run (1e-4 relative, fp32) and the same
weights and Adam moments at the end; a checkpoint that records no split is refused by name.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipectl.artifacts.run import MANIFEST_FILE
from pipectl.errors import LaunchError, UserInputError
from pipectl.io import write_json_atomic
from pipectl.models.tensor_parallel import (
    TensorParallelBlock,
    TensorParallelGroup,
    qkv_parameter_names,
    regroup_rank_slices,
    universal_checkpoint_patterns,
)
from pipectl.models.transformer import TransformerBlock
from pipectl.runtime import checkpoint as ckpt
from pipectl.artifacts.layout import Layout
from pipectl.runtime.worker import TrainingJob, spawn_ranks
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


def state_of(parameter: torch.Tensor, state: str) -> torch.Tensor:
    """Stand-ins for the Adam moments: element-wise functions of the weight, so they split alike."""
    return {"fp32": parameter, "exp_avg": parameter * 3.0, "exp_avg_sq": parameter.square() + 1.0}[state]


def merge_through_deepspeed(tmp_path: Path, tensor_parallel: int) -> Path:
    """Write each rank's slices the way DeepSpeed's extraction does, then run its merge."""
    from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

    slices, merged = tmp_path / "slices", tmp_path / "universal" / "zero"
    blocks = [block_at(tensor_parallel, rank) for rank in range(tensor_parallel)]
    per_rank = [dict(block.named_parameters()) for block in blocks]
    shapes = {name: [tuple(parameters[name].shape) for parameters in per_rank] for name in per_rank[0]}
    for rank, block in enumerate(blocks):
        for name, parameter in block.named_parameters():
            folder = slices / f"3.{name}" / str(rank)
            folder.mkdir(parents=True)
            for state in STATES:
                torch.save(state_of(parameter.detach(), state).flatten(), folder / f"{state}.00")
    info = universal_checkpoint_patterns([3])
    unused = [
        merge_tp_slices(info, str(merged), str(slices), tensor_parallel, (f"3.{name}", rank_shapes))
        for name, rank_shapes in shapes.items()
    ]
    # DeepSpeed's strict conversion fails on a pattern that matched no parameter at all.
    assert set.intersection(*map(set, unused)) == set()
    rewritten = ckpt.regroup_fused_qkv(merged, qkv_parameter_names([3]), tensor_parallel)
    assert len(rewritten) == 2 * len(STATES)
    return merged


def load_through_deepspeed(
    folder: Path, local: torch.Tensor, rank: int, tensor_parallel: int
) -> dict[str, torch.Tensor]:
    """DeepSpeed's universal load for one parameter of `local`'s shape: what it puts in each state."""
    from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state
    from deepspeed.utils.tensor_fragment import fragment_address

    weights = torch.zeros(local.numel())
    lp = torch.empty_like(local)
    lp._hp_mapping = SimpleNamespace(
        lp_fragment_address=fragment_address(numel=local.numel(), start=0), get_hp_fragment=lambda: weights
    )
    load_hp_checkpoint_state(lp, str(folder), rank, tensor_parallel)
    return {"fp32": weights, **lp._hp_mapping.optim_fragment}


@pytest.mark.parametrize("saved_at", [1, 2, 4])
def test_deepspeed_merges_split_blocks_whole_and_cuts_any_degree_from_them(tmp_path, saved_at):
    merged = merge_through_deepspeed(tmp_path, saved_at)
    whole = dict(block_at(1, 0).named_parameters())
    for name, parameter in whole.items():
        stored = torch.load(merged / f"3.{name}" / "fp32.pt", weights_only=True)["param"]
        assert torch.equal(stored.view(parameter.shape), parameter.detach()), f"merged {name} at t={saved_at}"
    for loaded_at in (1, 2, 4):
        for rank in range(loaded_at):
            for name, local in block_at(loaded_at, rank).named_parameters():
                got = load_through_deepspeed(merged / f"3.{name}", local.detach(), rank, loaded_at)
                for state in STATES:
                    want = state_of(local.detach(), state).flatten()
                    assert torch.equal(got[state], want), f"{name} {state}: t={saved_at} -> t={loaded_at} rank {rank}"


def test_regrouping_puts_each_ranks_heads_back_in_place():
    q, k, v = (torch.arange(8.0).view(4, 2) + offset for offset in (0, 100, 200))  # 4 rows: 4 heads
    for tensor_parallel in (1, 2, 4):
        ranks = [torch.cat([w.chunk(tensor_parallel)[r] for w in (q, k, v)]) for r in range(tensor_parallel)]
        assert torch.equal(regroup_rank_slices(torch.cat(ranks), tensor_parallel), torch.cat([q, k, v]))
    with pytest.raises(UserInputError, match="10 QKV rows do not split into 3 x 2 blocks"):
        regroup_rank_slices(torch.zeros(10), 2)


def test_patterns_split_only_the_block_parameters_that_tensor_parallelism_splits():
    import re

    info = universal_checkpoint_patterns([1, 2, 5])
    (row,) = info["parameter_with_row_parallelism_patterns"]
    (whole,) = info["parameter_to_average_patterns"]
    assert re.match(row, "2.fc_out.weight") and not re.match(row, "3.fc_out.weight")
    for name in ("tied_modules.embed.weight", "1.ln_attn.bias", "1.proj.bias", "7.weight", "3.qkv.weight"):
        assert re.match(whole, name), name
    for name in ("1.qkv.weight", "2.fc_in.bias", "5.proj.weight"):
        assert not re.match(whole, name), name
    assert universal_checkpoint_patterns([]) == {}


# --------------------------------------------------------------------------- real processes

STEPS, SAVED_STEP = 6, 3
T1 = Layout(1, 1, 2, 4, ((0, 9),))
T2 = Layout(1, 1, 2, 4, ((0, 9),), tensor_parallel=2)
T2_P2 = Layout(2, 1, 2, 4, ((0, 5), (5, 9)), tensor_parallel=2)


def run(layout: Layout, run_dir: Path, checkpoint_every: int = 0) -> list[float]:
    config = training_config(layout, universal=True)
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
    for folder in sorted((reference / "zero").iterdir()):
        if not folder.is_dir():
            continue
        for state in STATES:
            want = torch.load(folder / f"{state}.pt", weights_only=True)["param"]
            got = torch.load(final / "zero" / folder.name / f"{state}.pt", weights_only=True)["param"]
            assert got.shape == want.shape, f"{folder.name}/{state}"
            # Summation order differs between t=1 and t=2 (~1e-4 after a few steps); a wrong slice or
            # fresh moments are off by order 1.
            assert (got - want).norm() <= 1e-3 * want.norm(), f"{folder.name}/{state}"


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


@pytest.mark.multiprocess
def test_a_checkpoint_without_split_records_is_refused_by_name(references, tmp_path):
    source, _ = references[1]
    run_dir = resume_from(source, tmp_path / "old")
    stripped = run_dir / "checkpoints" / ckpt.tag_for_step(SAVED_STEP) / "zero" / "1.proj.weight" / "fp32.pt"
    stored = torch.load(stripped, weights_only=True)
    del stored["cat_dim"]  # what a checkpoint written before the split was declared holds
    torch.save(stored, stripped)
    tag_dir = stripped.parents[2]  # re-hash: the checkpoint verifies, only its split record is gone
    manifest = ckpt.verify_checkpoint(tag_dir, hash_files=False).manifest
    files = ckpt.hash_tree(tag_dir)
    sizes = {relative: (tag_dir / relative).stat().st_size for relative in files}
    write_json_atomic(tag_dir / MANIFEST_FILE, manifest.model_copy(update={"files": files, "file_bytes": sizes}))
    with pytest.raises(LaunchError, match=r"1\.proj\.weight.*no record of how .* is split"):
        run(T2, run_dir)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resize_moves_a_t2_job_to_one_rank_at_t1(tmp_path):
    """`pipectl resize` end to end (torchrun, run directory, morph table): t=2 on 2 ranks for 4
    steps, then 1 device, where the plan's morph table says t=1; steps 5..8 give the losses of the
    uninterrupted t=2 run."""
    from builders import gpt_tiny_candidate

    from pipectl.artifacts.plan import MorphEntry
    from pipectl.launch import LaunchOptions, prepare_launch, run_engine
    from pipectl.resize.morph import resize_run
    from pipectl.runtime.metrics import read_metrics

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
