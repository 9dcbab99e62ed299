"""User model factories: ModelLayers, or plain modules plus make_batch/loss_fn in the same module."""

from pathlib import Path

import pytest
import torch

from pipectl.errors import UserInputError
from pipectl.models import build_model
from pipectl.models.registry import _sequential_layers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PIPECTL_MODEL_PATH", raising=False)


def test_sequential_factory_becomes_one_layer_per_child():
    model = build_model("examples.sequential_model:build")
    assert [layer.kind for layer in model.layers] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    x, y = model.make_batch(3, torch.Generator().manual_seed(0))
    h = x
    for layer in model.layers:
        h = layer.forward(layer.build(), h)
    assert h.shape == (3, 4)
    assert model.loss_fn(h, y).ndim == 0


def test_sequential_layers_start_from_the_same_weights_whatever_the_global_seed():
    _sequential_layers.cache_clear()
    torch.manual_seed(123)
    first = build_model("examples.sequential_model:build").layers[4].build().inner.weight.detach().clone()
    _sequential_layers.cache_clear()
    torch.manual_seed(456)
    again = build_model("examples.sequential_model:build").layers[4].build().inner.weight.detach().clone()
    assert torch.equal(first, again)


def test_plain_modules_without_batch_maker_are_refused(tmp_path, monkeypatch):
    (tmp_path / "bare_model.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(2, 2))\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError, match="must also define make_batch and loss_fn"):
        build_model("bare_model:build")


def test_factory_returning_something_else_is_refused(tmp_path, monkeypatch):
    (tmp_path / "odd_model.py").write_text("def build():\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError, match="returned int"):
        build_model("odd_model:build")


def test_launch_folder_is_searched(tmp_path, monkeypatch):
    (tmp_path / "far_model.py").write_text(
        "from examples.sequential_model import build, make_batch, loss_fn\n"
    )
    monkeypatch.setenv("PIPECTL_MODEL_PATH", str(tmp_path))
    assert len(build_model("far_model:build").layers) == 5


def test_counting_a_factory_models_shape_first_leaves_real_layers_to_build():
    # shape_of counts parameters on the meta device; the factory's modules are cached per process,
    # so they must not be cached as meta tensors.
    from pipectl.models.base import shape_of
    from pipectl.models.registry import _sequential_layers

    _sequential_layers.cache_clear()
    model = build_model("examples.sequential_model:build")
    assert shape_of(model).parameter_count > 0
    weight = next(model.layers[0].build().parameters())
    assert weight.device.type == "cpu" and not weight.is_meta


LAZY_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

BUILT = []


class Counted(nn.Linear):
    def __init__(self, *args, **kwargs):
        BUILT.append(args)
        super().__init__(*args, **kwargs)


class Table(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.inner = nn.Embedding(vocab, hidden)

    def forward(self, tokens):
        return self.inner(tokens)


def head(table, hidden):
    return F.linear(hidden, table.inner.weight)


def build():
    return [TiedLayerSpec("table", Table, 16, 8, tied_weight_attr="inner.weight"), LayerSpec(Counted, 8, 8),
            TiedLayerSpec("table", Table, 16, 8, forward_fn=head, tied_weight_attr=["inner.weight"])]


def bad():  # spec-shaped, of something that is not a module
    from types import SimpleNamespace

    return [SimpleNamespace(typename=dict, module_args=(), module_kwargs={"a": 1})]


def make_batch(batch_size, generator):
    tokens = torch.randint(0, 16, (batch_size, 4), generator=generator)
    return tokens, tokens


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))
'''


def test_layer_specs_are_built_only_where_a_stage_holds_them(tmp_path, monkeypatch):
    import importlib

    from pipectl.models.base import shape_of

    (tmp_path / "lazy_model.py").write_text(LAZY_MODEL)
    monkeypatch.chdir(tmp_path)
    model = build_model("lazy_model:build")
    built = importlib.import_module("lazy_model").BUILT
    assert built == []  # the factory returned specs: nothing was constructed
    assert [(layer.kind, layer.tie_key, layer.tied_weight_attr) for layer in model.layers] == [
        ("Table", "table", "inner.weight"), ("Counted", None, "weight"), ("Table", "table", "inner.weight"),
    ]  # fmt: skip
    table, middle = model.layers[0].build(), model.layers[1].build()
    assert built == [(8, 8)]  # one layer asked for, one built
    assert shape_of(model).parameter_count == 16 * 8 + 8 * 8 + 8  # the tied table counted once (on meta)
    x, _ = model.make_batch(2, torch.Generator().manual_seed(0))
    logits = model.layers[2].forward(table, middle(table(x)))
    assert logits.shape == (2, 4, 16)
    with pytest.raises(UserInputError, match="layer spec 0 builds <class 'dict'>, not a torch module class"):
        build_model("lazy_model:bad")


def test_the_example_builds_lazily_the_same_layers():
    eager, lazy = build_model("examples.sequential_model:build"), build_model("examples.sequential_model:build_lazily")
    assert [layer.kind for layer in lazy.layers] == [layer.kind for layer in eager.layers]


FAULTY_FACTORIES = '''
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipectl.models import LayerDef, ModelLayers


class Dense(nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x):
        return self.linear(x)


def batch(size, generator):
    x = torch.randn(size, 16, generator=generator)
    return x, x[:, :4].argmax(1)


def loss(out, y):
    return F.cross_entropy(out, y)


def model(layers, make_batch=batch, loss_fn=loss):
    return ModelLayers(name="faulty", layers=layers, make_batch=make_batch, loss_fn=loss_fn)


def unchained():
    return model([LayerDef("inp", "dense", Dense, (16, 32)), LayerDef("head", "head", Dense, (64, 4))])


def bad_batch():
    return model([LayerDef("inp", "dense", Dense, (16, 4))], make_batch=lambda size: (None, None))


def bad_loss():
    return model([LayerDef("inp", "dense", Dense, (16, 4))], loss_fn=lambda out, y: out.foo())
'''


@pytest.mark.parametrize("factory, said", [
    ("unchained", "error: layer 1 (head) raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("bad_batch", "error: the model's make_batch(1, generator) raised TypeError:"),
    ("bad_loss", "error: the model's loss_fn raised AttributeError: 'Tensor' object has no attribute 'foo'"),
])  # fmt: skip
def test_a_factory_models_own_code_failing_as_it_is_profiled_is_one_line_and_exit_2(tmp_path, factory, said):
    """The user's layers, batch maker or loss raising on the first run: one line naming which and the
    error, exit 2, nothing written (it was a traceback through pipectl's measuring code, exit 1)."""
    from cli_process import pipectl, said as output

    (tmp_path / "faulty.py").write_text(FAULTY_FACTORIES)
    done = pipectl("profile", f"faulty:{factory}", "-b", "1", "-o", "profile.json", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().startswith(said), output(done)
    assert "Traceback" not in output(done) and not (tmp_path / "profile.json").exists()



EXITING_FACTORIES = {
    "exiting.py": "import sys\n\n\ndef exits():\n    sys.exit(3)\n",
    # a training script's own command line, read as it is imported: pipectl's
    "scripted.py": "import argparse\n\nargparse.ArgumentParser().parse_args()\n\n\ndef model():\n    pass\n",
}


@pytest.mark.parametrize("reference, said", [
    ("exiting:exits", "error: model factory 'exiting:exits' called sys.exit(3)"),
    ("scripted:model", "error: module 'scripted' of model factory 'scripted:model' called sys.exit(2) as it was imported"),
])  # fmt: skip
def test_a_factory_that_calls_sys_exit_is_named_not_a_silent_exit(tmp_path, reference, said):
    """A factory's module or function ending the process (a script's argument parsing at import
    reads pipectl's command line) ended pipectl with its code and no word of pipectl's."""
    from cli_process import pipectl, said as output

    for name, text in EXITING_FACTORIES.items():
        (tmp_path / name).write_text(text)
    done = pipectl("profile", reference, cwd=tmp_path)
    assert done.returncode == 2 and said in done.stderr, output(done)
    assert '`if __name__ == "__main__":`' in " ".join(done.stderr.split()), output(done)
