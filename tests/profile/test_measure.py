"""Measured layer profiles: real modules, exact bytes, positive times, the fit limit."""

from __future__ import annotations

import pytest
import torch

from pipectl.errors import UserInputError
from pipectl.models import build_model
from pipectl.profile.layer_timing import layer_parameter_tensors, tensor_bytes
from pipectl.profile.measure import profile_model


@pytest.fixture(scope="module")
def gpt_tiny():
    return build_model("gpt-tiny")


@pytest.fixture(scope="module")
def tiny_profile(gpt_tiny):
    return profile_model(gpt_tiny, [1, 2], warmup=1, repeats=2, runtime=False)


def test_every_layer_has_positive_times_at_every_size(tiny_profile, gpt_tiny):
    assert [layer.name for layer in tiny_profile.layers] == [d.name for d in gpt_tiny.layers]
    assert tiny_profile.micro_batch_sizes == [1, 2]
    for layer in tiny_profile.layers:
        assert [c.micro_batch_size for c in layer.costs] == [1, 2]
        for cost in layer.costs:
            assert cost.forward_seconds > 0, layer.name
            assert cost.backward_seconds > 0, layer.name


def test_parameter_bytes_equal_the_real_tensors(tiny_profile, gpt_tiny):
    # Rebuild the layers independently of the profiler and count every parameter tensor.
    for index, layer_def in enumerate(gpt_tiny.layers):
        module = layer_def.build()
        if layer_def.tied_forward is not None:
            tensors = [getattr(module, layer_def.tied_weight_attr)]
        else:
            tensors = list(module.parameters())
        expected = sum(t.numel() * t.element_size() for t in tensors)
        layer = tiny_profile.layers[index]
        assert layer.parameter_bytes == expected, layer.name
        assert layer.parameter_count == sum(t.numel() for t in tensors), layer.name
    # and the helper agrees with the profile
    charged = layer_parameter_tensors(gpt_tiny)
    assert [sum(t.numel() * 4 for t in ts) for ts in charged] == [l.parameter_bytes for l in tiny_profile.layers]


def test_tied_head_is_counted_once_in_the_model(tiny_profile, gpt_tiny):
    embed, head = tiny_profile.layers[0], tiny_profile.layers[-1]
    assert embed.shared_group == head.shared_group == "embed"
    vocab, hidden = gpt_tiny.vocab, gpt_tiny.hidden
    assert head.shared_parameter_count == embed.shared_parameter_count == vocab * hidden
    modules = {}
    unique = 0
    for layer_def in gpt_tiny.layers:
        if layer_def.tie_key and layer_def.tie_key in modules:
            continue
        module = layer_def.build()
        if layer_def.tie_key:
            modules[layer_def.tie_key] = module
        unique += sum(p.numel() for p in module.parameters())
    assert tiny_profile.parameter_count == unique


def test_activation_bytes_equal_the_real_outputs(tiny_profile, gpt_tiny):
    torch.manual_seed(0)
    modules = {}
    built = []
    for layer_def in gpt_tiny.layers:
        if layer_def.tie_key and layer_def.tie_key in modules:
            built.append(modules[layer_def.tie_key])
            continue
        module = layer_def.build()
        if layer_def.tie_key:
            modules[layer_def.tie_key] = module
        built.append(module)
    for size in (1, 2):
        x, _ = gpt_tiny.make_batch(size, torch.Generator().manual_seed(1))
        with torch.no_grad():
            for index, (layer_def, module) in enumerate(zip(gpt_tiny.layers, built)):
                x = layer_def.forward(module, x)
                assert tiny_profile.layers[index].cost(size).output_activation_bytes == tensor_bytes(x)
    # Shape check on one number: block output is b x s x h float32.
    assert tiny_profile.layers[1].cost(2).output_activation_bytes == 2 * gpt_tiny.seq_len * gpt_tiny.hidden * 4


