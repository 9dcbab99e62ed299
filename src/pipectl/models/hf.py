"""A Hugging Face `transformers` decoder as a cuttable layer list: `hf:PATH`.

PATH is a directory holding a `config.json` (or the file itself), optionally with the weights to
start from (`model.safetensors`, or shards listed in `model.safetensors.index.json`) and a
`tokenizer.json` that text data is tokenized with (`runtime.data.TextFileSource`). Nothing is
downloaded and nothing executable is read: the config is JSON, the weights are safetensors, and
`trust_remote_code` is never set, so only the model classes that ship with `transformers` are used.
Supported families (`model_type`): `gpt2` and `llama`. The layers are the family's own modules:

    embed (token table; GPT-2 adds learned positions)
      -> decoder layer 0 .. L-1 (GPT2Block / LlamaDecoderLayer; Llama's rotary embedding is
         computed inside each layer from its own positions, a buffer and no parameters)
      -> final norm (LayerNorm / RMSNorm)
      -> head (tied to the token table when the config says `tie_word_embeddings`)

Each layer is built on the rank that runs it, from the path and its index only: a rank builds
and reads the weights of its own stage. Attention runs through PyTorch's scaled_dot_product_attention
(`attn_implementation="sdpa"`, causal because no mask is passed: every sample is a full window). Every
layer's parameters keep the names they have in the Hugging Face model (`hf_name`), so a checkpoint
exports back to a directory `transformers` loads (`export_hf`).

Dropout follows the config (GPT-2's default is 0.1): then losses depend on the random stream, which
differs between layouts; set the dropouts to 0 for losses that match across layouts to the last bit.

`transformers` is an optional dependency: `pip install 'pipectl[hf]'`.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from pipectl.errors import UserInputError
from pipectl.io import validation_message
from pipectl.models.base import LayerDef, ModelLayers, on_meta_device
from pipectl.models.transformer import lm_loss
from pipectl.paths import HF_CONFIG_FILE, HF_PREFIX, hf_model_dir, hf_tokenizer_file

SUPPORTED = ("gpt2", "llama")
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserInputError(
            "a Hugging Face model needs the transformers package", hint="pip install 'pipectl[hf]'"
        ) from None
    return transformers


@functools.lru_cache(maxsize=None)
def hf_config(directory: str):
    """The directory's config (transformers' own class for its model_type), attention through SDPA."""
    transformers = _transformers()
    path = Path(directory) / HF_CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserInputError(f"cannot read {path}: {exc}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED:
        raise UserInputError(
            f"{path}: model_type {model_type!r} is not a supported Hugging Face family",
            hint=f"supported: {', '.join(SUPPORTED)}",
        )
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except Exception as exc:  # transformers and huggingface_hub raise their own validation errors
        raise UserInputError(f"{path}: not a valid {model_type} config: {exc}") from None
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    bad = next((name for name in sizes if not isinstance(getattr(config, name, None), int) or getattr(config, name) < 1), None)
    if bad is not None:
        raise UserInputError(f"{path}: {bad} is {getattr(config, bad, None)!r}, not a positive whole number")
    config._attn_implementation = "sdpa"
    return config


def _is_gpt2(config) -> bool:
    return config.model_type == "gpt2"


def _base(config) -> str:
    """The decoder's attribute in the *ForCausalLM model: 'transformer' (GPT-2) or 'model'."""
    return "transformer" if _is_gpt2(config) else "model"


def _modeling(config):
    transformers = _transformers()
    if _is_gpt2(config):
        return transformers.models.gpt2.modeling_gpt2
    return transformers.models.llama.modeling_llama


def sequence_length(config) -> int:
    return config.n_positions if _is_gpt2(config) else config.max_position_embeddings


# --------------------------------------------------------------------------- weights


