"""Absolute position encodings, added to the token embeddings once, before the first layer.

With these a Transformer is a universal approximator for fixed length (Yun et al. 2020).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoid(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """Vaswani et al.'s sinusoids. positions (N,) (any real values) -> (N, dim): [sin | cos]."""
    half = dim // 2
    freq = torch.exp(-math.log(base) * torch.arange(half, device=positions.device) / half)
    angles = positions.float()[:, None] * freq[None, :]  # (N, dim/2)
    table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return nn.functional.pad(table, (0, dim - 2 * half))  # odd dim: one zero channel


class LearnedAbsolute(nn.Module):
    """A learned vector per position up to max_len; longer inputs are an error."""

    def __init__(self, max_len: int, dim: int, init_std: float = 0.02):
        super().__init__()
        self.max_len = max_len
        self.table = nn.Parameter(torch.randn(max_len, dim) * init_std)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """x (B, L, E) holding positions offset..offset+L-1 -> x + p."""
        end = offset + x.shape[1]
        if end > self.max_len:
            raise ValueError(
                f"sequence reaches position {end}, beyond the learned absolute encoding's "
                f"max_len={self.max_len}; use a relative encoding to go longer"
            )
        return x + self.table[offset:end].to(x.dtype)


class SinusoidalAbsolute(nn.Module):
    """Fixed sinusoids added to the embeddings; defined at every length."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        positions = torch.arange(offset, offset + x.shape[1], device=x.device)
        return x + sinusoid(positions, self.dim).to(x.dtype)
