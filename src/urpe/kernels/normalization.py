"""Row normalisations that turn logits s_ij into attention weights a_ij.

Each takes logits (..., Lq, Lk) and a keep mask (broadcastable bool, or None) and returns weights
with masked entries exactly 0. A row whose keys are all masked gets all-zero weights, never NaN.
Only softmax makes rows sum to 1; the other three are the row-sum-breaking variants Su (2022)
lists alongside URPE.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked(scores: Tensor, keep: Tensor | None, fill: float) -> Tensor:
    return scores if keep is None else scores.masked_fill(~keep, fill)


def _row_max(scores: Tensor) -> Tensor:
    # The shift cancels in softmax and l2, so it carries no gradient; rows that are all -inf
    # (fully masked) shift by 0 instead of -inf to keep exp() finite.
    m = scores.detach().amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def softmax_weights(scores: Tensor, keep: Tensor | None) -> Tensor:
    """a_ij = exp(s_ij) / sum_j exp(s_ij)."""
    s = _masked(scores, keep, float("-inf"))
    e = torch.exp(s - _row_max(s))
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def exp_weights(scores: Tensor, keep: Tensor | None) -> Tensor:
    """a_ij = exp(s_ij): no denominator."""
    return torch.exp(_masked(scores, keep, float("-inf")))


def l2_weights(scores: Tensor, keep: Tensor | None) -> Tensor:
    """a_ij = exp(s_ij) / sqrt(sum_j exp(2 s_ij)), computed with the row max shifted out."""
    s = _masked(scores, keep, float("-inf"))
    e = torch.exp(s - _row_max(s))
    norm = e.square().sum(dim=-1, keepdim=True).sqrt()
    return e / torch.where(norm > 0, norm, torch.ones_like(norm))


def relu2_weights(scores: Tensor, keep: Tensor | None) -> Tensor:
    """a_ij = relu(s_ij)^2 / n, n the number of unmasked keys in row i (GAU-style)."""
    a = torch.relu(_masked(scores, keep, 0.0)).square()
    if keep is None:
        return a / scores.shape[-1]
    n = keep.expand_as(scores).sum(dim=-1, keepdim=True).to(scores.dtype)
    return a / n.clamp_min(1)


NORMALIZERS = {
    "softmax": softmax_weights,
    "exp": exp_weights,
    "l2": l2_weights,
    "relu2": relu2_weights,
}
