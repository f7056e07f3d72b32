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


def _refuse_unsupported(
    name: str, cache, memory, attn_mask, bias, gate, positions, from_zero: bool
) -> None:
    """Mixers work by index over the current input only: refuse what they would ignore."""
    if cache is not None:
        raise NotImplementedError(f"{name} does not support incremental decoding")
    for what, value in (("memory", memory), ("attn_mask", attn_mask), ("bias", bias),
                        ("gate", gate)):  # fmt: skip
        if value is not None:
            raise NotImplementedError(f"{name} does not take {what}")
    if positions is not None and not (
        positions.is_aligned
        and positions.query_length == positions.key_length
        and (positions.query_start == 0 or not from_zero)
    ):
        raise NotImplementedError(
            f"{name} mixes tokens by index; it cannot take {positions} "
            "(only a plain sequence" + (" starting at position 0)" if from_zero else ")")
        )


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
        self, x: Tensor, *, key_padding_mask=None, is_causal=False, cache=None, memory=None,
        attn_mask=None, positions=None, bias=None, gate=None,
    ) -> Tensor:  # fmt: skip
        """x (B, L, E) -> (B, L, E); same keywords as `MultiheadAttention` (padding, causal)."""
        _refuse_unsupported("BilinearMixer", cache, memory, attn_mask, bias, gate, positions, True)
        length = x.shape[1]
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
        self, x: Tensor, *, key_padding_mask=None, is_causal=False, cache=None, memory=None,
        attn_mask=None, positions=None, bias=None, gate=None,
    ) -> Tensor:  # fmt: skip
        """x (B, L, E) -> (B, L, E); same keywords as `MultiheadAttention` (padding, causal)."""
        _refuse_unsupported(
            "SeparableConvMixer", cache, memory, attn_mask, bias, gate, positions, False
        )
        h = _zero_padding(x, key_padding_mask).transpose(1, 2)  # (B, E, L)
        left = self.kernel_size - 1 if is_causal else (self.kernel_size - 1) // 2
        h = F.pad(h, (left, self.kernel_size - 1 - left))  # zero padding keeps length L
        return self.pointwise(self.depthwise(h).transpose(1, 2))  # (B, L, E)
