"""Which keys each query may see: key padding, causality and a boolean `attn_mask`.

These three are the *hiding* masks. A hidden (query, key) pair takes no part in the call at all:
its weight is exactly 0 under every normalisation, and non-finite numbers in a hidden key or value
never reach the query's output (see `nonfinite`). A `-inf` in a bias or a float `attn_mask` also
gives weight 0, but does not hide the key's contents.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .tables import relative_offsets


def causal_keep(lq: int, lk: int, device: torch.device | None = None) -> Tensor:
    """(Lq, Lk) bool: query i sees key j iff j <= i + Lk - Lq (the last query meets the last key).

    This is urpe's alignment, which decoding with a cache needs. SDPA's `is_causal` aligns the
    first query with the first key instead (j <= i); the two agree when Lq == Lk.
    """
    return relative_offsets(lq, lk, device) <= 0


def keep_mask(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    lq: int,
    lk: int,
    device: torch.device | None = None,
) -> Tensor | None:
    """Bool (B|1, H|1, Lq|1, Lk), True where query i may see key j; None when nothing is hidden.

    key_padding_mask: (B|1, Lk) bool, True marks a padded key. attn_mask: 4-D, only a bool one
    hides (True takes part); a float mask is additive and is ignored here.
    """
    keep = None
    if is_causal:
        keep = causal_keep(lq, lk, device)[None, None]  # (1, 1, Lq, Lk)
    if key_padding_mask is not None:
        keys = ~key_padding_mask[:, None, None, :]  # (B|1, 1, 1, Lk)
        keep = keys if keep is None else keep & keys
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    return keep


def visible_key_counts(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    lq: int,
    lk: int,
    key_flags: Tensor | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """n_i: how many keys query i sees (only keys with key_flags True, if given).

    key_flags: (B|1, H|1, Lk) bool or None. Returns int64 (B|1, H|1, Lq). Without a boolean
    attn_mask this never builds an (Lq, Lk) matrix: causal counts are prefix sums over the keys.
    Either mask may broadcast over the keys (key dim 1): it then counts for all Lk of them.
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep_mask(key_padding_mask, attn_mask, is_causal, lq, lk, device)
        if key_flags is not None:
            keep = keep & key_flags[..., None, :]  # (B|1, H|1, Lq|1, Lk|1)
        keep = keep.expand(*keep.shape[:-1], lk)  # a broadcast key dim stands for Lk keys
        return keep.sum(-1).expand(*keep.shape[:2], lq)
    keys = torch.ones(1, 1, lk, dtype=torch.bool, device=device)  # (B|1, H|1, Lk)
    if key_padding_mask is not None:
        keys = keys & ~key_padding_mask[:, None, :]  # (B|1, Lk|1) broadcasts over the keys
    if key_flags is not None:
        keys = keys & key_flags
    if not is_causal:
        return keys.sum(-1, keepdim=True).expand(*keys.shape[:2], lq)
    # seen[..., c]: flagged keys among the first c; query i sees the first i + Lk - Lq + 1
    seen = torch.cat([torch.zeros_like(keys[..., :1], dtype=torch.int64), keys.cumsum(-1)], -1)
    last = (torch.arange(lq, device=device) + (lk - lq + 1)).clamp(0, lk)  # (Lq,)
    return seen[..., last]
