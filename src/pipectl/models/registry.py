"""Build a `ModelLayers` from a shipped name, a YAML path, or a user factory `package.module:factory`."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from pipectl.artifacts.model import ModelConfig, ModelFamily
from pipectl.errors import UserInputError
from pipectl.io import load_model
from pipectl.models.base import LayerDef, ModelLayers

from pipectl.models.mlp import Classifier, DenseReLU, classification_loss
from pipectl.models.transformer import (
    Embedding,
    FinalNorm,
    TransformerBlock,
    lm_loss,
    tied_head_forward,
)
from pipectl.paths import factory_search_path, resolve_config


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A shipped model name (`gpt-tiny`) or a YAML path -> validated `ModelConfig`."""
    return load_model(ModelConfig, resolve_config(name_or_path, "models"))


def _token_batch(vocab: int, seq_len: int, batch_size: int, generator: torch.Generator):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def transformer_layers(config: ModelConfig) -> ModelLayers:
    """GPT (causal) or BERT (bidirectional) as embed, blocks, final_norm, head."""
    causal = config.family is ModelFamily.GPT
    embed_args = (config.vocab, config.hidden, config.seq_len)
    layers = [
        LayerDef("embed", "embedding", Embedding, embed_args, tie_key="embed" if config.tied_embeddings else None)
    ]
    for i in range(config.layers):
        layers.append(
            LayerDef(
                f"block.{i}",
                "transformer_block",
                TransformerBlock,
                (config.hidden, config.heads, config.ffn_multiplier, causal),
            )
        )
    layers.append(LayerDef("final_norm", "layer_norm", FinalNorm, (config.hidden,)))
    if config.tied_embeddings:
        layers.append(
            LayerDef("head", "lm_head", Embedding, embed_args, tie_key="embed", tied_forward=tied_head_forward)
        )
    else:
        layers.append(LayerDef("head", "lm_head", nn.Linear, (config.hidden, config.vocab), {"bias": False}))
    return ModelLayers(
        name=config.name,
        layers=layers,
        make_batch=partial(_token_batch, config.vocab, config.seq_len),
        loss_fn=lm_loss,
        seq_len=config.seq_len,
        hidden=config.hidden,
        vocab=config.vocab,
    )


def _mlp_batch(input_dim: int, classes: int, batch_size: int, generator: torch.Generator):
    inputs = torch.randn(batch_size, input_dim, generator=generator)
    labels = torch.randint(0, classes, (batch_size,), generator=generator)
    return inputs, labels


def mlp_layers(config: ModelConfig) -> ModelLayers:
    input_dim = config.input_dim or config.hidden
    classes = config.classes or 10
    layers = [LayerDef("input", "dense", DenseReLU, (input_dim, config.hidden))]
    layers += [
        LayerDef(f"hidden.{i}", "dense", DenseReLU, (config.hidden, config.hidden)) for i in range(config.layers)
    ]
    layers.append(LayerDef("classifier", "classifier", Classifier, (config.hidden, classes)))
    return ModelLayers(
        name=config.name,
        layers=layers,
        make_batch=partial(_mlp_batch, input_dim, classes),
        loss_fn=classification_loss,
    )


def from_config(config: ModelConfig, *, allow_shape_only: bool = False) -> ModelLayers:
    """The layer list of a config. A shape-only config is refused unless `allow_shape_only`: the
    list itself builds nothing, but it must only be built one layer at a time (marked `shape_only`)."""
    if config.shape_only and not allow_shape_only:
        raise UserInputError(
            f"model '{config.name}' is shape-only (too large to build here)",
            hint=f"derive its profile instead: pipectl profile {config.name} --derive --device a100-80gb; "
            f"or measure one instance of each distinct layer: pipectl profile {config.name} --once",
        )
    layers = mlp_layers(config) if config.family is ModelFamily.MLP else transformer_layers(config)
    return replace(layers, shape_only=config.shape_only)


def _import_factory(reference: str):
    module_name, _, attr = reference.partition(":")
    # Resolve modules beside the user, as `python -m` does: the console script's sys.path[0] is
    # the venv's bin/, not the current directory.
    for folder in factory_search_path():
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
        return module, getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise UserInputError(f"cannot load model factory '{reference}': {exc}") from exc


@functools.lru_cache(maxsize=None)
def _sequential_layers(reference: str) -> tuple[nn.Module, ...]:
    """The modules a factory returns as an `nn.Sequential` or a list, built once per process.

    Built under a fixed seed, whichever layer asks first, so every pipeline rank of every layout
    holds the same initial weights.
    """
    _, factory = _import_factory(reference)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        result = factory()
    return tuple(result)


class FactoryLayer(nn.Module):
    """Layer `index` of a factory that returns plain modules; built from plain values on each rank."""

    def __init__(self, reference: str, index: int) -> None:
        super().__init__()
        self.inner = _sequential_layers(reference)[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def from_factory(reference: str) -> ModelLayers:
    """`package.module:factory`; see examples/custom_model.py for the contract.

    The factory returns a `ModelLayers`, or an `nn.Sequential` / list of modules; in the latter
    case its module must also define `make_batch(batch_size, generator)` and `loss_fn(output,
    labels)` (examples/sequential_model.py).
    """
    module, factory = _import_factory(reference)
    if isinstance(factory, type) and issubclass(factory, nn.Module):
        raise UserInputError(f"model factory '{reference}' is a module class; give a function that builds the model")
    probe = factory()
    if isinstance(probe, ModelLayers):
        return probe
    if isinstance(probe, (nn.Sequential, list, tuple)) and all(isinstance(m, nn.Module) for m in probe):
        missing = [name for name in ("make_batch", "loss_fn") if not callable(getattr(module, name, None))]
        if missing:
            raise UserInputError(
                f"model factory '{reference}' returns plain modules, so {module.__name__} must also "
                f"define {' and '.join(missing)}",
                hint="see examples/sequential_model.py",
            )
        layers = [
            LayerDef(f"layer.{i}", type(m).__name__, FactoryLayer, (reference, i)) for i, m in enumerate(probe)
        ]
        if not layers:
            raise UserInputError(f"model factory '{reference}' returned no layers")
        return ModelLayers(name=reference, layers=layers, make_batch=module.make_batch, loss_fn=module.loss_fn)
    raise UserInputError(
        f"model factory '{reference}' returned {type(probe).__name__}, expected pipectl.models.ModelLayers, "
        "an nn.Sequential or a list of modules",
        hint="see examples/custom_model.py",
    )


def build_model(reference: str | Path, *, allow_shape_only: bool = False) -> ModelLayers:
    """A shipped name, a YAML path, or `package.module:factory` -> `ModelLayers`.

    `allow_shape_only` lets a shape-only config through, marked `ModelLayers.shape_only` (for
    the profiler's one-instance mode, which builds one layer of each kind, never the whole model).
    """
    text = str(reference)
    if ":" in text and not Path(text).exists() and not text.endswith((".yaml", ".yml")):
        return from_factory(text)
    return from_config(load_model_config(text), allow_shape_only=allow_shape_only)