def test_saved_bytes_grow_with_micro_batch_and_exclude_parameters(tiny_profile):
    block = tiny_profile.layers[1]
    saved_1, saved_2 = block.cost(1).saved_activation_bytes, block.cost(2).saved_activation_bytes
    # A block keeps at least its input and several b*s*h intermediates, and nothing of its weights:
    # doubling b doubles what it saves.
    assert saved_1 >= block.cost(1).output_activation_bytes
    assert saved_2 == 2 * saved_1
    assert saved_1 < block.parameter_bytes  # weights (195 KiB) are not counted as saved activations


def test_memory_budget_stops_at_first_size_that_does_not_fit(gpt_tiny, tiny_profile):
    # The CPU estimate of the whole model at b: parameters + gradients + every layer's saved bytes
    # + the last output. A budget just above b=2's estimate admits 1 and 2 and stops at 4.
    def estimate(size: int) -> int:
        saved = sum(layer.cost(size).saved_activation_bytes for layer in tiny_profile.layers)
        return 2 * 4 * tiny_profile.parameter_count + saved + tiny_profile.layers[-1].cost(size).output_activation_bytes

    budget = estimate(2) + 1
    profile = profile_model(gpt_tiny, [1, 2, 4, 8], warmup=0, repeats=1, memory_budget_bytes=budget, runtime=False)
    assert profile.micro_batch_sizes == [1, 2]
    assert profile.not_fitting_micro_batch_size == 4
    assert any("micro-batch size 4 does not fit" in note for note in profile.notes)


def test_nothing_fits_is_a_user_error(gpt_tiny):
    with pytest.raises(UserInputError, match="does not fit even at micro-batch size 1"):
        profile_model(gpt_tiny, [1], warmup=0, repeats=1, memory_budget_bytes=1024)


