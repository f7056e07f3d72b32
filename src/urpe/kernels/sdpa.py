"""PyTorch's fused `scaled_dot_product_attention`, for the calls it can do: softmax, no gate.

SDPA takes a pre-softmax additive term but nothing after the softmax, so URPE's gate and the
row-sum-breaking normalisations are out of its reach. It also draws its own dropout mask, so it
cannot honour an explicit `dropout_seed`. `document_ids` and a `Decay` bias are handed over
densely (a (B|1, 1, Lq, Lk) bool mask, a (B|1, H, Lq, Lk) bias): the same results, at O(L^2)
memory, which the native kernels avoid (they come first in "auto" for Decay).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .capabilities import ANY_KIND, Capabilities, built_in
from .masks import keep_mask
from .spec import AttentionSpec
from .terms import dense_term

# Every bias kind through its dense form (SDPA adds a dense bias); no gate.
SDPA_CAPABILITIES = Capabilities(
    "SDPA", normalizations=built_in("softmax"), bias=ANY_KIND, gate=(), dropout="unseeded"
)


def sdpa_unsupported(spec: AttentionSpec) -> str | None:
    """Why SDPA cannot run this call beyond its table, or None when it can."""
    if spec.head_dim == 0:
        return "SDPA needs a head dim of at least 1"
    return None


def sdpa_run(spec: AttentionSpec) -> Tensor:
    """Softmax attention with optional bias and masks through `F.scaled_dot_product_attention`."""
    q, k, v = spec.q, spec.k, spec.v
    lq, lk = q.shape[2], k.shape[2]
    additive = None
    for term in (dense_term(spec.bias, lq, lk, spec.compute_dtype), spec.attn_mask):
        if term is not None and term.dtype != torch.bool:
            term = term.to(q.dtype)  # SDPA wants a float mask in the query's dtype
            additive = term if additive is None else additive + term
    # SDPA's own is_causal aligns top-left; ours aligns the last query with the last key, so it is
    # only handed over when the two agree (Lq == Lk) and nothing else needs masking.
    native_causal = (
        spec.is_causal
        and lq == lk
        and additive is None
        and spec.key_padding_mask is None
        and spec.attn_mask is None
        and spec.document_ids is None
    )
    mask = additive
    hides = (
        spec.key_padding_mask is not None
        or spec.document_ids is not None
        or (spec.attn_mask is not None and spec.attn_mask.dtype == torch.bool)
    )
    if hides or (spec.is_causal and not native_causal):
        keep = keep_mask(
            spec.key_padding_mask,
            spec.attn_mask,
            spec.is_causal,
            lq,
            lk,
            q.device,
            spec.document_ids,
        )
        mask = keep if additive is None else additive.masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=spec.dropout_p,
        is_causal=native_causal,
        scale=spec.scale,
        enable_gqa=spec.groups > 1,
    )
