"""Token mixers from Yun et al. (2020) that can stand in for self-attention in chosen layers.

Both compute a contextual mapping without attention and both see position directly: the
bilinear mixer through its (n x n) matrix, the convolution through its kernel taps.
They share attention's call signature so a layer does not care which it holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _zero_padding(x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    return x if key_padding_mask is None else x.masked_fill(key_padding_mask[..., None], 0.0)


class BilinearMixer(nn.Module):
    """X -> P X W: a learned (n x n) matrix P mixes positions, a linear map W mixes features.

    n = max_len; shorter inputs use the leading block of P. Causal use keeps P lower-triangular.
    """

    def __init__(self, dim: int, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.positions = nn.Parameter(torch.eye(max_len) + torch.randn(max_len, max_len) * 0.02)
        self.features = nn.Linear(dim, dim)

    def forward(
        self, x: Tensor, *, key_padding_mask=None, is_causal=False, cache=None, **_
    ) -> Tensor:
        length = x.shape[1]
        if cache is not None:
            raise NotImplementedError("BilinearMixer does not support incremental decoding")
        if length > self.max_len:
            raise ValueError(f"BilinearMixer was built for max_len={self.max_len}, got {length}")
        p = self.positions[:length, :length]  # (L, L)
        if is_causal:
            p = p.tril()
        # Padded positions are zeroed after the feature map (its bias would leak otherwise).
        return p.to(x.dtype) @ _zero_padding(self.features(x), key_padding_mask)  # (B, L, E)


class SeparableConvMixer(nn.Module):
    """Depth-wise convolution over positions, then a point-wise linear map."""

    def __init__(self, dim: int, kernel_size: int = 3):
        super().__init__()
        self.kernel_size = kernel_size
        self.depthwise = nn.Conv1d(dim, dim, kernel_size, groups=dim)
        self.pointwise = nn.Linear(dim, dim)

    def forward(
        self, x: Tensor, *, key_padding_mask=None, is_causal=False, cache=None, **_
    ) -> Tensor:
        if cache is not None:
            raise NotImplementedError("SeparableConvMixer does not support incremental decoding")
        h = _zero_padding(x, key_padding_mask).transpose(1, 2)  # (B, E, L)
        left = self.kernel_size - 1 if is_causal else (self.kernel_size - 1) // 2
        h = F.pad(h, (left, self.kernel_size - 1 - left))  # zero padding keeps length L
        return self.pointwise(self.depthwise(h).transpose(1, 2))  # (B, L, E)
