"""Build a `ModelLayers` from a shipped name, a YAML path, or a user factory `package.module:factory`."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from pipectl.artifacts.model import ModelConfig, ModelFamily
from pipectl.artifacts.run import JOB_FILE
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
from pipectl.paths import FACTORY_FORM, HF_PREFIX, factory_search_path, is_factory_reference, resolve_config


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A shipped model name (`gpt-tiny`) or a YAML path -> validated `ModelConfig`."""
    path = Path(name_or_path)
    if path.suffix == ".py":  # code is named by its import path, never read as a file (nor as YAML)
        parts = path.with_suffix("").parts
        if path.is_absolute() or ".." in parts:
            hint = f"e.g. {path.stem}:FUNCTION, run from {path.parent}"
        else:
            hint = f"e.g. {'.'.join(p for p in parts if p != '.')}:FUNCTION from here"
        raise UserInputError(
            f"{name_or_path} is a Python file, not a model YAML: name the function that builds the model as "
            "package.module:function",
            hint=hint,
        )
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


def host_memory_bytes() -> int | None:
    """Physical memory of this host (Linux and macOS: sysconf), None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(size: float) -> str:
    return f"{size / 1024**3:,.1f} GiB"


def check_fits_host(config: ModelConfig, memory_bytes: int | None = None) -> None:
    """Refuse, before anything is allocated, a config whose weights alone cannot fit this host.

    Its parameters are counted from its shape (`ModelConfig.layer_parameter_counts`) at 4 bytes
    each (layers are built in float32, then converted). A whole model must fit (`shape_only`
    configs are built one layer at a time, so only their largest layer must). This is a floor:
    gradients, optimizer state and activations need more, and a model that passes can still run
    out of memory later; one that fails cannot run here at all.
    """
    memory_bytes = host_memory_bytes() if memory_bytes is None else memory_bytes
    if memory_bytes is None:
        return
    counts = config.layer_parameter_counts()
    if config.shape_only:
        largest = max(range(len(counts)), key=counts.__getitem__)
        needed = 4 * counts[largest]
        if needed > memory_bytes:
            raise UserInputError(
                f"model '{config.name}': its largest layer (layer {largest}) has {counts[largest]:,} parameters, "
                f"{_gib(needed)} as float32, more than this host's {_gib(memory_bytes)} of memory",
                hint=f"derive its profile from the shape instead: pipectl profile {config.name} --derive "
                "--device a100-80gb",
            )
        return
    needed = 4 * sum(counts)
    if needed > memory_bytes:
        raise UserInputError(
            f"model '{config.name}' has {sum(counts):,} parameters, {_gib(needed)} as float32, more than "
            f"this host's {_gib(memory_bytes)} of memory (layers {config.layers}, hidden {config.hidden})",
            hint=("derive its profile (--derive --device KIND) or profile one layer at a time (--once)"
                  if config.name.startswith(HF_PREFIX)
                  else "mark it shape_only: true and derive its profile (--derive --device KIND) or profile one layer "
                  "at a time (--once)"),
        )


def from_config(config: ModelConfig, *, allow_shape_only: bool = False) -> ModelLayers:
    """The layer list of a config. A shape-only config is refused unless `allow_shape_only`: the
    list itself builds nothing, but it must only be built one layer at a time (marked `shape_only`).
    A config whose weights cannot fit this host is refused first (`check_fits_host`)."""
    if config.shape_only and not allow_shape_only:
        raise UserInputError(
            f"model '{config.name}' is shape-only (too large to build here)",
            hint=f"derive its profile instead: pipectl profile {config.name} --derive --device a100-80gb; "
            f"or measure one instance of each distinct layer: pipectl profile {config.name} --once",
        )
    if not config.builtin_block and config.family is not ModelFamily.MLP:
        raise UserInputError(
            f"model '{config.name}' has a block pipectl's own layers do not build (GPT-2's only): "
            f"kv_heads, ffn_hidden, activation, norm, linear_bias or rotary differ",
            hint=f"derive its profile (pipectl profile {config.name} --derive --device a100-80gb), "
            "or run the model from its Hugging Face directory (hf:PATH)",
        )
    check_fits_host(config)
    layers = mlp_layers(config) if config.family is ModelFamily.MLP else transformer_layers(config)
    return replace(layers, shape_only=config.shape_only)


# Packages whose functions are never a model factory: pipectl itself, and (checked by name) the
# standard library and the interpreter's built-in modules (`sys:exit`, `os:system`, `shutil:rmtree`).
_NOT_FACTORY_PACKAGES = frozenset({"pipectl"})


def _not_a_factory_package(module_name: str) -> bool:
    root = module_name.partition(".")[0]
    return root in sys.stdlib_module_names or root in sys.builtin_module_names or root in _NOT_FACTORY_PACKAGES


def _factory_search_path() -> None:
    """Put the folder the user launched from (`PIPECTL_MODEL_PATH`), else the current directory,
    first on sys.path, as `python -m` does; never a run directory. Ranks run inside the run
    directory (files someone else may have written): when the current directory holds a job.json
    it is taken off sys.path, not searched."""
    cwd = os.getcwd()
    if os.path.isfile(os.path.join(cwd, JOB_FILE)):
        sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    for folder in reversed(factory_search_path()):
        if folder not in sys.path and not os.path.isfile(os.path.join(folder, JOB_FILE)):
            sys.path.insert(0, folder)


def import_factory(reference: str, what: str = "model"):
    """Import `package.module:factory` after checking what it names, and return (module, factory).
    `what` names what the factory builds in messages ("model", "dataset").

    Refused before anything of the user's runs: a reference that is not `module:function`, a
    module of the standard library, a built-in module or pipectl itself (`sys:exit`, `os:system`),
    and, after the import, anything but a plain Python function defined outside those modules that
    can be called without arguments. The caller checks the type of what the call returns.

    What this does not protect against: importing a module runs its top-level code, and calling
    the factory runs the factory. A model or dataset reference is code: a plan or a run directory from
    someone else names code that `pipectl launch` will import and run.
    """
    if not is_factory_reference(reference):
        raise UserInputError(
            f"{what} reference '{reference}' is not 'package.module:function'", hint=FACTORY_FORM
        )
    module_name, _, attr = reference.partition(":")
    if _not_a_factory_package(module_name):
        raise UserInputError(
            f"{what} reference '{reference}' names {module_name!r}, a module of Python or pipectl, not a {what} factory",
            hint=f"give the function of your own module that builds the {what} (examples/)",
        )
    _factory_search_path()
    try:
        with _no_exit(f"module '{module_name}' of {what} factory '{reference}'", " as it was imported"):
            module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except (ImportError, AttributeError, SyntaxError) as exc:
        top = module_name.split(".")[0]
        hint = (
            f"it is imported as Python imports it: run from the folder that holds '{top}' (or its {top}.py), "
            "or install its package"
            if isinstance(exc, ModuleNotFoundError) and exc.name is not None and top.startswith(exc.name.split(".")[0])
            else None
        )
        raise UserInputError(f"cannot load {what} factory '{reference}': {exc}", hint=hint) from exc
    if isinstance(factory, type) and issubclass(factory, nn.Module):
        raise UserInputError(f"{what} factory '{reference}' is a module class; give a function that builds the {what}")
    if not inspect.isfunction(factory):
        raise UserInputError(
            f"{what} factory '{reference}' is a {type(factory).__name__}, not a Python function that builds the {what}",
            hint=FACTORY_FORM,
        )
    if _not_a_factory_package(factory.__module__ or ""):
        raise UserInputError(
            f"{what} factory '{reference}' is {factory.__module__}.{factory.__qualname__}, a function of Python "
            f"or pipectl, not a {what} factory"
        )
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise UserInputError(
            f"{what} factory '{reference}' takes arguments {inspect.signature(factory)}; pipectl calls it with none"
        ) from None
    return module, factory


def call_factory(factory, reference: str, what: str):
    """The factory's result; an exception it raises is the user's code failing, named as such."""
    try:
        with _no_exit(f"{what} factory '{reference}'"):
            return factory()
    except UserInputError:
        raise
    except Exception as exc:
        raise UserInputError(f"{what} factory '{reference}' raised {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _no_exit(what: str, when: str = "") -> Iterator[None]:
    """A factory's module or function that calls sys.exit (a training script's argument parsing at
    import, reading pipectl's own command line) would end pipectl silently with its code: one line
    naming it instead, exit 2."""
    try:
        yield
    except SystemExit as exc:
        raise UserInputError(
            f"{what} called sys.exit({exc.code!r}){when}",
            hint="the module is imported and the function called: keep a script's own code (argument parsing, "
            "training) under `if __name__ == \"__main__\":`",
        ) from None


@functools.lru_cache(maxsize=None)
def _sequential_layers(reference: str) -> tuple[nn.Module, ...]:
    """The modules a factory returns as an `nn.Sequential` or a list, built once per process.

    Built under a fixed seed, whichever layer asks first, so every pipeline rank of every layout
    holds the same initial weights; and on the CPU whatever device is the default when asked (a
    shape counted on the meta device first would otherwise leave meta modules in this cache for
    every later build).
    """
    _, factory = import_factory(reference)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), _no_exit(f"model factory '{reference}'"):
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


def _check_batch_and_loss(module, reference: str, returns: str) -> None:
    missing = [name for name in ("make_batch", "loss_fn") if not callable(getattr(module, name, None))]
    if missing:
        raise UserInputError(
            f"model factory '{reference}' {returns}, so {module.__name__} must also define {' and '.join(missing)}",
            hint="see examples/sequential_model.py",
        )


def _is_layer_spec(value: object) -> bool:
    """DeepSpeed's `LayerSpec` (or `TiedLayerSpec`): a class and its arguments, nothing built yet."""
    return all(hasattr(value, name) for name in ("typename", "module_args", "module_kwargs"))


