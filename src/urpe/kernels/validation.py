"""Argument checks for `urpe.attention`: one clear error naming the argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .tables import PositionTerm, Relation, Toeplitz

NORMALIZATIONS = ("softmax", "exp", "l2", "relu2")


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    lq: int
    lk: int
    head_dim: int
    value_dim: int


def _check_term(name: str, term: PositionTerm | None, shape: AttentionShape, dtype) -> None:
    if term is None:
        return
    full = (shape.batch, shape.heads, shape.lq, shape.lk)
    if isinstance(term, Tensor):
        if not term.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {term.dtype}")
        if term.dim() > 4:
            raise ValueError(
                f"{name} must broadcast to (B, H, Lq, Lk) = {full}, got rank {term.dim()}"
            )
        try:
            torch.broadcast_shapes(term.shape, full)
        except RuntimeError:
            raise ValueError(
                f"{name} of shape {tuple(term.shape)} does not broadcast to (B, H, Lq, Lk) = {full}"
            ) from None
        if torch.broadcast_shapes(term.shape, full) != full:
            raise ValueError(
                f"{name} of shape {tuple(term.shape)} is larger than (B, H, Lq, Lk) = {full}"
            )
        return
    if isinstance(term, (Toeplitz, Relation)):
        if term.num_heads not in (1, shape.heads):
            raise ValueError(
                f"{name} table has {term.num_heads} heads, expected 1 or {shape.heads} (from q)"
            )
        if term.table.dtype != dtype and dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} table dtype {term.table.dtype} does not match q dtype {dtype}")
        if isinstance(term, Relation):
            b, lq, lk = term.index.shape
            if (lq, lk) != (shape.lq, shape.lk) or b not in (1, shape.batch):
                raise ValueError(
                    f"{name} index has shape {tuple(term.index.shape)}, "
                    f"expected ({shape.batch} or 1, {shape.lq}, {shape.lk})"
                )
        return
    raise TypeError(
        f"{name} must be a Tensor, urpe.Toeplitz or urpe.Relation, got {type(term).__name__}"
    )


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: PositionTerm | None,
    gate: PositionTerm | None,
    key_padding_mask: Tensor | None,
    normalization: str,
    dropout_p: float,
) -> AttentionShape:
    """Validate `urpe.attention` arguments; return the problem's sizes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape (B, H, L, D), got rank {t.dim()}: {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, h, lq, d = q.shape
    if k.shape[:2] != (b, h) or v.shape[:2] != (b, h):
        raise ValueError(
            f"q, k, v must agree in batch and heads (B, H): got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[-1] != d:
        raise ValueError(f"k head dim {k.shape[-1]} does not match q head dim {d}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v length {v.shape[-2]} does not match k length {k.shape[-2]}")
    shape = AttentionShape(b, h, lq, k.shape[-2], d, v.shape[-1])
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    _check_term("bias", bias, shape, q.dtype)
    _check_term("gate", gate, shape, q.dtype)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool Tensor (True marks a padded key)")
        if tuple(key_padding_mask.shape) != (b, shape.lk):
            raise ValueError(
                f"key_padding_mask must have shape (B, Lk) = {(b, shape.lk)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
    return shape
