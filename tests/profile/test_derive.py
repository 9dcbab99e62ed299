"""Derived profiles: parameter counts against closed forms and public sizes, FLOPs, and the layer
list against the real modules (and the measured profiler) of the same config."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.artifacts.model import ModelConfig
from pipectl.artifacts.profile import EngineFeatures
from pipectl.catalog import DeviceSpec, get_device
from pipectl.errors import UserInputError
from pipectl.io import load_model
from pipectl.paths import resolve_config
from pipectl.profile.compute_model import MEMORY_EFFICIENCY
from pipectl.profile.derive import derive_profile, gpt_parameters_closed_form


def _config(name: str) -> ModelConfig:
    return load_model(ModelConfig, resolve_config(name, "models"))


def _flat_device(peak_tflops: float = 100.0, efficiency: float = 0.5) -> DeviceSpec:
    return DeviceSpec(
        name="flat",
        memory_gib=80,
        peak_tflops_bf16=peak_tflops,
        peak_tflops_fp32=peak_tflops / 4,
        intra_node_bandwidth_gbytes_per_second=100,
        intra_node_latency_us=1,
        inter_node_bandwidth_gbytes_per_second=10,
        inter_node_latency_us=5,
        efficiency_by_micro_batch=[(1, efficiency)],
    )


A100 = get_device("a100-80gb")


def test_gpt3_175b_is_175_billion_parameters():
    profile = derive_profile(_config("gpt3-175b"), A100, [1])
    assert profile.parameter_count == pytest.approx(175e9, rel=0.01)


def test_gpt_1t_is_about_one_trillion_parameters():
    # 128 layers, h = 25600: 12 l h^2 = 1.0066e12, plus embeddings: 1.008e12.
    profile = derive_profile(_config("gpt-1t"), A100, [1])
    assert profile.parameter_count == pytest.approx(1.0e12, rel=0.03)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small", "gpt2-2.5b", "gpt3-175b", "gpt-1t", "bert-tiny"])
def test_parameter_count_is_the_closed_form_plus_the_final_layer_norm(name):
    config = _config(name)
    profile = derive_profile(config, A100, [1])
    closed = gpt_parameters_closed_form(config.layers, config.hidden, config.vocab, config.seq_len)
    assert profile.parameter_count == pytest.approx(closed + 2 * config.hidden, rel=1e-12, abs=1)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 200),
    heads=st.integers(1, 64),
    head_dim=st.integers(1, 256),
    vocab=st.integers(1, 300_000),
    seq_len=st.integers(1, 8192),
)
def test_closed_form_holds_for_any_gpt_shape(layers, heads, head_dim, vocab, seq_len):
    hidden = heads * head_dim
    config = ModelConfig(name="g", family="gpt", layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab)
    profile = derive_profile(config, A100, [1])
    closed = gpt_parameters_closed_form(layers, hidden, vocab, seq_len)
    assert profile.parameter_count == pytest.approx(closed + 2 * hidden, rel=1e-12)


def test_block_and_logit_flops_and_time_on_a_device_without_compute_constants():
    # The curve path: the FLOPs the kernels do at peak x efficiency(b). A causal flash kernel skips
    # half of the attention products (2 b s^2 h, not 4); its backward does 2.5 x its forward; the
    # GEMMs' backward 2 x. forward_flops keeps Narayanan et al.'s full count.
    config = _config("gpt-small")
    device = _flat_device(peak_tflops=100, efficiency=0.5)
    profile = derive_profile(config, device, [4])
    b, s, h, V = 4, config.seq_len, config.hidden, config.vocab
    block = profile.layers[1].cost(4)
    assert block.forward_flops == 24 * b * s * h * h + 4 * b * s * s * h
    assert block.forward_seconds == pytest.approx((24 * b * s * h * h + 2 * b * s * s * h) / 50e12)
    assert block.backward_seconds == pytest.approx((48 * b * s * h * h + 5 * b * s * s * h) / 50e12)
    head = profile.layers[-1].cost(4)
    assert head.forward_flops == 2 * b * s * h * V
    assert head.output_activation_bytes == b * s * V * 2  # bf16 logits


def test_step_flops_with_recomputation_match_the_closed_form():
    # Narayanan et al. 2021, §5.1: with recomputation a step costs F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)):
    # blocks run forward, recompute and a 2x backward (4 forwards), the head 3 forwards.
    config = _config("gpt3-175b")
    batch = 8
    profile = derive_profile(config, A100, [batch])
    blocks = sum(layer.cost(batch).forward_flops for layer in profile.layers if layer.kind == "transformer_block")
    head = profile.layers[-1].cost(batch).forward_flops
    l, h, s, V = config.layers, config.hidden, config.seq_len, config.vocab
    closed = 96 * batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert 4 * blocks + 3 * head == pytest.approx(closed, rel=1e-12)


def test_larger_micro_batches_are_no_slower_per_sample():
    profile = derive_profile(_config("gpt2-2.5b"), get_device("v100-32gb"), [1, 2, 4, 8, 16])
    block = profile.layers[1]
    per_sample = [block.cost(b).forward_seconds / b for b in profile.micro_batch_sizes]
    assert per_sample == sorted(per_sample, reverse=True)
    assert per_sample[0] > per_sample[-1]


def test_saved_activations_are_what_a_flash_block_keeps():
    # 4 whole b s h tensors + 12 h/t split ones (t = 1) in the element size, + fp32 statistics.
    config = _config("gpt3-175b")
    s, h, a, b = config.seq_len, config.hidden, config.heads, 2
    fp32_extras = b * s * 4 * (4 + a)  # two LayerNorms' mean and rstd, log-sum-exp per head
    bf16 = derive_profile(config, A100, [b], dtype="bfloat16").layers[1].cost(b)
    assert bf16.saved_activation_bytes == b * s * h * 32 + fp32_extras
    fp32 = derive_profile(config, A100, [b], dtype="float32").layers[1].cost(b)
    assert fp32.saved_activation_bytes == b * s * h * 64 + fp32_extras
    unfused = derive_profile(config, A100, [b], attention="unfused").layers[1].cost(b)
    assert unfused.saved_activation_bytes - bf16.saved_activation_bytes == b * a * s * s * 2 - b * s * a * 4


def test_dtype_sets_the_bytes_and_the_peak():
    config = _config("gpt-small")
    bf16 = derive_profile(config, A100, [2], dtype="bfloat16")
    fp32 = derive_profile(config, A100, [2], dtype="float32")
    for half, full in zip(bf16.layers, fp32.layers):
        assert half.parameter_bytes == 2 * half.parameter_count
        assert full.parameter_bytes == 4 * full.parameter_count
    # 312 vs 19.5 TFLOP/s: a GEMM-bound block is nearly 16x slower in fp32 (its element-wise work,
    # twice the bytes, only 2x).
    large = _config("gpt3-175b")
    ratio = (
        derive_profile(large, A100, [1], dtype="float32").layers[1].cost(1).forward_seconds
        / derive_profile(large, A100, [1], dtype="bfloat16").layers[1].cost(1).forward_seconds
    )
    assert 15 < ratio < 16


def test_element_wise_layers_are_memory_bound_on_fast_devices():
    # final_norm: one kernel, issued after the host's overhead, reading and writing b s h at the
    # attainable bandwidth.
    config = _config("gpt-small")
    cost = derive_profile(config, A100, [8]).layers[-2].cost(8)
    bandwidth = A100.memory_bandwidth_gbytes_per_second * 1e9 * MEMORY_EFFICIENCY
    memory_seconds = 2 * 8 * config.seq_len * config.hidden * 2 / bandwidth
    assert cost.forward_seconds == pytest.approx(A100.kernel_overhead_us * 1e-6 + memory_seconds)


def test_micro_batch_sizes_are_sorted_and_named_when_bad():
    profile = derive_profile(_config("gpt-tiny"), "cpu", [4, 1, 2, 4], dtype="float32")
    assert profile.micro_batch_sizes == [1, 2, 4]
    assert [c.micro_batch_size for c in profile.layers[0].costs] == [1, 2, 4]
    for bad in ([], [0], [2, -1], [1.5]):
        with pytest.raises(UserInputError):
            derive_profile(_config("gpt-tiny"), "cpu", bad)


def test_unknown_dtype_and_device_are_user_errors():
    with pytest.raises(UserInputError, match="float8"):
        derive_profile(_config("gpt-tiny"), "cpu", [1], dtype="float8")
    with pytest.raises(UserInputError, match="gpu-9000"):
        derive_profile(_config("gpt-tiny"), "gpu-9000", [1])


def test_profile_metadata():
    profile = derive_profile(_config("gpt-tiny"), "cpu", [1, 2], dtype="float32")
    assert profile.source.value == "derived"
    assert (profile.device, profile.dtype, profile.model) == ("cpu", "float32", "gpt-tiny")
    assert (profile.seq_len, profile.hidden, profile.vocab) == (32, 64, 256)
    assert [layer.index for layer in profile.layers] == list(range(len(profile.layers)))


# --- the layer list against the real modules (needs torch) ------------------------------------------


def _built_layers(config: ModelConfig):
    """(name, kind, parameter_count, shared_group, shared_count) of the real modules.

    Tied layers share the first holder's module, as DeepSpeed's TiedLayerSpec does on one stage; a
    later holder is charged the tied tensor it uses, all of it shared.
    """
    from pipectl.models.registry import from_config

    model = from_config(config)
    first_holder = {}
    rows = []
    for layer in model.layers:
        if layer.tie_key is not None and layer.tie_key in first_holder:
            tied = getattr(first_holder[layer.tie_key], layer.tied_weight_attr)
            rows.append((layer.name, layer.kind, tied.numel(), layer.tie_key, tied.numel()))
            continue
        module = layer.build()
        count = sum(p.numel() for p in module.parameters())
        shared = 0
        if layer.tie_key is not None:
            first_holder[layer.tie_key] = module
            shared = getattr(module, layer.tied_weight_attr).numel()
        rows.append((layer.name, layer.kind, count, layer.tie_key, shared))
    return model, rows


def _derived_rows(profile):
    return [
        (l.name, l.kind, l.parameter_count, l.shared_group, l.shared_parameter_count) for l in profile.layers
    ]


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny", "mlp-tiny"])
def test_layer_list_lines_up_with_the_built_model(name):
    config = _config(name)
    _, rows = _built_layers(config)
    assert _derived_rows(derive_profile(config, "cpu", [1], dtype="float32")) == rows


def test_untied_head_lines_up_with_the_built_model():
    config = _config("gpt-tiny").model_copy(update={"tied_embeddings": False})
    _, rows = _built_layers(config)
    profile = derive_profile(config, "cpu", [1], dtype="float32")
    assert _derived_rows(profile) == rows
    assert profile.layers[-1].shared_group is None and profile.layers[0].shared_group is None


def test_output_bytes_equal_the_real_outputs():
    import torch

    config = _config("gpt-tiny")
    model, _ = _built_layers(config)
    profile = derive_profile(config, "cpu", [3], dtype="float32")
    modules = {}
    x, _ = model.make_batch(3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer, derived in zip(model.layers, profile.layers):
            module = modules.get(layer.tie_key) if layer.tie_key else None
            if module is None:
                module = layer.build()
                if layer.tie_key:
                    modules[layer.tie_key] = module
            x = layer.forward(module, x)
            assert derived.cost(3).output_activation_bytes == x.numel() * x.element_size(), layer.name


def test_derived_and_measured_profiles_line_up():
    from pipectl.models import build_model
    from pipectl.profile.measure import profile_model

    measured = profile_model(build_model("gpt-tiny"), [2], warmup=0, repeats=1)
    derived = derive_profile(_config("gpt-tiny"), "cpu", [2], dtype=measured.dtype)
    assert _derived_rows(derived) == _derived_rows(measured)
    assert derived.parameter_count == measured.parameter_count
    for d, m in zip(derived.layers, measured.layers):
        assert d.parameter_bytes == m.parameter_bytes, d.name
        assert d.cost(2).output_activation_bytes == m.cost(2).output_activation_bytes, d.name


# --- the embedding's and the head's memory-bound work and working memory ---------------------------


H100 = get_device("h100-80gb")


def test_embedding_backward_pays_for_the_dense_vocabulary_gradient():
    # Zeroing V x h and adding it into .grad (4 V h element bytes) bound the backward from below,
    # whatever the micro-batch; the gather forward moves only b s h.
    config = _config("gpt2-2.5b")
    profile = derive_profile(config, H100, [1, 8])
    V, h = config.vocab, config.hidden
    dense_seconds = 4 * V * h * 2 / (H100.memory_bandwidth_gbytes_per_second * 1e9)
    for b in (1, 8):
        cost = profile.layers[0].cost(b)
        assert cost.backward_seconds > dense_seconds
        assert cost.backward_seconds > 3 * cost.forward_seconds
    assert profile.layers[0].cost(8).backward_seconds < 1.5 * profile.layers[0].cost(1).backward_seconds


def test_peak_memory_is_parameters_twice_saved_output_and_working():
    # pipectl's loss keeps the 16-bit logit gradient it makes in the forward (2 b s V bytes, not
    # eager's 4 b s V of fp32 log-softmax); its working memory (read back as peak - 2 x parameters
    # - saved - output) is one chunk of fp32 log-probabilities or the backward's two gradients.
    # Another engine's eager fp32 loss holds two fp32 gradients together: 8 b s V bytes.
    from pipectl.profile.layer_shapes import LOSS_CHUNK_BYTES

    config = _config("gpt2-2.5b")
    b = 4
    tokens, V, h = b * config.seq_len, config.vocab, config.hidden
    for engine, saved, working in ((None, tokens * h * 2 + tokens * V * 2,
                                    max(LOSS_CHUNK_BYTES // (4 * V) * 4 * V, 2 * tokens * h + 2 * V * h)),
                                   (EngineFeatures(name="megatron"), tokens * h * 2 + tokens * V * 4, 8 * tokens * V)):  # fmt: skip
        head = derive_profile(config, H100, [b], engine=engine).layers[-1]
        cost = head.cost(b)
        assert cost.saved_activation_bytes == saved
        assert cost.output_activation_bytes == tokens * V * 2
        rest = cost.peak_memory_bytes - 2 * head.parameter_bytes - cost.saved_activation_bytes - cost.output_activation_bytes
        assert rest == working
    profile = derive_profile(config, H100, [b])
    # Every layer's working memory is non-negative and smaller than its saved + output bytes.
    for layer in profile.layers:
        c = layer.cost(b)
        rest = c.peak_memory_bytes - 2 * layer.parameter_bytes - c.saved_activation_bytes - c.output_activation_bytes
        assert rest >= 0, layer.name


def test_attention_is_recorded_and_checked():
    flash = derive_profile(_config("gpt-small"), H100, [1])
    unfused = derive_profile(_config("gpt-small"), H100, [1], attention="unfused")
    assert any("attention: flash" in note for note in flash.notes)
    assert any("attention: unfused" in note for note in unfused.notes)
    assert unfused.layers[1].cost(1).saved_activation_bytes > flash.layers[1].cost(1).saved_activation_bytes
    with pytest.raises(UserInputError, match="sparse"):
        derive_profile(_config("gpt-small"), H100, [1], attention="sparse")


# --- the CLI's derive option ---------------------------------------------------------------------


def test_cli_records_the_attention_it_derives_for(tmp_path):
    from typer.testing import CliRunner

    from pipectl.artifacts.profile import ModelProfile
    from pipectl.cli.main import app

    runner = CliRunner()
    out = tmp_path / "p.json"
    base = ["profile", "gpt-small", "--derive", "--device", "h100-80gb", "-b", "1", "-o", str(out)]
    result = runner.invoke(app, [*base, "--attention", "unfused"])
    assert result.exit_code == 0, result.output
    assert any("attention: unfused" in note for note in load_model(ModelProfile, out).notes)
    result = runner.invoke(app, base)
    assert result.exit_code == 0, result.output
    assert any("attention: flash" in note for note in load_model(ModelProfile, out).notes)
    bad = runner.invoke(app, [*base, "--attention", "sparse"])
    assert bad.exit_code == 2 and "sparse" in bad.output
    measured = runner.invoke(app, ["profile", "gpt-tiny", "--attention", "unfused", "-o", str(out)])
    assert measured.exit_code == 2 and "--derive" in measured.output


def test_a_micro_batch_too_large_for_any_profile_is_a_user_error_not_a_traceback():
    from pipectl.errors import UserInputError
    from pipectl.models.registry import load_model_config

    with pytest.raises(UserInputError, match="out of range: .*peak_memory_bytes") as error:
        derive_profile(load_model_config("gpt3-175b"), "a100-80gb", [100_000_000])
    assert "-b" in error.value.hint


def test_a_device_without_bfloat16_derives_float16_and_refuses_bfloat16():
    from pipectl.errors import UserInputError
    from pipectl.models.registry import load_model_config

    config = load_model_config("gpt-tiny")
    assert derive_profile(config, "v100-32gb", [1]).dtype == "float16"
    assert derive_profile(config, "a100-80gb", [1]).dtype == "bfloat16"
    with pytest.raises(UserInputError, match="v100-32gb has no bfloat16"):
        derive_profile(config, "v100-32gb", [1], dtype="bfloat16")


def test_selective_recomputation_of_gpt3_costs_what_korthikanti_measured():
    # Korthikanti et al. 2022, Table 4: selective recomputation adds 2.7 % to a GPT-3 175B layer's
    # forward and backward (t = 8, unfused attention, A100). The derived block's attention core:
    gpt3 = ModelConfig(name="gpt3", family="gpt", layers=2, hidden=12288, heads=96, seq_len=2048, vocab=51200,
                       shape_only=True)  # fmt: skip
    unfused = derive_profile(gpt3, "a100-80gb", [1], attention="unfused", tensor_parallel=(8,)).layers[1].shards[0]
    cost = unfused.costs[0]
    assert cost.attention_core_forward_seconds / (cost.forward_seconds + cost.backward_seconds) == pytest.approx(
        0.027, abs=0.003)
    assert cost.attention_core_saved_bytes == 2 * (96 // 8) * 2048 * 2048  # the bf16 softmax output
    # With flash attention the core keeps only its log-sum-exp: selective recomputation frees
    # almost nothing, and its time is still spent.
    flash = derive_profile(gpt3, "a100-80gb", [1], tensor_parallel=(8,)).layers[1].shards[0].costs[0]
    assert flash.attention_core_saved_bytes / flash.saved_activation_bytes < 0.001
    assert flash.attention_core_forward_seconds > 0


def test_a_22b_layer_takes_the_time_korthikanti_measured():
    # Korthikanti et al. 2022, Table 4: one layer of their 22B GPT (h 6144, 64 heads, s 2048, b 4,
    # t 8 on a DGX A100, Megatron's fused kernels, dropout, unfused attention) runs its forward in
    # 7.7 ms and its backward in 11.9 ms, the tensor-parallel all-reduces included. The derived
    # shard, priced by the planner with those all-reduces on the node's NCCL bus bandwidth:
    # 7.15 and 12.21 ms.
    from pipectl.artifacts.cluster import ClusterSpec
    from pipectl.artifacts.profile import EngineFeatures
    from pipectl.plan.costs import hardware_for, layer_seconds
    from pipectl.plan.layer_table import layer_table

    config = ModelConfig(name="22b", family="gpt", layers=4, hidden=6144, heads=64, seq_len=2048, vocab=51200,
                         shape_only=True)  # fmt: skip
    megatron = EngineFeatures(name="megatron-lm", vocab_parallel=True, fused_elementwise=True, dropout=True)
    profile = derive_profile(config, "a100-80gb", [4], attention="unfused", engine=megatron)
    node = ClusterSpec(name="dgx", node_types=[{"name": "n", "device": "a100-80gb", "devices_per_node": 8, "nodes": 1}])
    seconds = layer_seconds(layer_table(profile, 4, 8), hardware_for(node, profile), 8)
    block = 1
    assert seconds.forward[block] == pytest.approx(7.7e-3, rel=0.10)
    assert seconds.backward[block] == pytest.approx(11.9e-3, rel=0.10)


def test_a_profile_without_its_attention_core_is_not_searched_selectively():
    # An hf: model of GPT-2's shape derives as pipectl's block would, but its blocks are Hugging
    # Face's, which the runtime runs whole: `pipectl profile --derive hf:...` strips the core.
    from pipectl.profile.derive import without_attention_core

    config = ModelConfig(name="g", family="gpt", layers=2, hidden=256, heads=4, seq_len=512, vocab=1000)
    profile = derive_profile(config, "h100-80gb", [1, 2], tensor_parallel=(2,))
    assert profile.records_attention_core
    stripped = without_attention_core(profile)
    assert not stripped.records_attention_core
    assert all(cost.attention_core_forward_seconds is None for layer in stripped.layers
               for holder in (layer, *layer.shards) for cost in holder.costs)  # fmt: skip
    assert "attention_core" not in stripped.model_dump_json()  # written as a profile without them
    assert stripped.layers[1].costs[1].saved_activation_bytes == profile.layers[1].costs[1].saved_activation_bytes
