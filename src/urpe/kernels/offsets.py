"""Where queries sit among the keys: the alignment every kernel, mask and term shares."""

from __future__ import annotations

import torch
from torch import Tensor


def query_positions(lq: int, lk: int, device: torch.device | None = None) -> Tensor:
    """Absolute positions of the queries: query i sits at i + Lk - Lq (the last Lq of Lk keys).

    This is what decoding with a KV cache needs: the Lq new queries are the newest positions.
    """
    return torch.arange(lk - lq, lk, device=device)


def relative_offsets(lq: int, lk: int, device: torch.device | None = None) -> Tensor:
    """Offsets d_ij = j - pos(i), key position minus query position. Shape (Lq, Lk), int64."""
    keys = torch.arange(lk, device=device)
    return keys[None, :] - query_positions(lq, lk, device)[:, None]
