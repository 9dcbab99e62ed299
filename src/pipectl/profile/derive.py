"""Derive a profile from a model's shape and a device's datasheet, without running anything.

For hardware we cannot reach (an A100 cluster, a 1 T-parameter model), the per-layer costs follow
from closed forms (SPEC §3; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", §3 and Appendix) and the catalog's achievable efficiency:

    time = FLOPs / (peak FLOP/s x efficiency(b))

The layer list is exactly `pipectl.models.registry` builds it (embed, block.0 .. block.{l-1},
final_norm, head; input, hidden.i, classifier for MLPs), with the measured profiler's conventions
(`pipectl.profile.measure`): the tied head is charged the token table it uses (V*h parameters, all
of them shared with `embed`), and peak memory is parameters + gradients + saved + output bytes. So a
derived and a measured profile of one config line up layer by layer.

Parameter count. The layer list holds P + 2h parameters, P being SPEC §3's closed form
P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)): the closed form counts the blocks, the token table
(once) and the position table, but not the final LayerNorm's weight and bias (2h).

    >>> from pipectl.catalog import get_device
    >>> from pipectl.models.registry import load_model_config
    >>> gpt3 = derive_profile(load_model_config("gpt3-175b"), get_device("a100-80gb"), [1, 8])
    >>> round(gpt3.parameter_count / 1e9, 1)
    174.6
    >>> block = gpt3.layers[1].cost(1)      # 24 b s h^2 + 4 b s^2 h FLOPs at 35 % of 312 TFLOP/s
    >>> round(block.forward_flops / 1e12, 3), round(block.forward_seconds * 1e3, 2)
    (7.628, 69.85)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipectl.artifacts.model import ModelConfig, ModelFamily
from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile, ProfileSource
from pipectl.catalog import DTYPE_BYTES, DeviceSpec, get_device
from pipectl.errors import UserInputError

# Backward of a matrix multiply computes two products (input gradient and weight gradient) for
# every one of the forward: backward = 2 x forward (Narayanan et al. 2021, §3.3; SPEC §3).
BACKWARD_PER_FORWARD = 2.0
TOKEN_ID_BYTES = 8  # int64 token ids, kept by the embedding look-up for its backward
FP32_BYTES = 4


@dataclass(frozen=True)
class _LayerShape:
    """Per-layer closed forms; `*_per_sample` are for one sample of the micro-batch."""

    name: str
    kind: str
    parameter_count: int
    shared_group: str | None
    shared_parameter_count: int
    forward_flops_per_sample: float
    output_elements_per_sample: int  # in the profile's dtype
    saved_bytes_per_sample: float
    # Bytes read and written by the forward of a memory-bound layer (0: compute-bound, FLOPs only).
    forward_memory_bytes_per_sample: float = 0.0


def _check_micro_batch_sizes(micro_batch_sizes: Sequence[int]) -> list[int]:
    if not micro_batch_sizes:
        raise UserInputError("no micro-batch sizes given to derive a profile for")
    for size in micro_batch_sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UserInputError(f"micro-batch size {size!r} is not a positive integer")
    return sorted(set(micro_batch_sizes))


def _check_dtype(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise UserInputError(f"unknown dtype '{dtype}'", hint=f"known dtypes: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def transformer_block_parameters(hidden: int, ffn_multiplier: int = 4) -> int:
    """Attention 4h^2 + 4h, MLP 2fh^2 + fh + h, two LayerNorms 4h: 12h^2 + 13h when f = 4 (SPEC §3)."""
    h, f = hidden, ffn_multiplier
    return (4 + 2 * f) * h * h + (9 + f) * h


def transformer_block_forward_flops(micro_batch_size: int, seq_len: int, hidden: int, ffn_multiplier: int = 4) -> float:
    """Matrix-multiply FLOPs of one block's forward: 24 b s h^2 + 4 b s^2 h when f = 4.

    Narayanan et al. 2021, Appendix: QKV 6bsh^2, scores 2bs^2h, attention over values 2bs^2h,
    projection 2bsh^2, MLP 2 x 2bs(fh)h = 16bsh^2 at f = 4. Element-wise work is left out; the
    catalog's efficiency absorbs it.
    """
    b, s, h, f = micro_batch_size, seq_len, hidden, ffn_multiplier
    return (8 + 4 * f) * b * s * h * h + 4 * b * s * s * h


def transformer_block_saved_bytes(
    micro_batch_size: int, seq_len: int, hidden: int, heads: int, bytes_per_element: int, ffn_multiplier: int = 4
) -> float:
    """Activations one block keeps for backward: s b h (34 + 5 a s / h) bytes in 16-bit at f = 4.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1):
    attention 11sbh + 5as^2b (of which the dropout masks, sbh + as^2b, are 1 byte per element),
    MLP 19sbh (mask sbh), LayerNorms 4sbh. Scaled to `bytes_per_element` with the masks kept at one
    byte, and to an MLP of width f*h:

        sbh (e (8 + 2f) + 2) + a s^2 b (2e + 1)    ->  e=2, f=4: 34 sbh + 5 a s^2 b;  e=4: 66 sbh + 9 a s^2 b

    An upper estimate for blocks without dropout or with fused (flash) attention, which keep neither
    the masks nor the s^2 scores.
    """
    b, s, h, a, e, f = micro_batch_size, seq_len, hidden, heads, bytes_per_element, ffn_multiplier
    return s * b * h * (e * (8 + 2 * f) + 2) + a * s * s * b * (2 * e + 1)


def gpt_parameters_closed_form(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """SPEC §3: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) (Narayanan et al. 2021, §5.1)."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