def _layer_def(index: int, spec, reference: str) -> LayerDef:
    """A DeepSpeed layer spec as a `LayerDef`: built only by the rank whose stage holds it."""
    typename = spec.typename
    if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
        raise UserInputError(f"model factory '{reference}': layer spec {index} builds {typename!r}, not a torch module class")
    key = getattr(spec, "key", None)
    attrs = getattr(spec, "tied_weight_attr", ["weight"])
    attrs = [attrs] if isinstance(attrs, str) else list(attrs)
    if key is not None and len(attrs) != 1:
        raise UserInputError(f"model factory '{reference}': tied layer spec {index} ties {attrs}; pipectl ties one weight")
    return LayerDef(
        f"layer.{index}", typename.__name__, typename, tuple(spec.module_args), dict(spec.module_kwargs),
        tie_key=key, tied_forward=getattr(spec, "forward_fn", None) if key is not None else None,
        tied_weight_attr=attrs[0] if key is not None else "weight",
    )  # fmt: skip


def from_factory(reference: str) -> ModelLayers:
    """`package.module:factory`; see examples/custom_model.py for the contract, and
    `import_factory` for what is checked before it runs (and what cannot be).

    The factory returns a `ModelLayers`, a list of DeepSpeed `LayerSpec`s (each layer built only
    on the rank whose stage holds it: a model larger than one process), or an `nn.Sequential` /
    list of modules (built whole on every rank); in the two latter cases its module must also
    define `make_batch(batch_size, generator)` and `loss_fn(output, labels)`
    (examples/sequential_model.py).
    """
    module, factory = import_factory(reference)
    probe = call_factory(factory, reference, "model")
    if isinstance(probe, ModelLayers):
        return probe
    if isinstance(probe, (list, tuple)) and probe and all(_is_layer_spec(spec) for spec in probe):
        _check_batch_and_loss(module, reference, "returns layer specs")
        layers = [_layer_def(i, spec, reference) for i, spec in enumerate(probe)]
        return ModelLayers(name=reference, layers=layers, make_batch=module.make_batch, loss_fn=module.loss_fn)
    if isinstance(probe, (nn.Sequential, list, tuple)) and all(isinstance(m, nn.Module) for m in probe):
        _check_batch_and_loss(module, reference, "returns plain modules")
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
    """A shipped name, a YAML path, `package.module:factory`, or `hf:PATH` (a Hugging Face config
    directory, `models.hf`) -> `ModelLayers`.

    `allow_shape_only` lets a shape-only config through, marked `ModelLayers.shape_only` (for
    the profiler's one-instance mode, which builds one layer of each kind, never the whole model).
    """
    text = str(reference)
    if text.startswith(HF_PREFIX):
        from pipectl.models.hf import from_hf, model_config  # transformers: only for a Hugging Face model

        # Float32 weights that cannot fit this host are refused before anything is built; with
        # allow_shape_only (callers that build one layer or one stage at a time) such a model is
        # marked shape-only, and only its largest layer must fit.
        shape = model_config(text)
        try:
            check_fits_host(shape.model_copy(update={"shape_only": False}))
        except UserInputError:
            if not allow_shape_only:
                raise
            check_fits_host(shape)
            return replace(from_hf(text), shape_only=True)
        return from_hf(text)
    if ":" in text and not Path(text).exists() and not text.endswith((".yaml", ".yml")):
        return from_factory(text)
    return from_config(load_model_config(text), allow_shape_only=allow_shape_only)
