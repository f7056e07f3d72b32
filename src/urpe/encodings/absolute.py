"""Absolute position encodings, added to the token embeddings once, before the first layer.

With these a Transformer is a universal approximator for fixed length (Yun et al. 2020).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .registry import register_absolute


def _angle_dtype(device: torch.device | str | None) -> torch.dtype:
    # float64 keeps sin(w p) exact to rounding for large p; MPS has no float64.
    return torch.float32 if torch.device(device or "cpu").type == "mps" else torch.float64


def sinusoid_frequencies(
    dim: int, device: torch.device | str | None = None, base: float = 10000.0
) -> Tensor:
    """w_c = base^(-c / (dim/2)) for c < dim/2, shape (dim/2,); float64 where the device has it."""
    half = dim // 2
    exponent = torch.arange(half, device=device, dtype=_angle_dtype(device)) / max(half, 1)
    return torch.exp(-math.log(base) * exponent)


def sinusoid(
    positions: Tensor, dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Vaswani et al.'s sinusoids. positions (...,) (any real values) -> (..., dim): [sin | cos].

    The angles are computed in float64 (float32 on MPS) and the result returned in `dtype`.
    """
    half = dim // 2
    freq = sinusoid_frequencies(dim, positions.device, base)
    angles = positions.to(freq.dtype)[..., None] * freq  # (..., dim/2)
    table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return nn.functional.pad(table, (0, dim - 2 * half)).to(dtype)  # odd dim: a zero channel


def _check_positions(x: Tensor, positions: int | Tensor) -> None:
    if isinstance(positions, Tensor):
        if positions.dim() not in (1, 2) or positions.shape[-1] != x.shape[1]:
            raise ValueError(
                f"positions must be (L,) or (B, L) with L = {x.shape[1]}, "
                f"got {tuple(positions.shape)}"
            )
    elif not isinstance(positions, int) or isinstance(positions, bool):
        raise TypeError(f"positions must be an int offset or a tensor, got {positions!r}")


@register_absolute("learned", lambda s: LearnedAbsolute(s.max_length, s.dim), uses_order=True)
class LearnedAbsolute(nn.Module):
    """A learned vector per position up to max_len; positions outside [0, max_len) are an error."""

    def __init__(self, max_len: int, dim: int, init_std: float = 0.02):
        super().__init__()
        self.max_len = max_len
        self.table = nn.Parameter(torch.randn(max_len, dim) * init_std)

    def forward(self, x: Tensor, positions: int | Tensor = 0) -> Tensor:
        """x (B, L, E) -> x + p. positions: an int offset (tokens at offset..offset+L-1) or the
        positions themselves, (L,) or (B, L)."""
        _check_positions(x, positions)
        if isinstance(positions, int):
            end = positions + x.shape[1]
            if positions < 0 or end > self.max_len:
                raise ValueError(
                    f"sequence covers positions {positions}..{end - 1}, outside the learned "
                    f"absolute encoding's [0, max_len={self.max_len}); use a relative encoding "
                    "to go longer"
                )
            return x + self.table[positions:end].to(x.dtype)
        message = f"positions must lie in [0, max_len={self.max_len}) for the learned encoding"
        inside = ((positions >= 0) & (positions < self.max_len)).all()
        if torch.compiler.is_compiling():
            torch._assert_async(inside, message)
        elif positions.numel() and not inside:
            raise ValueError(f"{message}, got {int(positions.min())}..{int(positions.max())}")
        return x + self.table[positions.long()].to(x.dtype)  # (L or B, L, E) broadcast


@register_absolute("sinusoidal", lambda s: SinusoidalAbsolute(s.dim), uses_order=True)
class SinusoidalAbsolute(nn.Module):
    """Fixed sinusoids added to the embeddings; defined at every position."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor, positions: int | Tensor = 0) -> Tensor:
        """x (B, L, E) -> x + sinusoid(p); positions as in `LearnedAbsolute.forward`."""
        _check_positions(x, positions)
        if isinstance(positions, int):
            positions = torch.arange(positions, positions + x.shape[1], device=x.device)
        return x + sinusoid(positions, self.dim, dtype=x.dtype)