def _transformer_shapes(config: ModelConfig, bytes_per_element: int) -> list[_LayerShape]:
    h, s, V, a, f = config.hidden, config.seq_len, config.vocab, config.heads, config.ffn_multiplier
    e = bytes_per_element
    tied_group = "embed" if config.tied_embeddings else None
    shapes = [
        _LayerShape(
            name="embed",
            kind="embedding",
            parameter_count=V * h + s * h,  # token table + learned positions
            shared_group=tied_group,
            shared_parameter_count=V * h if config.tied_embeddings else 0,
            forward_flops_per_sample=s * h,  # the position add
            output_elements_per_sample=s * h,
            saved_bytes_per_sample=s * TOKEN_ID_BYTES,
            # Gather s rows of the table, read the positions, write the sum.
            forward_memory_bytes_per_sample=3 * s * h * e,
        )
    ]
    block_params = transformer_block_parameters(h, f)
    for i in range(config.layers):
        shapes.append(
            _LayerShape(
                name=f"block.{i}",
                kind="transformer_block",
                parameter_count=block_params,
                shared_group=None,
                shared_parameter_count=0,
                forward_flops_per_sample=transformer_block_forward_flops(1, s, h, f),
                output_elements_per_sample=s * h,
                saved_bytes_per_sample=transformer_block_saved_bytes(1, s, h, a, e, f),
            )
        )
    shapes.append(
        _LayerShape(
            name="final_norm",
            kind="layer_norm",
            parameter_count=2 * h,
            shared_group=None,
            shared_parameter_count=0,
            forward_flops_per_sample=8 * s * h,  # mean, variance, normalise, scale, shift
            output_elements_per_sample=s * h,
            # Its input, plus the fp32 mean and reciprocal std. per token.
            saved_bytes_per_sample=s * h * e + 2 * s * FP32_BYTES,
            forward_memory_bytes_per_sample=2 * s * h * e,
        )
    )
    shapes.append(
        _LayerShape(
            name="head",
            kind="lm_head",
            # Tied: the head uses the embedding's token table (charged here, all of it shared).
            parameter_count=V * h,
            shared_group=tied_group,
            shared_parameter_count=V * h if config.tied_embeddings else 0,
            forward_flops_per_sample=2 * s * h * V,  # logits: SPEC §3, 2bshV forward
            output_elements_per_sample=s * V,
            # Its input for the weight gradient, and the fp32 logits the cross-entropy keeps
            # (Korthikanti et al. 2022, §4.3: 4sbv bytes).
            saved_bytes_per_sample=s * h * e + s * V * FP32_BYTES,
        )
    )
    return shapes


def _dense_shape(name: str, kind: str, inputs: int, outputs: int, bytes_per_element: int, last: bool) -> _LayerShape:
    e = bytes_per_element
    # A linear layer keeps its input; ReLU keeps its output; the classifier's loss keeps fp32 logits.
    kept_after = outputs * FP32_BYTES if last else outputs * e
    return _LayerShape(
        name=name,
        kind=kind,
        parameter_count=inputs * outputs + outputs,
        shared_group=None,
        shared_parameter_count=0,
        forward_flops_per_sample=2 * inputs * outputs,
        output_elements_per_sample=outputs,
        saved_bytes_per_sample=inputs * e + kept_after,
    )


