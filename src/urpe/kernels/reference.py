"""The reference attention: plain PyTorch that materialises every (Lq, Lk) matrix.

This is the specification. Every fast kernel is tested against it:

    s = scale * q @ k^T + B            (B: bias, before normalisation)
    a = normalize(s) over unmasked keys (masked keys get exactly 0)
    a = a * C                          (C: URPE's gate, after normalisation)
    out = dropout(a) @ v
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import keep_mask
from .normalization import NORMALIZERS
from .tables import PositionTerm, dense_term


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half precision is upcast: the paper's code also runs the softmax in float32.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def reference_weights(
    q: Tensor,
    k: Tensor,
    *,
    bias: PositionTerm | None = None,
    gate: PositionTerm | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    normalization: str = "softmax",
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Attention weights after normalisation, gate and dropout. Shape (B, H, Lq, Lk).

    Computed in float32 for half-precision inputs; returned in that compute dtype.
    """
    lq, lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    dtype = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = (q.to(dtype) @ k.to(dtype).transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    bias = dense_term(bias, lq, lk)
    if bias is not None:
        scores = scores + bias.to(dtype)
    keep = keep_mask(key_padding_mask, is_causal, lq, lk, q.device)
    weights = NORMALIZERS[normalization](scores, keep)
    gate = dense_term(gate, lq, lk)
    if gate is not None:
        weights = weights * gate.to(dtype)
        if keep is not None:  # a gate may hold inf/nan far away; masked keys stay exactly 0
            weights = weights.masked_fill(~keep, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights


def reference_attention(
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
    """Reference URPE attention. q (B,H,Lq,D), k (B,H,Lk,D), v (B,H,Lk,Dv) -> (B,H,Lq,Dv)."""
    weights = reference_weights(
        q,
        k,
        bias=bias,
        gate=gate,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        normalization=normalization,
        scale=scale,
        dropout_p=dropout_p,
    )
    return (weights @ v.to(weights.dtype)).to(q.dtype)
