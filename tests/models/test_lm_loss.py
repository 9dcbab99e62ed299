"""pipectl's language-model loss: eager cross-entropy's loss and gradient, without its fp32 copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipectl.models import transformer
from pipectl.models.transformer import lm_loss
from pipectl.profile import layer_shapes


def _both(logits: torch.Tensor, labels: torch.Tensor, incoming: float) -> tuple[tuple, tuple]:
    """(loss, gradient) of pipectl's loss and of eager fp32 cross-entropy, for the same incoming gradient."""
    results = []
    for loss_of in (lm_loss, lambda x, y: F.cross_entropy(x.reshape(-1, x.shape[-1]).float(), y.reshape(-1))):
        x = logits.detach().clone().requires_grad_()
        loss = loss_of(x, labels)
        loss.backward(torch.tensor(incoming))
        results.append((loss.detach(), x.grad))
    return results[0], results[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_loss_and_its_gradient_are_eager_cross_entropys_chunk_by_chunk(monkeypatch, dtype):
    monkeypatch.setattr(transformer, "LOSS_CHUNK_BYTES", 4 * 997 * 7)  # 7 rows a chunk: 22 chunks, the last short
    torch.manual_seed(0)
    logits = (torch.randn(3, 50, 997) * 4).to(dtype)
    labels = torch.randint(0, 997, (3, 50))
    labels[0, :5] = -100  # ignored, as F.cross_entropy ignores them: no loss, no gradient
    (loss, gradient), (eager_loss, eager_gradient) = _both(logits, labels, incoming=1024.0)  # a loss scale
    assert gradient.dtype == dtype and gradient.shape == logits.shape
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-6)
    ulp = torch.finfo(dtype).eps * eager_gradient.float().abs().max()
    assert (gradient.float() - eager_gradient.float()).abs().max() <= ulp
    assert gradient[0, :5].abs().max() == 0
    with torch.no_grad():  # an evaluation: the same loss, no gradient made
        assert lm_loss(logits, labels).item() == pytest.approx(loss.item(), rel=1e-6)


def test_the_backward_keeps_the_gradient_in_the_logits_dtype_not_fp32_copies():
    logits = torch.randn(2, 64, 1000, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 64))
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        lm_loss(logits, labels)
    large = [t for t in kept if t.numel() >= logits.numel()]
    assert [(t.dtype, t.numel()) for t in large] == [(torch.bfloat16, logits.numel())]
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        F.cross_entropy(logits.reshape(-1, 1000).float(), labels.reshape(-1))
    assert any(t.dtype == torch.float32 and t.numel() == logits.numel() for t in kept)  # eager's fp32 log-softmax


def test_the_derived_head_chunks_as_the_loss_does():
    assert layer_shapes.LOSS_CHUNK_BYTES == transformer.LOSS_CHUNK_BYTES


def test_a_micro_batch_without_a_valid_label_has_a_nan_loss_and_a_zero_gradient_as_eager():
    logits = torch.randn(2, 8, 50, dtype=torch.bfloat16)
    logits[0, 0, 0] = float("-inf")  # an ignored row whose picked index (0) is -inf: still no loss, no gradient
    labels = torch.full((2, 8), -100)
    (loss, gradient), (eager_loss, eager_gradient) = _both(logits, labels, incoming=1.0)
    assert torch.isnan(loss) and torch.isnan(eager_loss)
    assert torch.equal(gradient, torch.zeros_like(gradient)) and torch.equal(eager_gradient, gradient)
    labels[1, 3] = 7
    (loss, gradient), (eager_loss, _) = _both(logits, labels, incoming=1.0)
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-6) and torch.isfinite(gradient).all()