def _mlp_shapes(config: ModelConfig, bytes_per_element: int) -> list[_LayerShape]:
    inputs = config.input_dim or config.hidden
    classes = config.classes or 10  # as pipectl.models.registry.mlp_layers
    e = bytes_per_element
    shapes = [_dense_shape("input", "dense", inputs, config.hidden, e, last=False)]
    shapes += [
        _dense_shape(f"hidden.{i}", "dense", config.hidden, config.hidden, e, last=False)
        for i in range(config.layers)
    ]
    shapes.append(_dense_shape("classifier", "classifier", config.hidden, classes, e, last=True))
    return shapes


def _layer_cost(shape: _LayerShape, micro_batch_size: int, device: DeviceSpec, dtype: str, bytes_per_element: int) -> LayerCost:
    b = micro_batch_size
    forward_flops = shape.forward_flops_per_sample * b
    forward_seconds = forward_flops / device.achievable_flops_per_second(dtype, b)
    if shape.forward_memory_bytes_per_sample and device.memory_bandwidth_gbytes_per_second:
        # Element-wise layers are bound by memory traffic, not FLOPs (roofline: Williams et al. 2009).
        memory_seconds = shape.forward_memory_bytes_per_sample * b / (device.memory_bandwidth_gbytes_per_second * 1e9)
        forward_seconds = max(forward_seconds, memory_seconds)
    output_bytes = shape.output_elements_per_sample * b * bytes_per_element
    saved_bytes = int(shape.saved_bytes_per_sample * b)
    parameter_bytes = shape.parameter_count * bytes_per_element
    return LayerCost(
        micro_batch_size=b,
        forward_seconds=forward_seconds,
        backward_seconds=BACKWARD_PER_FORWARD * forward_seconds,
        output_activation_bytes=output_bytes,
        saved_activation_bytes=saved_bytes,
        # The measured profiler's CPU convention: weights + gradients + saved + output.
        peak_memory_bytes=2 * parameter_bytes + saved_bytes + output_bytes,
        forward_flops=forward_flops,
    )


def derive_profile(
    config: ModelConfig,
    device: DeviceSpec | str,
    micro_batch_sizes: Sequence[int],
    dtype: str = "bfloat16",
) -> ModelProfile:
    """A `ModelProfile` (source=derived) of `config` on `device`, from closed forms only.

    Layers, names, kinds, parameter counts and tie groups match `pipectl.models.build_model` on the
    same config; costs come from FLOPs / (peak x efficiency(b)) and the byte counts documented on
    the helpers above. `device` is a `DeviceSpec` or a catalog name.
    """
    if isinstance(device, str):
        device = get_device(device)
    sizes = _check_micro_batch_sizes(micro_batch_sizes)
    bytes_per_element = _check_dtype(dtype)
    transformer = config.family in (ModelFamily.GPT, ModelFamily.BERT)
    shapes = _transformer_shapes(config, bytes_per_element) if transformer else _mlp_shapes(config, bytes_per_element)

    layers = [
        LayerProfile(
            index=index,
            name=shape.name,
            kind=shape.kind,
            parameter_count=shape.parameter_count,
            parameter_bytes=shape.parameter_count * bytes_per_element,
            shared_group=shape.shared_group,
            shared_parameter_count=shape.shared_parameter_count,
            costs=[_layer_cost(shape, b, device, dtype, bytes_per_element) for b in sizes],
        )
        for index, shape in enumerate(shapes)
    ]
    notes = [
        f"derived from the {config.family.value} shape and the '{device.name}' datasheet, not measured",
        "time = FLOPs / (peak x efficiency(b)); backward = 2 x forward (Narayanan et al. 2021)",
    ]
    if transformer:
        notes.append("saved activations: Korthikanti et al. 2022 eq. 1 (upper estimate for fused attention)")
    return ModelProfile(
        model=config.name,
        source=ProfileSource.DERIVED,
        device=device.name,
        dtype=dtype,
        micro_batch_sizes=sizes,
        seq_len=config.seq_len if transformer else None,
        hidden=config.hidden if transformer else None,
        vocab=config.vocab if transformer else None,
        layers=layers,
        notes=notes,
    )
