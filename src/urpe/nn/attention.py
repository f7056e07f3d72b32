"""Multi-head attention whose position information and gate are objects passed in."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..encodings import NoPosition, RelativeEncoding, ToeplitzGate


@dataclass
class KVCache:
    """Keys and values seen so far by one attention layer, for incremental decoding.

    keys, values: (B, H, L, D) (already rotated where the encoding rotates); padding: (B, L) bool
    or None. Starts empty; `MultiheadAttention` appends to it in place.
    """

    keys: Tensor | None = None
    values: Tensor | None = None
    padding: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, k: Tensor, v: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
        if padding is not None or self.padding is not None:
            b, new = k.shape[0], k.shape[-2]
            old = self.length - new
            prev = self.padding if self.padding is not None else k.new_zeros(b, old, dtype=bool)
            cur = padding if padding is not None else k.new_zeros(b, new, dtype=bool)
            self.padding = torch.cat([prev, cur], dim=-1)
        return self.keys, self.values


class MultiheadAttention(nn.Module):
    """Self- or cross-attention on (B, L, E) inputs through `urpe.attention`.

    Args:
        dim: model width E. num_heads: H (dim must divide by it).
        position: a `RelativeEncoding` (shared instances share parameters across layers).
        gate: a `ToeplitzGate` (URPE's C) or None.
        normalization, dropout, backend: passed to `urpe.attention` (dropout only in training).
        kdim, vdim: widths of key/value inputs for cross-attention (default dim).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        position: RelativeEncoding | None = None,
        gate: ToeplitzGate | None = None,
        normalization: str = "softmax",
        dropout: float = 0.0,
        backend: str = "auto",
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} must be divisible by num_heads={num_heads}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(kdim or dim, dim, bias=bias)
        self.v_proj = nn.Linear(vdim or dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.position = position if position is not None else NoPosition()
        self.gate = gate
        self.normalization, self.dropout, self.backend = normalization, dropout, backend

    def _heads(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, hd)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor:
        """query (B, Lq, E); key/value (B, Lk, E) for cross-attention (default: query).

        key_padding_mask: (B, Lk) bool, True = padded, for the keys given in this call.
        cache: self-attention only; the new keys are appended and queries attend to all of them.
        """
        if query.dim() != 3:
            raise ValueError(f"query must be (B, L, E), got shape {tuple(query.shape)}")
        key = query if key is None else key
        value = key if value is None else value
        offset = cache.length if cache is not None else 0
        q = self._heads(self.q_proj(query))  # (B, H, Lq, hd)
        k = self._heads(self.k_proj(key))  # (B, H, Lk, hd)
        v = self._heads(self.v_proj(value))  # (B, H, Lk, hd)
        q = self.position.rotate(q, torch.arange(offset, offset + q.shape[-2], device=q.device))
        k = self.position.rotate(k, torch.arange(offset, offset + k.shape[-2], device=k.device))
        if cache is not None:
            k, v = cache.append(k, v, key_padding_mask)
            key_padding_mask = cache.padding
        lq, lk = q.shape[-2], k.shape[-2]
        out = self.position.attend(
            q,
            k,
            v,
            scale=self.head_dim**-0.5,
            gate=self.gate(lq, lk) if self.gate is not None else None,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            normalization=self.normalization,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
        )  # (B, H, Lq, hd)
        out = out.transpose(1, 2).reshape(query.shape[0], lq, self.dim)
        return self.out_proj(out)