@functools.lru_cache(maxsize=None)
def _weight_files(directory: str) -> dict[str, str]:
    """Tensor name -> safetensors file holding it; {} when the directory has no weights."""
    folder = Path(directory)
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserInputError(f"cannot read {index}: {exc}") from None
        outside = next((file for file in mapping.values() if not isinstance(file, str) or Path(file).name != file), None)
        if outside is not None:
            raise UserInputError(f"{index} names {outside!r}, not a file of {folder}")
        return {name: str(folder / file) for name, file in mapping.items()}
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        if pickled:
            raise UserInputError(
                f"{folder} holds its weights as {pickled[0]}, a pickle (loading one can run code): pipectl reads "
                "safetensors only, and would otherwise start from random weights",
                hint="convert them once where you trust the file: model.save_pretrained(folder, safe_serialization=True)",
            )
        return {}
    return {name: str(single) for name in _safetensors_names(single)}


def _safetensors_names(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise UserInputError(f"{path} cannot be read as safetensors: {exc}") from None


def _load(module: nn.Module, directory: str, names: dict[str, str]) -> bool:
    """Copy the stored tensors named `names` (local -> Hugging Face name) into `module`; False when
    the directory has no weights. A missing or misshapen tensor is named."""
    files = _weight_files(directory)
    if not files:
        return False
    from safetensors import safe_open

    state = module.state_dict()
    for local, stored in names.items():
        candidates = [stored, stored.partition(".")[2]]  # some GPT-2 files drop the 'transformer.' prefix
        found = next((n for n in candidates if n in files), None)
        if found is None:
            raise UserInputError(f"{directory}: the weights hold no tensor {stored!r}")
        try:
            with safe_open(files[found], framework="pt") as handle:
                tensor = handle.get_tensor(found)
        except Exception as exc:  # a missing shard, a damaged file
            raise UserInputError(f"{directory}: cannot read {found!r} from {files[found]}: {exc}") from None
        if tuple(tensor.shape) != tuple(state[local].shape):
            raise UserInputError(
                f"{directory}: tensor {found!r} has shape {tuple(tensor.shape)}, the config gives {tuple(state[local].shape)}"
            )
        with torch.no_grad():
            state[local].copy_(tensor)
    return True


def _initialise(module: nn.Module, config) -> None:
    """transformers' initialisation (`_init_weights`): normal(0, initializer_range) weights, zero
    biases, unit norms; GPT-2 scales each residual projection by 1/sqrt(2 L)."""
    std = config.initializer_range
    conv1d = getattr(_modeling(config), "Conv1D", ())
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)) or (conv1d and isinstance(sub, conv1d)):
                scale = 1 / math.sqrt(2 * config.num_hidden_layers) if _is_gpt2(config) and name.endswith("c_proj") else 1.0
                nn.init.normal_(sub.weight, 0.0, std * scale)  # (skipped on the meta device: `on_meta_device`)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()
            elif hasattr(sub, "weight") and isinstance(sub.weight, nn.Parameter) and sub.weight.dim() == 1:
                sub.weight.fill_(1.0)  # LayerNorm, RMSNorm
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()


class HFLayer(nn.Module):
    """A layer of a Hugging Face model; `hf_prefix` + a parameter's name is its name there."""

    hf_prefix = ""

    def hf_names(self) -> dict[str, str]:
        return {name: self.hf_prefix + name for name in self.state_dict() if not name.endswith("inv_freq")}

    def _start(self, directory: str, config) -> None:
        """The stored weights if the directory has them, else transformers' initialisation (the
        caller seeds it); nothing on the meta device, where only names and shapes are asked for."""
        if any(p.is_meta for p in self.parameters()):
            return
        if not _load(self, directory, self.hf_names()):
            _initialise(self, config)


