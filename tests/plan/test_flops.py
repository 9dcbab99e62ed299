"""Model and hardware FLOPs of a step, MFU and HFU (`pipectl.plan.flops`): the published formulas,
what recomputation and tensor parallelism change, where the FLOPs come from, and the peak."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest

from pipectl.artifacts.model import ModelConfig
from pipectl.artifacts.plan import Candidate, ModelShape, Plan, PlanRequest, ReplicaShare
from pipectl.artifacts.profile import ModelProfile
from pipectl.catalog import get_device
from pipectl.io import load_model
from pipectl.paths import resolve_config
from pipectl.plan.flops import (
    base_device,
    config_layer_flops,
    peak_flops_per_second,
    plan_layer_flops,
    plan_utilisation,
    profile_layer_flops,
    shape_config,
    step_flops,
    utilisation,
)
from pipectl.testing.profiles import synthetic_profile

DATA = Path(__file__).parent / "data"


def load_model_config(name: str) -> ModelConfig:
    """A shipped config, read as `plan.flops` reads it (models.registry would import torch)."""
    return load_model(ModelConfig, resolve_config(name, "models"))


def shape_of(config: ModelConfig) -> ModelShape:
    """The `model_shape` a plan of `config` records (the tied head's copy of the table counted once)."""
    counts = config.layer_parameter_counts()
    tied = config.vocab * config.hidden if config.tied_embeddings and config.family.value != "mlp" else 0
    return ModelShape(parameter_count=sum(counts) - tied, layer_parameter_counts=counts,
                      seq_len=config.seq_len, hidden=config.hidden, vocab=config.vocab)  # fmt: skip


def candidate(layers: int, *, cuts=None, t=1, p=1, d=1, b=1, m=1, recompute=False, device="cpu", step=1.0, **extra):
    cuts = cuts or [(0, layers)]
    return Candidate(
        devices=t * p * d, device=device, tensor_parallel=t, pipeline_parallel=p, data_parallel=d,
        micro_batch_size=b, micro_batches=m, schedule="1f1b", recompute=recompute, zero_stage=1,
        stage_layers=cuts, predicted_step_seconds=step, samples_per_second=1.0, tflops_per_device=0.0,
        peak_memory_bytes=[1] * p, bubble_fraction=0.0, communication_fraction=0.0, cost_per_million_samples=0.0,
        **extra,
    )  # fmt: skip


def plan_for(model: str, chosen: Candidate, shape: ModelShape, **fields) -> Plan:
    return Plan(model=model, model_shape=shape, cluster="local", request=PlanRequest(global_batch=chosen.global_batch),
                chosen=chosen, **fields)  # fmt: skip


def megatron(B: int, s: int, l: int, h: int, V: int, recompute: bool) -> float:
    """Narayanan et al. 2021 (§5.1, Appendix): FLOPs of one GPT training step.

    Forward, per layer: 24·B·s·h² for the GEMMs (QKV 6Bsh², output projection 2Bsh², MLP 16Bsh²)
    plus 4·B·s²·h for QKᵀ and attention x V; the logits 2·B·s·h·V. The backward is twice the
    forward, so without recomputation 3 x (24Bslh² + 4Bs²lh + 2BshV) = 72·B·s·l·h²·(1 + s/(6h) +
    V/(12·l·h)). Full recomputation runs the layers' forward once more (4x) but not the logits
    (3x): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
    """
    if recompute:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def test_a_gpt_steps_model_flops_are_megatrons_formula():
    gpt3 = load_model_config("gpt3-175b")  # l=96, h=12288, s=2048, V=51200
    B, l, h, s, V = 1536, gpt3.layers, gpt3.hidden, gpt3.seq_len, gpt3.vocab
    flops = config_layer_flops(gpt3)
    step = step_flops(flops, B, [(0, l + 3)], recompute=False)
    assert step.model == pytest.approx(megatron(B, s, l, h, V, recompute=False), rel=1e-12)
    assert step.hardware == step.model  # one stage, t = 1: nothing recomputed or duplicated


def test_recompute_of_every_block_is_megatrons_96_formula_and_raises_hfu_not_mfu():
    gpt3 = load_model_config("gpt3-175b")
    B, l = 1536, gpt3.layers
    flops = config_layer_flops(gpt3)
    # The last stage holds only the final norm and the head: every block is recomputed, the logits not.
    cuts = [(0, 49), (49, l + 1), (l + 1, l + 3)]
    step = step_flops(flops, B, cuts, recompute=True)
    full_recompute = megatron(B, gpt3.seq_len, l, gpt3.hidden, gpt3.vocab, recompute=True)
    assert step.hardware == pytest.approx(full_recompute, rel=1e-12)
    assert step.model == step_flops(flops, B, cuts, recompute=False).model

    shape = shape_of(gpt3)
    plain = candidate(l + 3, cuts=cuts, p=3, m=B, device="a100-80gb")
    with_r = plain.model_copy(update={"recompute": True})
    u, r = (utilisation(c, flops, "bfloat16") for c in (plain, with_r))
    assert r.mfu == u.mfu and u.hfu == u.mfu and r.hfu > r.mfu
    assert r.hfu / r.mfu == pytest.approx(step.hardware / step.model, rel=1e-12)
    assert plan_utilisation(plan_for("gpt3-175b", with_r, shape), None, "bfloat16").hfu == r.hfu


def test_the_last_stage_is_not_recomputed():
    tiny = load_model_config("gpt-tiny")  # embed, 6 blocks, final_norm, head
    flops = config_layer_flops(tiny)
    step = step_flops(flops, 8, [(0, 4), (4, 9)], recompute=True)
    assert step.recomputed == 8 * sum(flops.forward[0:4])  # 3 blocks of stage 0; stage 1 runs B after F


def test_selective_recomputation_adds_each_blocks_attention_core_to_hfu_only():
    gpt3 = load_model_config("gpt3-175b")
    B, l, s, h = 1536, gpt3.layers, gpt3.seq_len, gpt3.hidden
    flops = config_layer_flops(gpt3)
    cuts = [(0, 49), (49, l + 3)]
    plain = step_flops(flops, B, cuts, recompute=False, tensor_parallel=8)
    selective = step_flops(flops, B, cuts, recompute=False, tensor_parallel=8, selective_recompute=True)
    # QKᵀ and attention x V of every block once more, split over the tensor group (counted once).
    assert selective.recomputed - plain.recomputed == pytest.approx(B * l * 4 * s * s * h, rel=1e-12)
    assert selective.model == plain.model
    with_sel = candidate(l + 3, cuts=cuts, p=2, m=B, device="a100-80gb").model_copy(
        update={"selective_recompute": True})
    u = utilisation(with_sel, flops, "bfloat16")
    assert u.hfu > u.mfu
    # A profile's counts have no core of their own: HFU from them leaves it out.
    assert step_flops(dataclasses.replace(flops, attention_core=()), B, cuts, recompute=False,
                      selective_recompute=True).recomputed == 0


def test_tensor_ranks_each_run_the_unsplit_layers_which_raises_hfu_only():
    tiny = load_model_config("gpt-tiny")
    flops = config_layer_flops(tiny)
    one, two = (step_flops(flops, 8, [(0, 9)], recompute=False, tensor_parallel=t) for t in (1, 2))
    assert one.model == two.model
    head = flops.forward[-1]  # the embedding and norms count 0 model FLOPs
    assert two.replicated == 3 * 8 * head and two.hardware == one.hardware + 3 * 8 * head


def test_gqa_swiglu_blocks_count_their_weight_matrices_twice_per_token_plus_attention():
    llama = ModelConfig(name="l", family="gpt", layers=2, hidden=256, heads=8, kv_heads=2, seq_len=64, vocab=1000,
                        ffn_hidden=688, activation="swiglu", norm="rms", linear_bias=False, rotary=True,
                        tied_embeddings=False)  # fmt: skip
    h, s = llama.hidden, llama.seq_len
    matrices = llama.block_parameters() - 2 * h  # no biases; two RMSNorm weights of h
    assert matrices == 2 * h * h + 2 * h * 64 + 3 * h * 688
    assert config_layer_flops(llama).forward[1] == 2 * s * matrices + 4 * s * s * h


def test_the_shape_and_a_derived_profile_agree_on_blocks_and_head():
    plan = load_model(Plan, DATA / "gpt2-2.5b-a100-unsharded.plan.json")
    profile = load_model(ModelProfile, DATA / "gpt2-2.5b-a100-unsharded.profile.json")
    shape, counted = plan_layer_flops(plan, profile), profile_layer_flops(profile)
    assert shape.source == "shape" and counted.source == "profile"
    assert shape.forward[1:-2] == counted.forward[1:-2] and shape.forward[-1] == counted.forward[-1]
    # The derived profile also counts the position add (s·h) and the final norm (8·s·h): not model FLOPs.
    assert (shape.forward[0], shape.forward[-2]) == (0, 0) and counted.forward[0] == 1024 * 1920


def test_mfu_of_a_plan_for_the_shipped_a100_cluster_is_plausible():
    plan = load_model(Plan, DATA / "gpt2-2.5b-a100-unsharded.plan.json")  # 64 A100s, t=2 d=32, no recompute
    profile = load_model(ModelProfile, DATA / "gpt2-2.5b-a100-unsharded.profile.json")
    u = plan_utilisation(plan, profile)
    assert u.dtype == "bfloat16" and u.peak_flops_per_second == 64 * 312e12
    assert 0.2 < u.mfu < 0.7 and u.mfu < u.hfu < 1  # HFU: the head runs whole on both tensor ranks
    # The planner's TFLOP/s per device counts the same forwards (and a few element-wise FLOPs).
    assert u.mfu == pytest.approx(plan.chosen.tflops_per_device * 1e12 / 312e12, rel=1e-4)


def test_a_model_without_a_known_shape_takes_the_profiles_counts_else_none():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu")
    layers = len(profile.layers)
    shape = ModelShape.of_profile(profile)
    plan = plan_for("my.models:factory", candidate(layers), shape)
    assert shape_config(plan) is None and plan_layer_flops(plan) is None
    flops = plan_layer_flops(plan, profile)
    assert flops.source == "profile" and flops.per_sample == sum(l.costs[0].forward_flops for l in profile.layers)
    uncounted = profile.model_copy(update={"layers": [
        l.model_copy(update={"costs": [c.model_copy(update={"forward_flops": 0.0}) for c in l.costs]})
        for l in profile.layers
    ]})  # fmt: skip
    u = plan_utilisation(plan, uncounted)
    assert (u.mfu, u.hfu, u.source) == (None, None, None) and "unknown" in u.detail


def test_a_config_that_no_longer_matches_the_planned_shape_is_not_used():
    tiny = load_model_config("gpt-tiny")
    grown = shape_of(tiny.model_copy(update={"hidden": 128}))
    plan = plan_for("gpt-tiny", candidate(tiny.layers + 3), grown)
    assert shape_config(plan) is None and plan_layer_flops(plan) is None
    assert shape_config(plan_for("gpt-tiny", candidate(tiny.layers + 3), shape_of(tiny))) == tiny


def test_the_peak_sums_every_device_in_the_precision_and_emulated_kinds_are_their_hardware():
    cpu, a100 = get_device("cpu"), get_device("a100-80gb")
    assert peak_flops_per_second(candidate(9, t=2, d=3, device="a100-80gb"), "bfloat16") == 6 * 312e12
    assert peak_flops_per_second(candidate(9, p=1, d=2), "float32") == 2 * cpu.peak_flops_per_second("float32")
    assert base_device("cpu-slowed-2x") == "cpu"
    replicas = [ReplicaShare(replica=r, device=kind, micro_batch_size=1, micro_batches=m, samples=m,
                             gradient_weight=m / 16) for r, (kind, m) in enumerate([("cpu", 11), ("cpu-slowed-2x", 5)])]
    mixed = candidate(9, d=2, m=11, device="mixed", replicas=replicas)
    assert peak_flops_per_second(mixed, "float32") == 2 * cpu.peak_flops_per_second("float32")
    assert peak_flops_per_second(candidate(9, device="tpu-v9"), "bfloat16") is None
    u = utilisation(candidate(9, device="tpu-v9"), config_layer_flops(load_model_config("gpt-tiny")), "bfloat16")
    assert u.mfu is None and "tpu-v9" in u.detail and u.model_flops_per_step > 0
    assert a100.peak_flops_per_second("float32") == 19.5e12  # fp32, not TF32
