"""The reference attention: plain PyTorch that materialises every (Lq, Lk) matrix.

This is the specification. Every fast kernel is tested against it:

    s = scale * q @ k^T + B + M          (B: bias, a `Decay` densified; M: a float attn_mask)
    a = normalize(s) over visible keys   (hidden pairs get exactly 0; see `masks`)
    a = a * C                            (C: URPE's gate, after normalisation)
    out = dropout(a) @ v

Query head h reads key/value head h // (H / Hkv) (grouped-query attention). Half precision is
computed in float32. Dispatch applies the non-finite rule of `nonfinite` around this (and every)
kernel, so q, k and v arrive finite here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .capabilities import ANY_KIND, Capabilities
from .dropout import dropout_scale
from .masks import keep_mask
from .nonfinite import guarded
from .spec import AttentionSpec, resolve
from .terms import dense_term

# Every call `urpe.attention` accepts, with every term kind (through its dense form) and plain
# PyTorch ops, so autograd and forward-mode AD reach every input.
REFERENCE_CAPABILITIES = Capabilities(
    "the reference", bias=ANY_KIND, gate=ANY_KIND, forward_ad=True
)


def draw_seed(device: torch.device) -> Tensor:
    """A fresh dropout seed from torch's generator, as an int64 scalar tensor (no host sync)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


def reference_weights_of(spec: AttentionSpec) -> Tensor:
    """Attention weights after normalisation, gate and dropout: (B, H, Lq, Lk), compute dtype."""
    dtype = spec.compute_dtype
    q, k = spec.q.to(dtype), spec.k.to(dtype)
    if spec.groups > 1:
        k = k.repeat_interleave(spec.groups, dim=1)  # (B, H, Lk, D)
    scores = (q @ k.transpose(-2, -1)) * spec.scale  # (B, H, Lq, Lk)
    for term in (dense_term(spec.bias, spec.lq, spec.lk, dtype), spec.attn_mask):
        if term is not None and term.dtype != torch.bool:
            scores = scores + term.to(dtype)
    keep = keep_mask(
        spec.key_padding_mask,
        spec.attn_mask,
        spec.is_causal,
        spec.lq,
        spec.lk,
        q.device,
        spec.document_ids,
    )
    weights = spec.norm.weights(scores, keep)
    gate = dense_term(spec.gate, spec.lq, spec.lk, dtype)
    if gate is not None:
        weights = weights * gate.to(dtype)
        if keep is not None:  # a gate may hold inf/nan far away; hidden pairs stay exactly 0
            weights = weights.masked_fill(~keep, 0.0)
    if spec.dropout_p > 0.0:
        seed = spec.dropout_seed if spec.dropout_seed is not None else draw_seed(q.device)
        weights = weights * dropout_scale(seed, spec.dropout_p, weights.shape, dtype, q.device)
    return weights


def reference_run(spec: AttentionSpec) -> Tensor:
    """The reference backend: (B, H, Lq, Dv) in q's dtype."""
    weights = reference_weights_of(spec)
    v = spec.v.to(weights.dtype)
    if spec.groups > 1:
        v = v.repeat_interleave(spec.groups, dim=1)  # (B, H, Lk, Dv)
    return (weights @ v).to(spec.q.dtype)


def reference_weights(q: Tensor, k: Tensor, **kwargs) -> Tensor:
    """The weights `urpe.attention(q, k, v, **kwargs, backend="reference")` applies to v.

    q (..., H, Lq, D), k (..., Hkv, Lk, D) -> (..., H, Lq, Lk), in float32 for half-precision
    inputs. Keyword arguments as in `urpe.attention`. Rows that the non-finite rule makes NaN
    are NaN here too.
    """
    spec = resolve(q, k, k, **kwargs)
    if spec.is_empty:
        weights = q.new_zeros(spec.batch, spec.heads, spec.lq, spec.lk, dtype=spec.compute_dtype)
    else:
        weights, _ = guarded(reference_weights_of, spec, finds_nonfinite=False)
    return weights.reshape(*spec.batch_shape, spec.heads, spec.lq, spec.lk)
