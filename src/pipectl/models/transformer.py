"""GPT-style decoder and BERT-style encoder layers (pre-LayerNorm blocks).

Shapes: tokens [b, s] (int64) -> hidden [b, s, h] -> logits [b, s, V].
Parameters per block: 12h^2 + 13h (Narayanan et al. 2021, §5.1; attention 4h^2+4h, MLP 8h^2+5h, two LayerNorms 4h).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Embedding(nn.Module):
    """Token + learned position embeddings. `weight` is the token table (tied with the head)."""

    def __init__(self, vocab: int, hidden: int, seq_len: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))
        self.position = nn.Parameter(torch.empty(seq_len, hidden))
        nn.init.normal_(self.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight) + self.position[: tokens.shape[1]]


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V per head: what selective recomputation (Korthikanti et al. 2022,
    §5) recomputes in the backward instead of keeping what it saves."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def run_attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, selective: bool) -> torch.Tensor:
    """The attention core, kept (`selective` false) or under a non-reentrant checkpoint, which
    keeps only q, k and v (views of the QKV output, which the block keeps anyway) and runs the core
    forward again inside the backward. Non-reentrant: it works inside DeepSpeed's own per-layer
    checkpoint and with inputs of any `requires_grad`."""
    if selective and torch.is_grad_enabled():
        return checkpoint(attention_core, q, k, v, causal, use_reentrant=False)
    return attention_core(q, k, v, causal)


def tied_head_forward(embedding: Embedding, hidden_states: torch.Tensor) -> torch.Tensor:
    """The output head reuses the token table: logits = x @ W^T (GPT-2, Megatron)."""
    return F.linear(hidden_states, embedding.weight)


class TransformerBlock(nn.Module):
    """Pre-LN block: x + attn(ln(x)); x + mlp(ln(x)). `causal` selects decoder vs encoder."""

    def __init__(self, hidden: int, heads: int, ffn_multiplier: int = 4, causal: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        # Selective recomputation of the attention core (`run_attention_core`); the runtime sets it
        # for a plan that asks for it (`runtime.engines.pipeline.build_pipeline_module`).
        self.selective_recompute = False
        self.ln_attn = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_mlp = nn.LayerNorm(hidden)
        self.fc_in = nn.Linear(hidden, ffn_multiplier * hidden)
        self.fc_out = nn.Linear(ffn_multiplier * hidden, hidden)
        for lin in (self.qkv, self.fc_in):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        for lin in (self.proj, self.fc_out):
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2))
            nn.init.zeros_(lin.bias)

    def attention_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [b, heads, s, d] views of the QKV output (the attention core's inputs; the
        profiler times the core on them)."""
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        shape = (b, s, self.heads, h // self.heads)
        return tuple(t.view(shape).transpose(1, 2) for t in (q, k, v))  # type: ignore[return-value]

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.attention_inputs(x)
        out = run_attention_core(q, k, v, self.causal, self.selective_recompute)
        return self.proj(out.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_attn(x))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class FinalNorm(nn.LayerNorm):
    """The LayerNorm before the head, as its own cuttable layer."""


# Rows of logits `lm_loss` takes at a time: this many bytes of fp32 log-probabilities per chunk
# (at a vocabulary of 50k, about 1,300 tokens: a few dozen kernels for a micro-batch of 16k tokens).
LOSS_CHUNK_BYTES = 256 << 20
IGNORE_INDEX = -100  # F.cross_entropy's default: labels that count for neither loss nor gradient


def _token_losses(
    flat: torch.Tensor, labels: torch.Tensor, gradient: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy in fp32 (0 where ignored) and which rows count, a chunk of rows at a
    time; with `gradient` (the logits' shape and dtype), each row's softmax - one-hot written into it."""
    vocab = flat.shape[-1]
    valid = labels != IGNORE_INDEX
    picked = labels.masked_fill(~valid, 0).unsqueeze(1)
    losses = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    rows = max(1, LOSS_CHUNK_BYTES // (4 * vocab))
    for start in range(0, flat.shape[0], rows):
        end = start + rows
        log_probs = torch.log_softmax(flat[start:end], dim=-1, dtype=torch.float32)
        losses[start:end] = -log_probs.gather(1, picked[start:end]).squeeze(1)
        if gradient is not None:
            probs = log_probs.exp_()
            probs.scatter_add_(1, picked[start:end], probs.new_full((probs.shape[0], 1), -1.0))
            gradient[start:end].copy_(probs)
    return torch.where(valid, losses, 0.0), valid  # an ignored row's loss is 0 whatever its logits


class _CrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy whose gradient is made in the forward, chunk by chunk.

    Eager `F.cross_entropy(logits.float(), labels)` keeps an fp32 copy of the logits and their fp32
    log-softmax for the backward (4 bytes per token and vocabulary entry kept, 8 more passing; the
    logits are the largest activation of a language model: Korthikanti et al. 2022, §4.3) and runs
    about 44 bytes of memory traffic per logit over forward and backward. Here each chunk's
    log-softmax is taken in fp32 from the 16-bit logits in one kernel, its loss read off, and its
    gradient softmax - one-hot written once in the logits' dtype; that gradient is all the backward
    keeps (the logits themselves are not kept), and the backward scales it in place by the incoming
    gradient over the token count: about 24 bytes per logit, and the logits' own size kept instead
    of twice it in fp32. The same loss and gradient as eager cross-entropy, ignored labels (-100)
    included, up to one rounding to the logits' dtype; in fp16 that rounding comes before the loss
    scale rather than after it, so more of the tiniest probabilities flush to zero (about 1 % of the
    entries at a vocabulary of 51,200 and a scale of 65,536, against eager's 0.003 %) for the same
    relative error of the gradient as a whole.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        flat, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        gradient = torch.empty_like(flat)
        losses, valid = _token_losses(flat, labels, gradient)
        count = valid.sum()
        ctx.save_for_backward(gradient, valid, count)
        ctx.shape = logits.shape
        return losses.sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        gradient, valid, count = ctx.saved_tensors
        # No valid label at all: the loss is NaN, as eager's, and the gradient zero, as eager's.
        scale = valid.to(torch.float32) * (grad_output.to(torch.float32) / count.clamp_min(1))
        return gradient.mul_(scale.unsqueeze(1)).view(ctx.shape), None


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, its gradient made in the forward a chunk at a time (`_CrossEntropy`);
    without autograd (an evaluation) the losses alone, by the same chunks."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropy.apply(logits, labels)
    losses, valid = _token_losses(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), None)
    return losses.sum() / valid.sum()
