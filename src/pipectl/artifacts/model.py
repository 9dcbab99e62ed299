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
    # The shape of a Hugging Face decoder (models/hf.py `model_config`); the defaults are GPT-2's,
    # the only block pipectl's built-in layers build.
    kv_heads: int | None = Field(
        default=None, gt=0, le=MAX_WIDTH,
        description="Key/value heads (grouped-query attention: separate q, k, v projections); None: one fused QKV of all heads.",
    )
    ffn_hidden: int | None = Field(default=None, gt=0, le=MAX_WIDTH, description="MLP inner width; None: ffn_multiplier x hidden.")
    activation: Literal["gelu", "gelu_python", "swiglu"] = Field(
        default="gelu",
        description="MLP: gelu (one fused kernel), gelu_python (GPT-2's tanh GELU as eager element-wise ops), "
        "swiglu (Llama: gate and up projections, SiLU(gate) x up, down).",
    )
    norm: Literal["layer", "rms"] = Field(default="layer", description="LayerNorm (weight, bias) or RMSNorm (weight).")
    linear_bias: bool = Field(default=True, description="Linear layers carry biases.")
    rotary: bool = Field(default=False, description="Rotary position embeddings (no position table).")
    input_dim: int | None = Field(default=None, gt=0, le=MAX_WIDTH, description="MLP input features (mlp family).")
    classes: int | None = Field(default=None, gt=0, le=MAX_WIDTH, description="MLP output classes (mlp family).")
    shape_only: bool = Field(
        default=False, description="Too large to build here: only derived profiles use this config."
    )

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        if self.family in (ModelFamily.GPT, ModelFamily.BERT) and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} are not a multiple of kv_heads {self.kv_heads}")
        return self

    @property
    def mlp_width(self) -> int:
        return self.ffn_hidden or self.ffn_multiplier * self.hidden

    @property
    def builtin_block(self) -> bool:
        """Whether pipectl's own layers build this shape (GPT-2's block), not only hf: ones."""
        return (self.kv_heads, self.ffn_hidden, self.activation, self.norm, self.linear_bias, self.rotary) == (
            None, None, "gelu", "layer", True, False,
        )  # fmt: skip

    def layer_parameter_counts(self) -> list[int]:
        """Parameters of every layer the config builds, in order, from its shape alone (nothing is
        allocated): what the model will weigh before anyone builds it.

        Transformers: the embedding V*h + s*h; each block (4 + 2f)h^2 + (9 + f)h (attention
        4h^2 + 4h, MLP 2f*h^2 + (f + 1)h, two LayerNorms 4h; 12h^2 + 13h at f = 4, Narayanan et al. 2021, §5.1); the
        final LayerNorm 2h; the head V*h (a tied head holds its copy of the table). MLP: the input
        projection, `layers` hidden h x h layers and the classifier, each with its bias.

            >>> ModelConfig(name="x", family="gpt", layers=2, hidden=64, heads=4, seq_len=32, vocab=256).layer_parameter_counts()
            [18432, 49984, 49984, 128, 16384]
        """
        h = self.hidden
        if self.family is ModelFamily.MLP:
            inputs, classes = self.input_dim or h, self.classes or 10
            return [inputs * h + h, *([h * h + h] * self.layers), h * classes + classes]
        norm = h if self.norm == "rms" else 2 * h
        positions = 0 if self.rotary else self.seq_len * h
        return [self.vocab * h + positions, *([self.block_parameters()] * self.layers), norm, self.vocab * h]

    def block_parameters(self) -> int:
        """One transformer block: attention (q, k, v, output; k and v of kv_heads), the MLP (two
        matrices, or three with swiglu), two norms; biases where `linear_bias`.

            >>> ModelConfig(name="x", family="gpt", layers=1, hidden=64, heads=4).block_parameters() == 12 * 64**2 + 13 * 64
            True
        """
        h, i = self.hidden, self.mlp_width
        kv = (self.kv_heads or self.heads) * (h // self.heads)
        attention = 2 * h * h + 2 * h * kv + ((2 * h + 2 * kv) if self.linear_bias else 0)
        if self.activation == "swiglu":
            mlp = 3 * h * i + ((2 * i + h) if self.linear_bias else 0)
        else:
            mlp = 2 * h * i + ((i + h) if self.linear_bias else 0)
        return attention + mlp + 2 * (h if self.norm == "rms" else 2 * h)
