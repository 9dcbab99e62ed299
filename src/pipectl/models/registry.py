"""Build a `ModelLayers` from a shipped name, a YAML path, or a user factory `package.module:factory`."""

from __future__ import annotations

import importlib
import os
import sys
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
from pipectl.paths import resolve_config


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


def from_config(config: ModelConfig) -> ModelLayers:
    if config.shape_only:
        raise UserInputError(
            f"model '{config.name}' is shape-only (too large to build here)",
            hint=f"derive its profile instead: pipectl profile {config.name} --derive --device a100-80gb",
        )
    if config.family is ModelFamily.MLP:
        return mlp_layers(config)
    return transformer_layers(config)


def from_factory(reference: str) -> ModelLayers:
    """`package.module:factory`; see examples/custom_model.py for the contract."""
    module_name, _, attr = reference.partition(":")
    # Resolve modules beside the user, as `python -m` does: the console script's sys.path[0] is
    # the venv's bin/, not the current directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise UserInputError(f"cannot load model factory '{reference}': {exc}") from exc
    result = factory()
    if isinstance(result, ModelLayers):
        return result
    raise UserInputError(
        f"model factory '{reference}' returned {type(result).__name__}, expected pipectl.models.ModelLayers",
        hint="see examples/custom_model.py",
    )


def build_model(reference: str | Path) -> ModelLayers:
    """A shipped name, a YAML path, or `package.module:factory` -> `ModelLayers`."""
    text = str(reference)
    if ":" in text and not Path(text).exists() and not text.endswith((".yaml", ".yml")):
        return from_factory(text)
    return from_config(load_model_config(text))
