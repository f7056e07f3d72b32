"""Which keys each query may see, from key padding and causality."""

from __future__ import annotations

from torch import Tensor

from .tables import relative_offsets


def keep_mask(
    key_padding_mask: Tensor | None, is_causal: bool, lq: int, lk: int, device
) -> Tensor | None:
    """Bool mask broadcastable to (B, 1, Lq, Lk): True where query i may attend to key j.

    key_padding_mask (B, Lk) marks padded keys with True. Causal masking uses absolute query
    positions (query i at i + Lk - Lq), so it is right for decoding with a cache.
    Returns None when nothing is masked.
    """
    keep = None
    if is_causal:
        keep = (relative_offsets(lq, lk, device) <= 0)[None, None]  # (1, 1, Lq, Lk)
    if key_padding_mask is not None:
        keys = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, Lk)
        keep = keys if keep is None else keep & keys
    return keep
