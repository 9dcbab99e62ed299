"""Model configuration (configs/models/*.yaml): which family, which shape."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, model_validator

from pipectl.artifacts.base import Artifact


# Bounds of a shape: the deepest published transformers have ~100 blocks (GPT-3 175B: 96; Megatron's
# 1 T: 128) and the widest a hidden size of 25,600; one layer description per block is built even
# for a shape-only model, so the depth is bounded far below what would exhaust memory.
MAX_LAYERS = 10_000
MAX_WIDTH = 2**20


class ModelFamily(str, Enum):
    GPT = "gpt"
    BERT = "bert"
    MLP = "mlp"


class ModelConfig(Artifact):
    """A built-in model: a family and its shape. Shape-only configs are used for derived profiles."""

    schema_version: Literal[1] = 1
    name: str = Field(min_length=1, max_length=200, description="Short name, e.g. 'gpt-tiny'.")
    family: ModelFamily = Field(description="gpt (decoder), bert (encoder) or mlp (plain stack).")
    layers: int = Field(gt=0, le=MAX_LAYERS, description="Repeated blocks (transformer layers or MLP hidden layers).")
    hidden: int = Field(gt=0, le=MAX_WIDTH, description="Hidden size h.")
    heads: int = Field(default=1, gt=0, le=MAX_WIDTH, description="Attention heads (transformers).")
    seq_len: int = Field(default=1, gt=0, le=MAX_WIDTH, description="Sequence length s (transformers).")
    vocab: int = Field(default=1, gt=0, le=MAX_WIDTH, description="Vocabulary size V (transformers).")
    ffn_multiplier: int = Field(default=4, gt=0, le=64, description="MLP width as a multiple of hidden.")
    tied_embeddings: bool = Field(default=True, description="Share input embedding and output head.")
    input_dim: int | None = Field(default=None, gt=0, le=MAX_WIDTH, description="MLP input features (mlp family).")
    classes: int | None = Field(default=None, gt=0, le=MAX_WIDTH, description="MLP output classes (mlp family).")
    shape_only: bool = Field(
        default=False, description="Too large to build here: only derived profiles use this config."
    )

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        if self.family in (ModelFamily.GPT, ModelFamily.BERT) and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        return self

    def layer_parameter_counts(self) -> list[int]:
        """Parameters of every layer the config builds, in order, from its shape alone (nothing is
        allocated): what the model will weigh before anyone builds it.

        Transformers: the embedding V*h + s*h; each block (4 + 2f)h^2 + (9 + f)h (attention
        4h^2 + 4h, MLP 2f*h^2 + (f + 1)h, two LayerNorms 4h; 12h^2 + 13h at f = 4, SPEC §3); the
        final LayerNorm 2h; the head V*h (a tied head holds its copy of the table). MLP: the input
        projection, `layers` hidden h x h layers and the classifier, each with its bias.

            >>> ModelConfig(name="x", family="gpt", layers=2, hidden=64, heads=4, seq_len=32, vocab=256).layer_parameter_counts()
            [18432, 49984, 49984, 128, 16384]
        """
        h, f = self.hidden, self.ffn_multiplier
        if self.family is ModelFamily.MLP:
            inputs, classes = self.input_dim or h, self.classes or 10
            return [inputs * h + h, *([h * h + h] * self.layers), h * classes + classes]
        block = (4 + 2 * f) * h * h + (9 + f) * h
        return [self.vocab * h + self.seq_len * h, *([block] * self.layers), 2 * h, self.vocab * h]
