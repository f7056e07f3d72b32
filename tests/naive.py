"""An independent, loop-by-loop statement of URPE attention, for checking the kernels.

Deliberately written differently from `urpe.kernels.reference`: per query row, over an explicit
list of visible keys, with the Toeplitz lookup done by hand.
"""

from __future__ import annotations

import math

import torch


def toeplitz_by_hand(table: torch.Tensor, lq: int, lk: int) -> torch.Tensor:
    """(H, 2K+1) -> (1, H, Lq, Lk): [h, i, j] = table[h, clamp(j - (i + lk - lq), -K, K) + K]."""
    heads, width = table.shape
    k = (width - 1) // 2
    out = torch.empty(1, heads, lq, lk, dtype=table.dtype)
    for i in range(lq):
        for j in range(lk):
            d = j - (i + lk - lq)
            out[0, :, i, j] = table[:, min(max(d, -k), k) + k]
    return out


def naive_attention(
    q, k, v, bias=None, gate=None, padding=None, causal=False, norm="softmax", visible=None
):
    """bias and gate: dense tensors broadcastable to (B, H, Lq, Lk) or None. visible: bool
    broadcastable to (B, H, Lq, Lk) (a boolean attn_mask) or None. k, v may have fewer heads than
    q (grouped queries: head h reads h // (H / Hkv))."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    group = h // k.shape[1]
    scale = 1.0 / math.sqrt(d)
    full = (b, h, lq, lk)
    bias = torch.zeros(full, dtype=q.dtype) if bias is None else bias.expand(full)
    gate = torch.ones(full, dtype=q.dtype) if gate is None else gate.expand(full)
    visible = torch.ones(full, dtype=torch.bool) if visible is None else visible.expand(full)
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                pos = i + lk - lq
                keys = [
                    j
                    for j in range(lk)
                    if not (padding is not None and bool(padding[bi, j]))
                    and not (causal and j > pos)
                    and bool(visible[bi, hi, i, j])
                ]
                if not keys:
                    continue
                kh = hi // group
                s = torch.stack(
                    [scale * q[bi, hi, i] @ k[bi, kh, j] + bias[bi, hi, i, j] for j in keys]
                )
                if norm == "softmax":
                    w = torch.exp(s) / torch.exp(s).sum()
                elif norm == "exp":
                    w = torch.exp(s)
                elif norm == "l2":
                    w = torch.exp(s) / torch.exp(2 * s).sum().sqrt()
                elif norm == "relu2":
                    w = torch.relu(s) ** 2 / len(keys)
                else:
                    raise ValueError(norm)
                for w_j, j in zip(w, keys, strict=True):
                    out[bi, hi, i] += w_j * gate[bi, hi, i, j] * v[bi, kh, j]
    return out
