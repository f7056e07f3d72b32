"""Learned marker tokens around a sequence: the model's own [CLS] ... [SEP] (Su 2022).

Because the first and last tokens differ from the rest, even an unmodified RPE Transformer can
tell positions apart on an input of identical tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MarkerTokens(nn.Module):
    def __init__(self, dim: int, append_end: bool = True):
        super().__init__()
        self.start = nn.Parameter(torch.randn(dim) * 0.02)
        self.end = nn.Parameter(torch.randn(dim) * 0.02) if append_end else None

    @property
    def count(self) -> int:
        return 1 if self.end is None else 2

    def wrap(self, x: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """x (B, L, E) -> (B, L + count, E): [CLS] x [SEP], with [SEP] right after each row's
        last real token (padding (B, L) True = padded) and the padding mask extended to match."""
        b, length, dim = x.shape
        start = self.start.to(x.dtype).expand(b, 1, dim)
        if self.end is None:
            wrapped = torch.cat([start, x], dim=1)
            return wrapped, None if padding is None else nn.functional.pad(padding, (1, 0))
        tail = x.new_zeros(b, 1, dim)
        wrapped = torch.cat([start, x, tail], dim=1)  # (B, L+2, E)
        real = length if padding is None else length - padding.sum(1, keepdim=True)  # (B, 1)
        positions = torch.arange(length + 2, device=x.device)[None, :]  # (1, L+2)
        is_end = positions == real + 1  # (B or 1, L+2)
        wrapped = torch.where(is_end[..., None], self.end.to(x.dtype), wrapped)
        new_padding = None if padding is None else positions > real + 1
        return wrapped, new_padding

    def unwrap(self, x: Tensor, length: int) -> Tensor:
        """Drop the markers: (B, L + count, E) -> (B, L, E)."""
        return x[:, 1 : 1 + length]
