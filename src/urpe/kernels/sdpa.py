"""PyTorch's fused `scaled_dot_product_attention`, for the cases it can do: softmax, no gate.

SDPA takes a pre-softmax additive term but nothing after the softmax, so URPE's gate and the
row-sum-breaking normalisations are out of its reach.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .masks import keep_mask
from .tables import PositionTerm, dense_term


def sdpa_unsupported(*, gate: PositionTerm | None, normalization: str, **_unused) -> str | None:
    """Why SDPA cannot run this call, or None when it can."""
    if gate is not None:
        return "SDPA has no post-softmax gate"
    if normalization != "softmax":
        return f"SDPA only does softmax, not {normalization!r}"
    return None


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias: PositionTerm | None = None,
    gate: PositionTerm | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    normalization: str = "softmax",
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Softmax attention with an optional bias through `F.scaled_dot_product_attention`."""
    reason = sdpa_unsupported(gate=gate, normalization=normalization)
    if reason is not None:
        raise ValueError(f"backend 'sdpa' cannot run this call: {reason}")
    lq, lk = q.shape[-2], k.shape[-2]
    mask = dense_term(bias, lq, lk)
    if mask is not None:
        mask = mask.to(q.dtype)
    # SDPA's own is_causal aligns top-left; ours aligns the queries to the last keys, so we only
    # hand causality over when the two agree (Lq == Lk) and there is nothing else to mask.
    native_causal = is_causal and lq == lk and mask is None and key_padding_mask is None
    keep = None if native_causal else keep_mask(key_padding_mask, is_causal, lq, lk, q.device)
    if keep is not None:
        if mask is None:
            mask = keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=native_causal, scale=scale
    )