class HFEmbedding(HFLayer):
    def __init__(self, directory: str) -> None:
        super().__init__()
        config = hf_config(directory)
        self.gpt2 = _is_gpt2(config)
        self.hf_prefix = _base(config) + "."
        if self.gpt2:
            self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
            self.wpe = nn.Embedding(config.n_positions, config.hidden_size)
            self.drop = nn.Dropout(config.embd_pdrop)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self._start(directory, config)

    @property
    def table(self) -> nn.Parameter:
        return self.wte.weight if self.gpt2 else self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.gpt2:
            return self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class HFDecoderLayer(HFLayer):
    """A decoder layer; with a `tensor_group` of t ranks, Megatron's split of its own modules
    (`_split`): the t = 1 weights are built (or read) whole, then each rank keeps its slices."""

    splits_over_tensor_group = True  # models.tensor_parallel.shard_model passes the group

    def __init__(self, directory: str, index: int, tensor_group=None) -> None:
        super().__init__()
        config = hf_config(directory)
        modeling = _modeling(config)
        self.gpt2 = _is_gpt2(config)
        if self.gpt2:
            self.layer = modeling.GPT2Block(config, layer_idx=index)
            self.hf_prefix = f"transformer.h.{index}."
        else:
            self.layer = modeling.LlamaDecoderLayer(config, index)
            self.rotary = modeling.LlamaRotaryEmbedding(config=config)
            self.hf_prefix = f"model.layers.{index}."
        self._start(directory, config)
        if tensor_group is not None and tensor_group.size > 1:
            self._split(config, tensor_group)

    def _split(self, config, group) -> None:
        """Column-parallel q, k, v (GPT-2's fused c_attn: [q_r; k_r; v_r]) and the MLP's first
        matrices, row-parallel output projections with their all-reduce; the all-reduce of the
        input gradient on each norm's output (f). Parameter names do not change, so checkpoints
        join and cut the slices for any t (`TensorSplit`). Heads, key/value heads and the MLP
        width must divide by t; dropout must be 0 (the ranks would draw different masks)."""
        from pipectl.models.tensor_parallel import ColumnSlice, RowSlice, copy_to_tensor_group

        t = group.size
        kv_heads = config.num_attention_heads if self.gpt2 else config.num_key_value_heads
        width = (config.n_inner or 4 * config.hidden_size) if self.gpt2 else config.intermediate_size
        for what, value in (("attention heads", config.num_attention_heads), ("key/value heads", kv_heads), ("MLP width", width)):
            if value % t:
                raise UserInputError(f"the {what} ({value}) do not divide by tensor-parallel degree {t}")
        dropouts = ("resid_pdrop", "attn_pdrop", "embd_pdrop") if self.gpt2 else ("attention_dropout",)
        if any(getattr(config, name, 0.0) for name in dropouts):
            raise UserInputError(
                f"tensor parallelism of a Hugging Face layer needs dropout 0 ({', '.join(dropouts)} in its config)",
                hint="set them to 0.0 in config.json, or plan with --tensor-parallel 1",
            )
        if self.gpt2:
            attention, mlp = self.layer.attn, self.layer.mlp
            attention.c_attn = ColumnSlice(attention.c_attn, group, parts=3)
            attention.c_proj = RowSlice(attention.c_proj, group)
            attention.split_size = attention.embed_dim // t
            mlp.c_fc, mlp.c_proj = ColumnSlice(mlp.c_fc, group), RowSlice(mlp.c_proj, group)
            norms = (self.layer.ln_1, self.layer.ln_2)
        else:
            attention, mlp = self.layer.self_attn, self.layer.mlp
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attention, name, ColumnSlice(getattr(attention, name), group))
            attention.o_proj = RowSlice(attention.o_proj, group)
            mlp.gate_proj, mlp.up_proj = ColumnSlice(mlp.gate_proj, group), ColumnSlice(mlp.up_proj, group)
            mlp.down_proj = RowSlice(mlp.down_proj, group)
            norms = (self.layer.input_layernorm, self.layer.post_attention_layernorm)
        for norm in norms:
            copy_to_tensor_group(norm, group)

    def hf_names(self) -> dict[str, str]:
        return {name: self.hf_prefix + name.removeprefix("layer.") for name in self.state_dict() if name.startswith("layer.")}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gpt2:
            return self.layer(hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.layer(hidden, position_embeddings=self.rotary(hidden, positions), position_ids=positions)


class HFFinalNorm(HFLayer):
    def __init__(self, directory: str) -> None:
        super().__init__()
        config = hf_config(directory)
        self.hf_prefix = _base(config) + "."
        if _is_gpt2(config):
            self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        else:
            self.norm = _modeling(config).LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._start(directory, config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden) if hasattr(self, "ln_f") else self.norm(hidden)


class HFHead(HFLayer):
    """The untied output projection (`lm_head`)."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        config = hf_config(directory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._start(directory, config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def tied_head(embedding: HFEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The head tied to the token table: logits = x @ W^T."""
    return F.linear(hidden, embedding.table)


def _token_batch(vocab: int, seq_len: int, batch_size: int, generator: torch.Generator):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def from_hf(reference: str) -> ModelLayers:
    """`hf:PATH` -> the model's `ModelLayers` (see the module docstring)."""
    directory = str(hf_model_dir(reference))
    config = hf_config(directory)
    tied = bool(getattr(config, "tie_word_embeddings", True))
    table = "wte.weight" if _is_gpt2(config) else "embed_tokens.weight"
    layers = [LayerDef("embed", "embedding", HFEmbedding, (directory,), tie_key="embed" if tied else None, tied_weight_attr=table)]
    layers += [
        LayerDef(f"block.{i}", "transformer_block", HFDecoderLayer, (directory, i)) for i in range(config.num_hidden_layers)
    ]
    layers.append(LayerDef("final_norm", "layer_norm", HFFinalNorm, (directory,)))
    if tied:
        layers.append(
            LayerDef("head", "lm_head", HFEmbedding, (directory,), tie_key="embed", tied_forward=tied_head, tied_weight_attr=table)
        )
    else:
        layers.append(LayerDef("head", "lm_head", HFHead, (directory,)))
    seq_len = sequence_length(config)
    return ModelLayers(
        name=f"{HF_PREFIX}{directory}",
        layers=layers,
        make_batch=functools.partial(_token_batch, config.vocab_size, seq_len),
        loss_fn=lm_loss,
        seq_len=seq_len,
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        tokenizer=hf_tokenizer_file(reference),
    )


def model_config(reference: str):
    """The `ModelConfig` of an `hf:` model's shape, for derived profiles (`profile.derive`): the
    same layers, parameter counts and tie group as `from_hf` builds."""
    from pipectl.artifacts.model import ModelFamily

    directory = str(hf_model_dir(reference))
    config = hf_config(directory)
    common = dict(
        name=f"{HF_PREFIX}{directory}", family=ModelFamily.GPT, layers=config.num_hidden_layers,
        hidden=config.hidden_size, heads=config.num_attention_heads, seq_len=sequence_length(config),
        vocab=config.vocab_size, tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)), shape_only=True,
    )  # fmt: skip
    try:
        return _model_config(config, directory, common)
    except ValidationError as exc:
        raise UserInputError(f"{directory}: {validation_message(exc)}") from None


