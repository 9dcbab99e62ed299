"""Model configuration (configs/models/*.yaml): which family, which shape."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, model_validator

from pipectl.artifacts.base import Artifact


class ModelFamily(str, Enum):
    GPT = "gpt"
    BERT = "bert"
    MLP = "mlp"


class ModelConfig(Artifact):
    """A built-in model: a family and its shape. Shape-only configs are used for derived profiles."""

    schema_version: Literal[1] = 1
    name: str = Field(description="Short name, e.g. 'gpt-tiny'.")
    family: ModelFamily = Field(description="gpt (decoder), bert (encoder) or mlp (plain stack).")
    layers: int = Field(gt=0, description="Repeated blocks (transformer layers or MLP hidden layers).")
    hidden: int = Field(gt=0, description="Hidden size h.")
    heads: int = Field(default=1, gt=0, description="Attention heads (transformers).")
    seq_len: int = Field(default=1, gt=0, description="Sequence length s (transformers).")
    vocab: int = Field(default=1, gt=0, description="Vocabulary size V (transformers).")
    ffn_multiplier: int = Field(default=4, gt=0, description="MLP width as a multiple of hidden.")
    tied_embeddings: bool = Field(default=True, description="Share input embedding and output head.")
    input_dim: int | None = Field(default=None, gt=0, description="MLP input features (mlp family).")
    classes: int | None = Field(default=None, gt=0, description="MLP output classes (mlp family).")
    shape_only: bool = Field(
        default=False, description="Too large to build here: only derived profiles use this config."
    )

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        if self.family in (ModelFamily.GPT, ModelFamily.BERT) and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        return self
