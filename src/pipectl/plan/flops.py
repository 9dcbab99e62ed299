"""FLOPs accounting as the field reports it: model FLOPs utilisation (MFU) and hardware FLOPs
utilisation (HFU), for a candidate's predicted step (`pipectl plan`) and a run's measured one
(`pipectl status`).

Definitions.

- **MFU** (PaLM, Chowdhery et al. 2022, Appendix B): the model FLOPs per second a step achieves
  over the peak FLOP/s of every device it uses, in the run's precision. Model FLOPs are what the
  model needs, whatever the implementation: per token 6·N + 12·L·H·Q·T (N the parameters, L
  layers, H heads of Q dimensions, T the sequence), i.e. a forward of 2·N + 4·L·H·Q·T and a
  backward of twice that (input and weight gradients). pipectl's N is the weights that multiply
  activations: the blocks' matrices and the logits projection, not the lookup tables, biases or
  norms. No recomputation, no duplicated work: a layout that recomputes or replicates does not
  raise it.
- **HFU** (same appendix; Narayanan et al. 2021, §5.1 and Appendix, for a GPT with recomputation): the FLOPs the
  hardware really executes over the same peak: the model FLOPs plus one more forward of every
  layer that is recomputed, plus the copies of layers every tensor-parallel rank runs whole.

pipectl's formulation, per sample (s tokens) of a transformer (gpt, bert) whose shape is known:

    block   2·s·W + 4·s²·h      W = 2h² + 2h·kv + (2 or 3)·h·i: the q and output projections,
                                k and v (kv = kv_heads x head dim; h without grouped-query
                                attention), the MLP's two matrices (three with SwiGLU) of width i;
                                4·s²·h: QKᵀ and attention x V, full even where a causal kernel
                                skips half (Megatron's and PaLM's convention; H·Q = h)
    head    2·s·h·V             the logits GEMM
    embedding, norms, biases, activations, softmax, residuals: 0 (lookups and element-wise work)

an MLP: 2 FLOPs per weight of each dense layer (biases left out). A step's model FLOPs are
3 x B x the sum over layers. For GPT-2's block (W = 12h², no GQA) this is Narayanan et al.'s
72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)), which `tests/plan/test_flops.py` checks.

Hardware FLOPs add, per layer, one forward x B for a recomputed layer: pipectl's schedules recompute
every virtual stage but the last (`plan.candidates.recomputing_stages`; Varuna always; the last
stage runs its backward straight after its forward), so a GPT whose last stage holds only the
final norm and the head gives Megatron's 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (the logits are not
recomputed). Per-layer activation checkpointing recomputes every layer, the last stage's too, but
the LM head (`layer_table.NOT_CHECKPOINTED_KINDS`), which gives the same formula. Selective
recomputation adds each block's attention core once more, 4·s²·h per sample (from the shape; a
profile counts its layers whole, so HFU from a profile's counts leaves the cores out). At t > 1 every layer but the transformer blocks (embedding, norms, head) runs whole
on each of the t tensor ranks (`models.tensor_parallel`), so it counts t times.

Where the figures come from, in order:

1. The model's shape: the `ModelConfig` the plan names (`model_reference`, else `model`: a shipped
   name or a YAML path that resolves here), used only when it reproduces the plan's recorded
   `model_shape` exactly (every layer's parameter count; sequence, hidden, vocabulary), so an edited
   or different file is never taken for the planned model.
2. Else the profile's per-layer `forward_flops` (torch's FlopCounterMode for a measured profile:
   matrix products and attention; a derived profile's analytic figures, which also count the
   embedding's position add and the final norm, s·h and 8·s·h per sample).
3. Else nothing: MFU and HFU are n/a, never estimated from parameter counts.

The peak is the catalog's dense peak of each device in the precision (`DeviceSpec.peak_flops_per_second`:
the 16-bit peak for bf16/fp16, fp32 without TF32), summed over the devices a candidate uses (a
split over device kinds sums each replica's kind). An emulated slower kind (`cpu-slowed-2x`) is
the catalog device it emulates: its hardware. The `cpu` entry's fp32 peak is the core's AVX-512
FMA peak (2.3 GHz x 2 x 16 lanes x 2 = 147 GFLOP/s); its bf16 figure is the rate a bf16 matmul
measured on that CPU (no native bf16), as configs/devices.yaml says.

    >>> from pipectl.artifacts.model import ModelConfig
    >>> gpt = ModelConfig(name="x", family="gpt", layers=2, hidden=64, heads=4, seq_len=32, vocab=256)
    >>> flops = config_layer_flops(gpt)
    >>> flops.forward[1] == 24 * 32 * 64**2 + 4 * 32**2 * 64, flops.forward[-1] == 2 * 32 * 64 * 256
    (True, True)
    >>> step = step_flops(flops, global_batch=8, stage_layers=[(0, 2), (2, 5)], recompute=True)
    >>> step.hardware / step.model > 1, step.model == 3 * 8 * sum(flops.forward)
    (True, True)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipectl.artifacts.model import ModelConfig, ModelFamily
from pipectl.artifacts.plan import Candidate, Plan
from pipectl.artifacts.profile import ModelProfile
from pipectl.catalog import DTYPE_BYTES, DeviceSpec, load_catalog
from pipectl.errors import PipectlError
from pipectl.io import load_model
from pipectl.paths import resolve_config
from pipectl.plan.layer_table import NOT_CHECKPOINTED_KINDS

# The layer kind tensor parallelism splits (models/tensor_parallel.py); every other layer runs
# whole on each tensor rank.
SPLIT_KIND = "transformer_block"
# job.json's precision -> the dtype a peak is looked up in.
PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Forward + backward = 3 forwards (the backward computes input and weight gradients).
TRAINING_FORWARDS = 3

_EMULATED = re.compile(r"^(?P<device>.+)-slowed-[0-9.e+]+x$")


@dataclass(frozen=True)
class LayerFlops:
    """Model FLOPs of one sample's forward, layer by layer, and where they come from."""

    forward: tuple[float, ...]  # per layer, one sample
    split: tuple[bool, ...]  # split over the tensor group at t > 1 (else each tensor rank runs it whole)
    source: str  # "shape" or "profile"
    detail: str  # for people: which config, or which profile
    # Per layer: whether per-layer checkpointing leaves it alone (`layer_table.NOT_CHECKPOINTED_KINDS`:
    # the LM head); empty: none is.
    not_checkpointed: tuple[bool, ...] = ()
    # Per layer, one sample: the attention core's share of `forward` (QKᵀ and attention x V), what
    # selective recomputation runs again; empty: not known (a profile counts its layers whole).
    attention_core: tuple[float, ...] = ()

    @property
    def per_sample(self) -> float:
        return sum(self.forward)


