"""URPE's gate C: a learned Toeplitz matrix multiplied into the attention weights after the
normalisation (paper's Eq. 8). Rows of softmax(.) * C need not sum to 1, which is what restores
universal approximation. Initialised to ones, URPE starts out exactly equal to its RPE.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import Toeplitz
from .bias import all_offsets
from .buckets import t5_buckets

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "softplus": F.softplus,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "abs": torch.abs,
}


class ToeplitzGate(nn.Module):
    """c_ij = act(table[h, offset(j - i)]), per head.

    Args:
        num_heads: heads H.
        max_distance: K for the "unique" mode: offsets -K..K each get an entry, farther ones
            reuse the edge entries (clipping).
        num_buckets: if given, T5-style log buckets (up to `bucket_max_distance`) replace the
            per-offset entries ("urpe-t5").
        init: "ones" (the paper's constant init) or "normal" (N(init_mean, init_std)).
        activation: None (the paper: unconstrained) or a name in ACTIVATIONS, or a callable,
            applied to the table.
    """

    def __init__(
        self,
        num_heads: int,
        max_distance: int = 0,
        *,
        num_buckets: int | None = None,
        bucket_max_distance: int = 128,
        init: str = "ones",
        init_mean: float = 0.0,
        init_std: float = 0.02,
        activation: str | Callable[[Tensor], Tensor] | None = None,
    ):
        super().__init__()
        width = num_buckets if num_buckets is not None else 2 * max_distance + 1
        if init == "ones":
            table = torch.ones(num_heads, width)
        elif init == "normal":
            table = torch.randn(num_heads, width) * init_std + init_mean
        else:
            raise ValueError(f"init must be 'ones' or 'normal', got {init!r}")
        self.table = nn.Parameter(table)
        self.num_buckets, self.bucket_max_distance = num_buckets, bucket_max_distance
        if isinstance(activation, str):
            if activation not in ACTIVATIONS:
                raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a callable")
            activation = ACTIVATIONS[activation]
        self.activation = activation

    def forward(self, lq: int, lk: int) -> Toeplitz:
        """The gate for Lq queries over Lk keys, as a Toeplitz term for `urpe.attention`."""
        table = self.table
        if self.num_buckets is not None:
            offsets = all_offsets(lq, lk, table.device)
            table = table[:, t5_buckets(offsets, self.num_buckets, self.bucket_max_distance)]
        if self.activation is not None:
            table = self.activation(table)
        return Toeplitz(table)
