"""RoPE (Su et al. 2021): rotate q and k so that q_i . k_j depends on j - i only."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import RelativeEncoding
from .registry import register_position


@register_position("rope", lambda s: RotaryEncoding(s.head_dim), uses_order=True)
class RotaryEncoding(RelativeEncoding):
    """Rotates pairs of channels (first half, second half) by angle pos * base^(-2c/D)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2).float() / head_dim)  # (D/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, L, D) rotated by positions (L,) shared by the batch, or (B, L) per row."""
        if positions.shape[-1] != x.shape[-2] or positions.dim() not in (1, 2):
            raise ValueError(
                f"RoPE positions must be (L,) or (B, L) with L = {x.shape[-2]}, "
                f"got {tuple(positions.shape)}"
            )
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq  # (B?, L, D/2)
        if angles.dim() == 3:
            angles = angles[:, None]  # (B, 1, L, D/2): the same angle for every head
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