def _model_config(config, directory: str, common: dict):
    from pipectl.artifacts.model import ModelConfig

    if _is_gpt2(config):
        python_gelu = config.activation_function == "gelu_new"  # transformers' NewGELUActivation: eager ops
        return ModelConfig(**common, ffn_hidden=config.n_inner or 4 * config.hidden_size,
                           activation="gelu_python" if python_gelu else "gelu")  # fmt: skip
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise UserInputError(f"{directory}: head_dim {head_dim} x {config.num_attention_heads} heads is not the hidden size")
    if getattr(config, "attention_bias", False) != getattr(config, "mlp_bias", False):
        raise UserInputError(f"{directory}: attention_bias and mlp_bias differ, which derived profiles do not model")
    return ModelConfig(**common, kv_heads=config.num_key_value_heads, ffn_hidden=config.intermediate_size,
                       activation="swiglu", norm="rms", linear_bias=bool(getattr(config, "attention_bias", False)),
                       rotary=True)  # fmt: skip


def hf_layer_names(model: ModelLayers) -> list[dict[str, str]]:
    """Per layer of an `hf:` model: its parameters' local names -> Hugging Face names (a tied head
    holds none of its own). Built on the meta device: nothing is allocated or read."""
    with on_meta_device():
        return [{} if layer.tied_forward is not None else layer.build().hf_names() for layer in model.layers]