@dataclass(frozen=True)
class StepFlops:
    model: float  # model FLOPs of one step (no recomputation, nothing duplicated)
    recomputed: float = 0.0  # the recomputed forwards (on every tensor rank that runs them)
    replicated: float = 0.0  # the t - 1 extra copies of the layers each tensor rank runs whole

    @property
    def hardware(self) -> float:
        """What the hardware executes in one step."""
        return self.model + self.recomputed + self.replicated


def config_layer_flops(config: ModelConfig) -> LayerFlops:
    """Per-layer forward model FLOPs of one sample, from the config's shape alone, in the layer
    order `models.registry` builds (embed, blocks, final_norm, head; input, hidden.i, classifier)."""
    h = config.hidden
    if config.family is ModelFamily.MLP:
        inputs, classes = config.input_dim or h, config.classes or 10
        forward = [2.0 * inputs * h, *([2.0 * h * h] * config.layers), 2.0 * h * classes]
        return LayerFlops(tuple(forward), (False,) * len(forward), "shape", f"the shape of {config.name}")
    s, V, i = config.seq_len, config.vocab, config.mlp_width
    kv = (config.kv_heads or config.heads) * (h // config.heads)
    weights = 2 * h * h + 2 * h * kv + (3 if config.activation == "swiglu" else 2) * h * i
    core = 4.0 * s * s * h
    block = 2.0 * s * weights + core
    forward = (0.0, *([block] * config.layers), 0.0, 2.0 * s * h * V)
    split = (False, *([True] * config.layers), False, False)
    head = (False,) * (len(forward) - 1) + (True,)
    cores = (0.0, *([core] * config.layers), 0.0, 0.0)
    return LayerFlops(forward, split, "shape", f"the shape of {config.name}", head, cores)


def profile_layer_flops(profile: ModelProfile) -> LayerFlops | None:
    """Per-layer forward FLOPs of one sample as the profile counted them (at its smallest
    micro-batch), or None when it counted none."""
    forward = tuple(layer.costs[0].forward_flops / layer.costs[0].micro_batch_size for layer in profile.layers)
    if not any(forward):
        return None
    split = tuple(layer.kind == SPLIT_KIND for layer in profile.layers)
    alone = tuple(layer.kind in NOT_CHECKPOINTED_KINDS for layer in profile.layers)
    return LayerFlops(forward, split, "profile", f"the {profile.source.value} profile's counts", alone)


def _matches(config: ModelConfig, plan: Plan) -> bool:
    """Whether `config` is the model the plan was made for: every layer's parameters (and, for a
    transformer, sequence, hidden and vocabulary) as the plan recorded them."""
    shape = plan.model_shape
    if config.layer_parameter_counts() != shape.layer_parameter_counts:
        return False
    if config.family is ModelFamily.MLP:
        return True
    return (config.seq_len, config.hidden, config.vocab) == (shape.seq_len, shape.hidden, shape.vocab)


def shape_config(plan: Plan) -> ModelConfig | None:
    """The config the plan names (`model_reference`, else `model`), if it resolves here and is the
    planned model's shape exactly; None otherwise (a factory, an `hf:` directory, a moved or
    edited file)."""
    for reference in dict.fromkeys(r for r in (plan.model_reference, plan.model) if r):
        try:
            config = load_model(ModelConfig, resolve_config(reference, "models"))
        except (PipectlError, OSError, ValueError):
            continue
        if _matches(config, plan):
            return config
    return None


def plan_layer_flops(plan: Plan, profile: ModelProfile | None = None) -> LayerFlops | None:
    """The plan's model FLOPs per layer: from the model's shape, else the profile's counts, else None."""
    config = shape_config(plan)
    if config is not None:
        return config_layer_flops(config)
    if profile is not None and len(profile.layers) == plan.layers:
        return profile_layer_flops(profile)
    return None


def recomputed_layers(
    stage_layers: Sequence[tuple[int, int]], recompute: bool, checkpoint_layers: bool = False
) -> range:
    """The layers run forward twice: every virtual stage's but the last's when whole stages are
    recomputed; every layer with per-layer checkpointing (the last stage's too).

    >>> recomputed_layers([(0, 2), (2, 5)], True), recomputed_layers([(0, 2), (2, 5)], False, checkpoint_layers=True)
    (range(0, 2), range(0, 5))
    """
    if checkpoint_layers:
        return range(stage_layers[0][0], stage_layers[-1][1])
    if not recompute or len(stage_layers) < 2:
        return range(0)
    return range(stage_layers[0][0], stage_layers[-1][0])


def step_flops(
    flops: LayerFlops,
    global_batch: int,
    stage_layers: Sequence[tuple[int, int]],
    recompute: bool,
    tensor_parallel: int = 1,
    checkpoint_layers: bool = False,
    selective_recompute: bool = False,
) -> StepFlops:
    """Model and hardware FLOPs of one optimizer step of B samples on this cut."""
    recomputed_layers_ = recomputed_layers(stage_layers, recompute, checkpoint_layers)
    recomputed = replicated = 0.0
    alone = flops.not_checkpointed if checkpoint_layers else ()
    for index, (forward, split) in enumerate(zip(flops.forward, flops.split)):
        copies = 1 if split else tensor_parallel
        again = index in recomputed_layers_ and not (alone and alone[index])
        recomputed += copies * again * forward
        replicated += (copies - 1) * TRAINING_FORWARDS * forward
    if selective_recompute:
        recomputed += sum(flops.attention_core)  # the blocks' cores, split over the tensor group
    return StepFlops(
        model=TRAINING_FORWARDS * global_batch * flops.per_sample,
        recomputed=global_batch * recomputed,
        replicated=global_batch * replicated,
    )


def base_device(kind: str) -> str:
    """The catalog device of a candidate's kind: 'cpu-slowed-2x' (an emulated slower kind) -> 'cpu'.

    >>> base_device("cpu-slowed-2x"), base_device("a100-80gb")
    ('cpu', 'a100-80gb')
    """
    match = _EMULATED.match(kind)
    return match.group("device") if match else kind


def peak_flops_per_second(
    candidate: Candidate, dtype: str, catalog: dict[str, DeviceSpec] | None = None
) -> float | None:
    """The dense peak FLOP/s of every device the candidate uses, summed, in `dtype`; None when a
    device kind is not in the catalog or the dtype is unknown."""
    if dtype not in DTYPE_BYTES:
        return None
    devices = catalog if catalog is not None else load_catalog()
    per_replica = candidate.tensor_parallel * candidate.pipeline_parallel
    total = 0.0
    for kind in candidate.replica_kinds:
        spec = devices.get(base_device(kind))
        if spec is None:
            return None
        total += per_replica * spec.peak_flops_per_second(dtype)
    return total


@dataclass(frozen=True)
class Utilisation:
    """A candidate's FLOPs over its devices' peak for one step time (predicted, or measured).
    `mfu`/`hfu` are None (n/a) with `reason` saying why."""

    mfu: float | None
    hfu: float | None
    model_flops_per_step: float | None
    hardware_flops_per_step: float | None
    peak_flops_per_second: float | None  # all devices together
    devices: int
    dtype: str
    step_seconds: float | None
    source: str | None  # "shape", "profile", or None
    detail: str  # where the FLOPs come from, or why there are none
    recomputed_flops_per_step: float = 0.0  # what HFU adds: recomputed forwards
    replicated_flops_per_step: float = 0.0  # and whole layers on each tensor rank
    tensor_parallel: int = 1

    @property
    def available(self) -> bool:
        return self.mfu is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mfu": self.mfu,
            "hfu": self.hfu,
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "peak_flops_per_second": self.peak_flops_per_second,
            "devices": self.devices,
            "dtype": self.dtype,
            "step_seconds": self.step_seconds,
            "recomputed_flops_per_step": self.recomputed_flops_per_step,
            "replicated_flops_per_step": self.replicated_flops_per_step,
            "source": self.source,
            "detail": self.detail,
        }


