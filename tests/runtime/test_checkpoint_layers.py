"""Per-layer activation checkpointing run by real DeepSpeed ranks: the same losses as without.

gpt-tiny on the built-in byte corpus, B = 8, fp32, seed 7, 5 steps: a two-stage 1F1B pipeline in
DeepSpeed's pipeline engine, and one stage on two ZeRO-2 replicas in its ordinary engine
(`runtime/engines/plain.py`), each run with and without `checkpoint_layers`. DeepSpeed's
`activation_checkpoint_interval=1` recomputes every layer's forward inside the backward, so the
gradients, hence every step's loss, are those of the run that kept its activations.
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
TOLERANCE = 1e-5  # fp32; recomputing a layer gives the same values, only rounding could differ
LAYOUTS = {
    "p2 1f1b": (Layout(2, 1, 2, 4, ((0, 4), (4, 9)), ScheduleKind.ONE_F_ONE_B), 1),
    "p1 d2 ZeRO-2": (Layout(1, 2, 2, 2, ((0, 9),)), 2),
}


def _losses(layout: Layout, zero_stage: int) -> dict[int, list[float]]:
    config = training_config(layout, zero_stage=zero_stage)
    if layout.checkpoint_layers:  # as `pipectl launch` writes it (`dsconfig.deepspeed_config`)
        config["pipeline"] = {"activation_checkpoint_interval": 1, "use_reentrant": False}
    job = TrainingJob("gpt-tiny", layout, config, steps=STEPS, seed=7)
    return {rank: outcome.losses for rank, outcome in spawn_ranks(job, timeout_seconds=120).items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpointing_every_layer_gives_the_losses_of_keeping_every_activation(name):
    layout, zero_stage = LAYOUTS[name]
    kept = _losses(layout, zero_stage)
    checkpointed = _losses(Layout(**{**layout.__dict__, "checkpoint_layers": True}), zero_stage)
    assert kept.keys() == checkpointed.keys()
    for rank, losses in checkpointed.items():
        assert len(losses) == STEPS and len(set(losses)) > 1  # it trained
        assert losses == pytest.approx(kept[rank], rel=TOLERANCE), f"{name} rank {rank}"


def _forward_counts(rank: int, world: int, port: int, model: str, checkpoint_layers: bool, results) -> None:
    """One gloo rank: gpt-tiny as a one-stage module, one forward and backward, and how often each
    layer's forward ran (`run_local_ranks` target)."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    try:
        from pipectl.runtime.engines.dsinit import init_distributed

        init_distributed()
        import torch  # after the rank's environment (dsinit)
        import torch.distributed as torch_dist

        from pipectl.models import build_model
        from pipectl.runtime.engines.pipeline import build_pipeline_module

        module = build_pipeline_module(build_model(model), [(0, 9)], num_stages=1, checkpoint_layers=checkpoint_layers)
        counts = [0] * len(module.forward_funcs)
        for index, layer in enumerate(module.forward_funcs):
            if isinstance(layer, torch.nn.Module):
                layer.register_forward_hook(lambda *_, index=index: counts.__setitem__(index, counts[index] + 1))
            else:  # a tied head: the embedding's `tied_forward`, a function of the module
                module.forward_funcs[index] = lambda x, f=layer, index=index: (
                    counts.__setitem__(index, counts[index] + 1), f(x))[1]
        tokens = torch.randint(0, 256, (2, 32))
        module(tokens).float().square().mean().backward()
        grads = sum(p.grad is not None for p in module.parameters())
        results.put((rank, (counts, grads, len(list(module.parameters())))))
        torch_dist.destroy_process_group()
    except BaseException as exc:  # report, don't leave the parent waiting for the timeout
        results.put(RuntimeError(f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("checkpoint_layers, tied", [(False, True), (True, True), (True, False)])
def test_the_stage_module_recomputes_each_layer_but_the_head_in_its_backward(tmp_path, checkpoint_layers, tied):
    from pipectl.paths import resolve_config
    from pipectl.runtime.engines.local_ranks import run_local_ranks

    model = "gpt-tiny"
    if not tied:  # the head an nn.Linear of its own, which DeepSpeed alone would checkpoint
        model = str(tmp_path / "gpt-tiny-untied.yaml")
        text = resolve_config("gpt-tiny", "models").read_text()
        (tmp_path / "gpt-tiny-untied.yaml").write_text(text.replace("tied_embeddings: true", "tied_embeddings: false"))
    counts, grads, parameters = run_local_ranks(
        _forward_counts, (model, checkpoint_layers), 1, preload=["torch", "deepspeed"], timeout_seconds=60,
        what="gpt-tiny",
    )[0]
    # gpt-tiny: embedding, 6 blocks, final norm (each recomputed), and the head (never: the
    # planner prices it as keeping its logits).
    assert counts == ([2] * 8 + [1] if checkpoint_layers else [1] * 9)
    assert grads == parameters  # every parameter got a gradient: the embedding's too (non-reentrant)
