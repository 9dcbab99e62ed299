"""The model zoo: every shipped buildable model runs; attention direction per family; factories."""

from __future__ import annotations

import os

import pytest
import torch

from pipectl.errors import UserInputError
from pipectl.models import ModelLayers, build_model
from pipectl.models.registry import load_model_config
from pipectl.paths import configs_dir

SHIPPED = sorted(p.stem for p in (configs_dir() / "models").glob("*.yaml"))
BUILDABLE = [name for name in SHIPPED if not load_model_config(name).shape_only]
SHAPE_ONLY = [name for name in SHIPPED if load_model_config(name).shape_only]
SMALL_BATCH = 1
# gpt-small's full 1024-token forward takes ~4 s on one core: CI runs its first tokens (position
# embeddings accept any prefix), the slow suite the full length.
QUICK_TOKENS = 64


def _run(model: ModelLayers, inputs: torch.Tensor) -> torch.Tensor:
    """Forward through the layer list, tied layers sharing one module as on one pipeline stage."""
    shared: dict[str, torch.nn.Module] = {}
    x = inputs
    for layer in model.layers:
        if layer.tie_key and layer.tie_key in shared:
            module = shared[layer.tie_key]
        else:
            module = layer.build()
            if layer.tie_key:
                shared[layer.tie_key] = module
        x = layer.forward(module, x)
    return x


def test_the_zoo_ships_what_the_issue_asks_for():
    assert {"gpt-tiny", "gpt-small", "bert-tiny", "mlp-tiny"} <= set(BUILDABLE)
    assert {"gpt2-2.5b", "gpt3-175b", "gpt-1t"} <= set(SHAPE_ONLY)


def _forward_and_loss(name: str, tokens: int | None) -> None:
    torch.manual_seed(0)
    model = build_model(name)
    inputs, labels = model.make_batch(SMALL_BATCH, torch.Generator().manual_seed(0))
    if tokens is not None and model.seq_len is not None and model.seq_len > tokens:
        inputs, labels = inputs[:, :tokens], labels[:, :tokens]
    with torch.no_grad():
        output = _run(model, inputs)
        loss = model.loss_fn(output, labels)
    assert output.shape[0] == SMALL_BATCH
    if model.vocab is not None:
        assert output.shape == (SMALL_BATCH, inputs.shape[1], model.vocab)
    assert loss.ndim == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", BUILDABLE)
def test_every_buildable_model_runs_forward_and_gives_a_finite_loss(name):
    _forward_and_loss(name, QUICK_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILDABLE)
def test_every_buildable_model_runs_its_full_sequence(name):
    _forward_and_loss(name, None)


@pytest.mark.parametrize("name", SHAPE_ONLY)
def test_shape_only_models_refuse_to_build_and_point_at_derive(name):
    with pytest.raises(UserInputError, match="shape-only") as info:
        build_model(name)
    assert "--derive" in (info.value.hint or "")


def _position_zero_output(name: str, last_token: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = build_model(name)
    tokens, _ = model.make_batch(1, torch.Generator().manual_seed(0))
    tokens = tokens.clone()
    tokens[0, -1] = last_token
    with torch.no_grad():
        return _run(model, tokens)[0, 0]


def test_bert_is_bidirectional():
    # Changing the last token changes the output at position 0.
    first, second = _position_zero_output("bert-tiny", 3), _position_zero_output("bert-tiny", 7)
    assert not torch.allclose(first, second)


def test_gpt_is_causal():
    # Changing the last token leaves position 0 untouched.
    first, second = _position_zero_output("gpt-tiny", 3), _position_zero_output("gpt-tiny", 7)
    assert torch.equal(first, second)


def test_unknown_model_is_a_user_error_naming_it():
    with pytest.raises(UserInputError, match="no-such-model"):
        build_model("no-such-model")


def test_user_factory_from_the_current_directory(monkeypatch):
    repo_root = configs_dir().parent
    monkeypatch.chdir(repo_root)
    model = build_model("examples.custom_model:build")
    assert isinstance(model, ModelLayers) and model.name == "residual-mlp"
    inputs, labels = model.make_batch(2, torch.Generator().manual_seed(0))
    assert model.loss_fn(_run(model, inputs), labels).ndim == 0
    assert os.getcwd() == str(repo_root)


def test_missing_factory_is_a_user_error():
    with pytest.raises(UserInputError, match="cannot load model factory 'examples.custom_model:nope'"):
        build_model("examples.custom_model:nope")


def test_a_config_of_a_block_pipectl_does_not_build_is_refused_but_derives(tmp_path):
    from pipectl.catalog import get_device
    from pipectl.models.registry import from_config
    from pipectl.profile.derive import derive_profile

    config = load_model_config("gpt-tiny").model_copy(update={"activation": "swiglu", "norm": "rms", "rotary": True})
    for shape_only in (False, True):
        with pytest.raises(UserInputError, match="a block pipectl's own layers do not build") as caught:
            from_config(config.model_copy(update={"shape_only": shape_only}), allow_shape_only=True)
        assert "--derive" in caught.value.hint and "hf:PATH" in caught.value.hint
    profile = derive_profile(config, get_device("a100-80gb"), [1])
    assert [layer.parameter_count for layer in profile.layers] == config.layer_parameter_counts()


def test_counting_a_models_shape_on_the_meta_device_starts_nothing_heavy():
    """`shape_of` runs in every launch's pre-flight: an embedding's normal initialiser on the meta
    device would import torch._dynamo (seconds of a command's start) to draw nothing."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pipectl.models import build_model\n"
        "from pipectl.models.base import shape_of\n"
        "assert shape_of(build_model('gpt-tiny')).parameter_count > 0\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_real_tensors_are_initialised_as_ever_inside_a_meta_build():
    """Only meta tensors skip the normal initialisers (another thread may build a real model
    meanwhile), and `torch.nn.init` is itself again afterwards."""
    from pipectl.models.base import on_meta_device

    before = torch.nn.init.normal_
    with on_meta_device():
        embedding = torch.nn.Embedding(8, 4)
        real = torch.nn.init.normal_(torch.zeros(64, device="cpu"))
        kaiming = torch.nn.init.kaiming_normal_(torch.zeros(8, 8, device="cpu"))
    assert embedding.weight.is_meta
    assert real.std() > 0 and kaiming.std() > 0
    assert torch.nn.init.normal_ is before
