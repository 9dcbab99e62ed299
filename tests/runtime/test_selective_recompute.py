"""Selective recomputation run by real DeepSpeed ranks: the same losses as without.

gpt-tiny on the built-in byte corpus, B = 8, fp32, seed 7, 5 steps: a two-stage 1F1B pipeline in
DeepSpeed's pipeline engine, and one stage on two ZeRO-3 replicas in its ordinary engine
(`runtime/engines/plain.py`; the core holds no weights, so ZeRO-3's partitioning does not touch its
recomputation), each with and without `selective_recompute`: every block recomputes its attention
core inside its backward, so the gradients, hence every step's loss, are those of the run that
kept the core's activations.
"""

from __future__ import annotations

import pytest

from builders import training_config
from pipectl.artifacts.layout import Layout
from pipectl.runtime.job import TrainingJob
from pipectl.runtime.worker import spawn_ranks
from pipectl.schedule.ir import ScheduleKind

pytestmark = pytest.mark.multiprocess

STEPS = 5
TOLERANCE = 1e-5  # fp32; the recomputed core gives the same values, only rounding could differ
LAYOUTS = {
    "p2 1f1b": (Layout(2, 1, 2, 4, ((0, 4), (4, 9)), ScheduleKind.ONE_F_ONE_B), 1),
    "p1 d2 ZeRO-3": (Layout(1, 2, 2, 2, ((0, 9),)), 3),
}


def _losses(layout: Layout, zero_stage: int) -> dict[int, list[float]]:
    job = TrainingJob("gpt-tiny", layout, training_config(layout, zero_stage=zero_stage), steps=STEPS, seed=7)
    return {rank: outcome.losses for rank, outcome in spawn_ranks(job, timeout_seconds=120).items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recomputing_the_attention_core_gives_the_losses_of_keeping_it(name):
    layout, zero_stage = LAYOUTS[name]
    kept = _losses(layout, zero_stage)
    selective = _losses(Layout(**{**layout.__dict__, "selective_recompute": True}), zero_stage)
    assert selective.keys() == kept.keys()
    for rank, losses in selective.items():
        assert len(losses) == STEPS and len(set(losses)) > 1  # it trained
        assert losses == pytest.approx(kept[rank], rel=TOLERANCE), f"{name} rank {rank}"


def _core_calls(rank: int, world: int, port: int, selective: bool, checkpoint_layers: bool, results) -> None:
    """One gloo rank: gpt-tiny as a one-stage module built as the worker builds it, one forward and
    backward, and how often the attention core ran (`run_local_ranks` target)."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    try:
        from pipectl.runtime.engines.dsinit import init_distributed

        init_distributed()
        import torch
        import torch.distributed as torch_dist

        from pipectl.models import build_model, transformer
        from pipectl.runtime.engines.pipeline import build_pipeline_module

        calls = [0]
        real = transformer.attention_core

        def counted(*args):
            calls[0] += 1
            return real(*args)

        transformer.attention_core = counted
        module = build_pipeline_module(build_model("gpt-tiny"), [(0, 9)], num_stages=1,
                                       selective_recompute=selective, checkpoint_layers=checkpoint_layers)
        module(torch.randint(0, 256, (2, 32))).float().square().mean().backward()
        results.put((rank, calls[0]))
        torch_dist.destroy_process_group()
    except BaseException as exc:  # report, don't leave the parent waiting for the timeout
        results.put(RuntimeError(f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("selective, checkpoint_layers, calls", [
    (False, False, 6),  # gpt-tiny's 6 blocks, once each
    (True, False, 12),  # and again in each block's backward
    (True, True, 18),  # inside per-layer checkpointing too: the layer's recomputed forward, then the core's
])  # fmt: skip
def test_the_stage_module_recomputes_each_blocks_attention_core(selective, checkpoint_layers, calls):
    from pipectl.runtime.engines.local_ranks import run_local_ranks

    got = run_local_ranks(_core_calls, (selective, checkpoint_layers), 1, preload=["torch", "deepspeed"],
                          timeout_seconds=60, what="gpt-tiny")[0]  # fmt: skip
    assert got == calls
