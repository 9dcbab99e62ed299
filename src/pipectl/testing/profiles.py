"""Small hand-made profiles for tests, examples and what-if planning.

`synthetic_profile` builds a transformer-shaped `ModelProfile` (embed, blocks, final_norm, head)
whose figures are simple functions of b, so a test can predict them:

- a block takes `block_forward_seconds[i] * b` forward and twice that backward (Narayanan et al. 2021:
  backward costs 2x forward), outputs `hidden * seq_len * b * dtype_bytes` bytes and keeps
  `saved_per_output` times that for backward;
- embed and head take `edge_forward_seconds * b`; the head keeps the logits (vocab-wide);
- embed and head share the token table when `tied` (both carry it, it is counted once);
- the head's working memory (`LayerProfile.working_memory_bytes`) is `head_working_per_logit`
  times its logits' bytes (0 by default; the fp32 logits, log-probabilities and their gradients of
  a 16-bit model are about 8x its 16-bit logits);
- with `attention_core` = (saved fraction, time fraction) a block records an attention core
  (`LayerCost.attention_core_*`) keeping that fraction of its saved bytes and taking that fraction
  of its forward time, so selective recomputation is searched; None (the default): not recorded.

    >>> profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2])
    >>> [layer.name for layer in profile.layers]
    ['embed', 'block.0', 'block.1', 'block.2', 'block.3', 'final_norm', 'head']
    >>> profile.layers[1].cost(2).forward_seconds
    0.02
"""

from __future__ import annotations

from typing import Sequence

from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile, ProfileSource

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def synthetic_profile(
    blocks: int,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    *,
    block_forward_seconds: Sequence[float] | float = 0.01,
    edge_forward_seconds: float = 0.004,
    hidden: int = 64,
    seq_len: int = 32,
    vocab: int = 256,
    saved_per_output: float = 8.0,
    dtype: str = "bfloat16",
    device: str = "a100-80gb",
    tied: bool = True,
    head_working_per_logit: float = 0.0,
    name: str = "synthetic",
    attention_core: tuple[float, float] | None = None,
) -> ModelProfile:
    """A transformer-shaped profile with chosen per-block forward times (seconds at b = 1)."""
    if isinstance(block_forward_seconds, (int, float)):
        block_forward_seconds = [float(block_forward_seconds)] * blocks
    if len(block_forward_seconds) != blocks:
        raise ValueError(f"need {blocks} block times, got {len(block_forward_seconds)}")
    element = _DTYPE_BYTES[dtype]
    hidden_bytes = hidden * seq_len * element  # one sample's [s, h] activation
    logits_bytes = vocab * seq_len * element
    block_parameters = 12 * hidden * hidden + 13 * hidden  # docs/design.md, 'Parameters and FLOPs'
    embed_parameters = vocab * hidden + seq_len * hidden
    block_flops = 24 * seq_len * hidden * hidden + 4 * seq_len * seq_len * hidden  # per sample

    def costs(
        forward: float, output: int, saved: float, flops: float, parameters: int, working: float = 0.0,
        core: tuple[float, float] | None = None,
    ) -> list[LayerCost]:
        # Peak: weights and gradients + saved + output + working memory (`LayerCost.peak_memory_bytes`).
        return [
            LayerCost(
                micro_batch_size=b,
                forward_seconds=forward * b,
                backward_seconds=2 * forward * b,
                output_activation_bytes=output * b,
                saved_activation_bytes=int(saved * b),
                peak_memory_bytes=2 * parameters * element + output * b + int(saved * b) + int(working * b),
                forward_flops=flops * b,
                **({} if core is None else {"attention_core_saved_bytes": int(core[0] * int(saved * b)),
                                            "attention_core_forward_seconds": core[1] * forward * b}),
            )
            for b in micro_batch_sizes
        ]

    layers = [
        LayerProfile(
            index=0,
            name="embed",
            kind="embedding",
            parameter_count=embed_parameters,
            parameter_bytes=embed_parameters * element,
            shared_group="embed" if tied else None,
            shared_parameter_count=vocab * hidden if tied else 0,
            costs=costs(edge_forward_seconds, hidden_bytes, hidden_bytes, 0.0, embed_parameters),
        )
    ]
    for i, forward in enumerate(block_forward_seconds):
        layers.append(
            LayerProfile(
                index=len(layers),
                name=f"block.{i}",
                kind="transformer_block",
                parameter_count=block_parameters,
                parameter_bytes=block_parameters * element,
                costs=costs(forward, hidden_bytes, saved_per_output * hidden_bytes, block_flops, block_parameters,
                            core=attention_core),
            )
        )
    layers.append(
        LayerProfile(
            index=len(layers),
            name="final_norm",
            kind="layer_norm",
            parameter_count=2 * hidden,
            parameter_bytes=2 * hidden * element,
            costs=costs(edge_forward_seconds / 10, hidden_bytes, hidden_bytes, 0.0, 2 * hidden),
        )
    )
    layers.append(
        LayerProfile(
            index=len(layers),
            name="head",
            kind="lm_head",
            parameter_count=vocab * hidden,
            parameter_bytes=vocab * hidden * element,
            shared_group="embed" if tied else None,
            shared_parameter_count=vocab * hidden if tied else 0,
            costs=costs(
                edge_forward_seconds, logits_bytes, hidden_bytes + logits_bytes, 2 * seq_len * hidden * vocab,
                vocab * hidden, head_working_per_logit * logits_bytes,
            ),
        )
    )
    return ModelProfile(
        model=name,
        source=ProfileSource.DERIVED,
        device=device,
        dtype=dtype,
        micro_batch_sizes=list(micro_batch_sizes),
        seq_len=seq_len,
        hidden=hidden,
        vocab=vocab,
        layers=layers,
    )
