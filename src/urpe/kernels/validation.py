"""Argument checks for `urpe.attention` (kept for callers of the first edition's helper).

The checks themselves live in `spec.resolve`, which every attention call runs.
"""

from __future__ import annotations

from torch import Tensor

from .spec import AttentionSpec, resolve
from .tables import PositionTerm


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: PositionTerm | None,
    gate: PositionTerm | None,
    key_padding_mask: Tensor | None,
    normalization: str,
    dropout_p: float,
    **kwargs,
) -> AttentionSpec:
    """Validate `urpe.attention` arguments (one clear error naming the argument); return the
    resolved call. kwargs: the other arguments of `urpe.attention` (attn_mask, enable_gqa, ...)."""
    return resolve(
        q,
        k,
        v,
        bias=bias,
        gate=gate,
        key_padding_mask=key_padding_mask,
        normalization=normalization,
        dropout_p=dropout_p,
        **kwargs,
    )