def test_a_batch_larger_than_host_memory_is_not_made(gpt_tiny):
    """-b 99999999 asked make_batch for the whole batch (tens of GB) before anything checked it: the
    host allocated, or swapped, and the error blamed the model's make_batch."""
    from dataclasses import replace

    calls = []
    make_batch = gpt_tiny.make_batch
    gpt_tiny = replace(gpt_tiny, make_batch=lambda size, generator: calls.append(size) or make_batch(size, generator))
    profile = profile_model(gpt_tiny, [1, 99_999_999], warmup=0, repeats=1, runtime=False)
    assert profile.micro_batch_sizes == [1] and profile.not_fitting_micro_batch_size == 99_999_999
    assert 99_999_999 not in calls
    with pytest.raises(UserInputError, match="does not fit even at micro-batch size 99999999") as refused:
        profile_model(gpt_tiny, [99_999_999], warmup=0, repeats=1, runtime=False)
    assert "its batch alone would take" in refused.value.hint and "host memory" in refused.value.hint
    calls.clear()  # the estimate comes from the smallest size asked for: a model may make no batch of 1
    assert profile_model(gpt_tiny, [2, 4], warmup=0, repeats=1, runtime=False).micro_batch_sizes == [2, 4]
    assert 1 not in calls


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"micro_batch_sizes": [0, 2]}, "must be positive, got 0"),
        ({"repeats": 0}, "repeats must be >= 1, got 0"),
        ({"device": "tpu"}, "tpu"),
    ],
)
def test_bad_arguments_are_user_errors(gpt_tiny, kwargs, message):
    with pytest.raises(UserInputError, match=message):
        profile_model(gpt_tiny, **{"micro_batch_sizes": [1], **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_cuda_is_a_clear_error(gpt_tiny):
    with pytest.raises(UserInputError, match="CUDA is not available"):
        profile_model(gpt_tiny, [1], device="cuda")


def test_progress_reports_every_layer_and_size(gpt_tiny):
    seen = []
    profile_model(build_model("mlp-tiny"), [1, 2], warmup=0, repeats=1, progress=seen.append, runtime=False)
    assert [(u.done, u.total) for u in seen] == [(i, 20) for i in range(1, 21)]
    assert seen[-1].layer == "classifier" and seen[-1].micro_batch_size == 2


def test_last_layer_backward_includes_the_loss(gpt_tiny):
    # The head's backward starts from the loss: its saved bytes include what the loss keeps
    # (log-softmax of the b*s*V logits), more than the head's own input and output alone keep.
    profile = profile_model(gpt_tiny, [1], warmup=0, repeats=1, runtime=False)
    head = profile.layers[-1].cost(1)
    logits_bytes = head.output_activation_bytes
    assert head.saved_activation_bytes > logits_bytes


def test_profile_measures_the_engine_runtime_terms_by_default(gpt_tiny):
    # One real engine calibration (a forked one-rank DeepSpeed run, about 3 s): every term is
    # there, positive and of a plausible size for a CPU rank.
    profile = profile_model(gpt_tiny, [1, 2], warmup=0, repeats=1)
    runtime = profile.runtime
    assert runtime is not None, profile.notes
    assert "deepspeed" in runtime.engine and any(note.startswith("runtime terms:") for note in profile.notes)
    for overhead in (runtime.forward_overhead_seconds, runtime.backward_overhead_seconds, runtime.step_fixed_seconds):
        assert 1e-6 < overhead < 0.05
    # AdamW + gradient flattening + copy-back: more than a memory pass, far less than a microsecond.
    assert 1e-10 < runtime.step_seconds_per_parameter < 1e-6
    assert runtime.calibration_parameter_count == profile.parameter_count
    assert [r.micro_batch_size for r in runtime.compute_ratios] == [1, 2]
    # Engine over profiled compute: about 0.5-1.1 on an idle host; a CI host running other tests'
    # ranks beside this one measured 5.5 once. Plausible: within a factor 4 below and 8 above 1.
    for ratio in runtime.compute_ratios:
        assert 0.25 <= ratio.forward_ratio < 8 and 0.25 <= ratio.backward_ratio < 8
    # Two forked ranks measured how they share this host.
    assert runtime.concurrent_ranks == 2 and runtime.concurrent_compute_slowdown >= 1.0
    assert runtime.alone_compute_slowdown >= 1.0
    assert 0.0 <= runtime.busy_handoff_seconds < 0.5
    # ... and how a collective after compute costs: a per-hop latency and, from the two-rank
    # engine's gradient reduction (or the gradient-sized all-reduce), a bus bandwidth.
    assert 0.0 < runtime.busy_allreduce_latency_seconds < 0.5
    assert 1e6 < runtime.busy_allreduce_bandwidth_bytes_per_second < 1e12


def test_forward_flops_are_counted_by_pytorch_on_the_real_forward():
    """The head's matmul is exactly 2·b·s·h·V; a block at least its four GEMMs' 24·b·s·h² (the
    attention's 4·b·s²·h is counted where PyTorch's counter knows the kernel)."""
    from pipectl.models import build_model
    from pipectl.profile.measure import profile_model

    profile = profile_model(build_model("gpt-tiny"), [2], warmup=0, repeats=1, runtime=False)
    h, s, vocab, b = 64, 32, 256, 2
    head = profile.layers[-1].cost(b)
    block = profile.layers[1].cost(b)
    assert head.forward_flops == 2 * b * s * h * vocab
    assert 24 * b * s * h * h <= block.forward_flops <= 24 * b * s * h * h + 4 * b * s * s * h
    assert profile.layers[0].cost(b).forward_flops == 0  # an embedding look-up is no FLOP


# --- one instance of each distinct layer ---------------------------------------------------------


def test_once_measures_one_block_and_gives_its_costs_to_the_identical_ones(gpt_tiny, tiny_profile):
    once = profile_model(gpt_tiny, [1, 2], warmup=1, repeats=2, runtime=False, once=True)
    # embed, block.0, final_norm and head measured; block.1..5 take block.0's costs.
    assert [layer.costs_from for layer in once.layers] == [None, None, 1, 1, 1, 1, 1, None, None]
    for layer in once.layers[2:7]:
        assert layer.costs == once.layers[1].costs
    assert any("block.1, block.2, ..., block.5 (5 layers) reuse block.0" in note for note in once.notes)
    # Everything but the times is exactly what measuring every layer gives.
    assert [layer.costs_from for layer in tiny_profile.layers] == [None] * 9
    assert once.parameter_count == tiny_profile.parameter_count
    for mine, every in zip(once.layers, tiny_profile.layers):
        assert (mine.parameter_count, mine.parameter_bytes, mine.shared_parameter_count) == (
            every.parameter_count, every.parameter_bytes, every.shared_parameter_count
        )
        for a, b in zip(mine.costs, every.costs):
            assert (a.output_activation_bytes, a.saved_activation_bytes, a.peak_memory_bytes, a.forward_flops) == (
                b.output_activation_bytes, b.saved_activation_bytes, b.peak_memory_bytes, b.forward_flops
            ), mine.name


class _Widening(torch.nn.Module):
    """Doubles its input's last dimension: the same definition, a different input shape each time."""

    def forward(self, x):
        return torch.cat([x, x], dim=-1)


class _Growing(torch.nn.Module):
    """Equal constructor arguments, but each instance is wider than the last (state outside the arguments)."""

    built = 0

    def __init__(self) -> None:
        super().__init__()
        _Growing.built += 1
        self.weight = torch.nn.Parameter(torch.ones(_Growing.built))

    def forward(self, x):
        return x * self.weight.sum()


def _toy(layers):
    from pipectl.models.base import ModelLayers

    def make_batch(size, generator):
        return torch.randn(size, 4, generator=generator), torch.randint(0, 4, (size,), generator=generator)

    return ModelLayers(name="toy", layers=layers, make_batch=make_batch, loss_fn=torch.nn.functional.cross_entropy)


class _Scale(torch.nn.Module):
    """Multiplies by a number taken from its argument (a plain value or any object with `.factor`)."""

    def __init__(self, setting) -> None:
        super().__init__()
        self.factor = float(getattr(setting, "factor", setting))

    def forward(self, x):
        return x * self.factor


def test_identical_means_same_kind_arguments_parameter_shapes_and_input_shape():
    from types import SimpleNamespace

    from pipectl.models.base import LayerDef
    from pipectl.models.mlp import DenseReLU
    from pipectl.models.layer_facts import identical_layers

    setting, equal_setting = SimpleNamespace(factor=2), SimpleNamespace(factor=2)
    layers = [
        LayerDef("a", "dense", DenseReLU, (4, 4)),
        LayerDef("b", "dense", DenseReLU, (4, 4)),  # identical to a
        LayerDef("c", "other", DenseReLU, (4, 4)),  # another kind
        LayerDef("d", "dense", DenseReLU, (), {"in_features": 4, "out_features": 4}),  # other arguments
        LayerDef("e", "grow", _Growing),
        LayerDef("f", "grow", _Growing),  # same arguments, other parameter shapes
        LayerDef("s1", "scale", _Scale, (setting,)),
        LayerDef("s2", "scale", _Scale, (setting,)),  # the same object: identical to s1
        LayerDef("s3", "scale", _Scale, (equal_setting,)),  # an equal object is not the same argument
        LayerDef("n1", "scale", _Scale, (2,)),
        LayerDef("n2", "scale", _Scale, (2.0,)),  # 2.0 is not the argument 2
        LayerDef("g", "wide", _Widening),
        LayerDef("h", "wide", _Widening),  # identical definition, but its input is twice as wide
        LayerDef("l", "dense", DenseReLU, (16, 4)),
        LayerDef("m", "dense", DenseReLU, (4, 4)),  # a's twin, but the last layer: its backward has the loss
    ]
    model = _toy(layers)
    assert identical_layers(model) == [0, 0, 2, 3, 4, 5, 6, 6, 8, 9, 10, 11, 11, 13, 0]
    profile = profile_model(model, [1, 2], warmup=0, repeats=1, runtime=False, once=True)
    costs_from = {layer.name: layer.costs_from for layer in profile.layers if layer.costs_from is not None}
    assert costs_from == {"b": 0, "s2": 6}
    assert profile.layers[5].parameter_count == profile.layers[4].parameter_count + 1


def test_a_shape_only_model_is_measured_without_building_it_whole():
    from dataclasses import replace

    from pipectl.models.base import shape_of
    from pipectl.models.transformer import TransformerBlock

    class CountingBlock(TransformerBlock):
        real = 0  # instances with real storage (not on the meta device)

        def __init__(self, *args):
            super().__init__(*args)
            CountingBlock.real += self.qkv.weight.device.type != "meta"

    tiny = build_model("gpt-tiny")
    blocks = [replace(tiny.layers[1], name=f"block.{i}", module_cls=CountingBlock) for i in range(40)]
    model = replace(tiny, layers=[tiny.layers[0], *blocks, *tiny.layers[-2:]], shape_only=True)
    with pytest.raises(UserInputError, match="shape-only"):
        profile_model(model, [1], warmup=0, repeats=1, runtime=False, once=False)
    profile = profile_model(model, [1, 2], warmup=0, repeats=1, once=True)
    assert CountingBlock.real == 1  # one block built for real, 39 only counted on the meta device
    assert profile.parameter_count == shape_of(model).parameter_count
    assert [layer.parameter_count for layer in profile.layers] == shape_of(model).layer_parameter_counts
    assert all(layer.costs_from == 1 for layer in profile.layers[2:41])
    # The engine calibration runs the whole model: skipped, and said so.
    assert profile.runtime is None
    assert any("shape-only" in note and "runtime terms not measured" in note for note in profile.notes)


def test_a_shape_only_model_fits_the_budget_one_layer_at_a_time():
    from dataclasses import replace

    tiny = replace(build_model("gpt-tiny"), shape_only=True)
    every = profile_model(tiny, [1], warmup=0, repeats=1, runtime=False, once=True)
    # The largest measured layer alone: 2 x parameters + saved + output bytes (the CPU peak estimate).
    largest = max(layer.cost(1).peak_memory_bytes for layer in every.layers)
    fits = profile_model(tiny, [1], warmup=0, repeats=1, runtime=False, once=True, memory_budget_bytes=largest)
    assert fits.micro_batch_sizes == [1]
    with pytest.raises(UserInputError, match="does not fit even at micro-batch size 1"):
        profile_model(tiny, [1], warmup=0, repeats=1, runtime=False, once=True, memory_budget_bytes=largest - 1)


def test_device_memory_is_recorded_only_where_the_runtime_reports_it(tiny_profile):
    from pipectl.artifacts.profile import ModelProfile
    from pipectl.profile.measure import device_memory_bytes

    assert tiny_profile.device_memory_bytes is None and device_memory_bytes(torch.device("cpu")) is None
    if torch.cuda.is_available():
        assert device_memory_bytes(torch.device("cuda")) == torch.cuda.get_device_properties(0).total_memory
    # Profiles written before the field existed load, and the field survives a round trip.
    older = tiny_profile.model_dump(mode="json")
    del older["device_memory_bytes"]
    assert ModelProfile.model_validate(older).device_memory_bytes is None
    recorded = tiny_profile.model_copy(update={"device_memory_bytes": 85_520_809_984})
    assert ModelProfile.model_validate_json(recorded.model_dump_json()).device_memory_bytes == 85_520_809_984


def test_blocks_record_their_attention_core_and_other_layers_do_not(tiny_profile):
    # gpt-tiny (h 64, 4 heads, s 32) in fp32 on CPU: scaled_dot_product_attention runs its flash
    # kernel, whose output proj reads as a view, so selective recomputation frees only the fp32
    # log-sum-exp per token and head: b x 4 x 32 x 4 bytes.
    assert tiny_profile.records_attention_core
    for layer in tiny_profile.layers:
        for cost in layer.costs:
            if layer.kind != "transformer_block":
                assert cost.attention_core_saved_bytes is None and cost.attention_core_forward_seconds is None
                continue
            assert cost.attention_core_saved_bytes == cost.micro_batch_size * 4 * 32 * 4
            assert 0 < cost.attention_core_forward_seconds < cost.forward_seconds