def utilisation(
    candidate: Candidate,
    flops: LayerFlops | None,
    dtype: str,
    step_seconds: float | None = None,
    *,
    global_batch: int | None = None,
    catalog: dict[str, DeviceSpec] | None = None,
) -> Utilisation:
    """MFU and HFU of `candidate` at `step_seconds` (default: its predicted step)."""
    seconds = candidate.predicted_step_seconds if step_seconds is None else step_seconds
    peak = peak_flops_per_second(candidate, dtype, catalog)
    base = dict(devices=candidate.devices, dtype=dtype, step_seconds=seconds, peak_flops_per_second=peak,
                tensor_parallel=candidate.tensor_parallel)  # fmt: skip
    if flops is None or len(flops.forward) != candidate.stage_layers[-1][1]:
        return Utilisation(None, None, None, None, source=None,
                           detail="the model's shape is unknown and its profile counts no FLOPs", **base)  # fmt: skip
    batch = candidate.global_batch if global_batch is None else global_batch
    step = step_flops(flops, batch, candidate.stage_layers, candidate.recompute, candidate.tensor_parallel,
                      candidate.checkpoint_layers, candidate.selective_recompute)
    figures = dict(model_flops_per_step=step.model, hardware_flops_per_step=step.hardware, source=flops.source,
                   recomputed_flops_per_step=step.recomputed, replicated_flops_per_step=step.replicated)  # fmt: skip
    if peak is None:
        kinds = ", ".join(sorted(set(candidate.replica_kinds)))
        return Utilisation(None, None, detail=f"no {dtype} peak FLOP/s in the device catalog for {kinds}",
                           **figures, **base)  # fmt: skip
    if not seconds or seconds <= 0:
        return Utilisation(None, None, detail="no step time", **figures, **base)
    achieved = seconds * peak
    return Utilisation(step.model / achieved, step.hardware / achieved, detail=flops.detail, **figures, **base)


def ideal_step_seconds(plan: Plan, candidate: Candidate, dtype: str) -> float | None:
    """The step time at 100 % MFU: the step's model FLOPs (from the model's shape) over the
    devices' peak; a measured step's MFU is this over its time. None without either."""
    figures = utilisation(candidate, plan_layer_flops(plan), dtype, global_batch=plan.global_batch)
    if figures.model_flops_per_step is None or not figures.peak_flops_per_second:
        return None
    return figures.model_flops_per_step / figures.peak_flops_per_second


def plan_utilisation(
    plan: Plan, profile: ModelProfile | None, dtype: str | None = None, candidate: Candidate | None = None
) -> Utilisation:
    """Predicted MFU/HFU of the plan's chosen candidate (or `candidate`), in the profile's precision
    unless `dtype` is given."""
    dtype = dtype or (profile.dtype if profile is not None else "float32")
    return utilisation(candidate or plan.chosen, plan_layer_flops(plan, profile), dtype, global_batch=plan.global_batch)
