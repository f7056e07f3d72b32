"""Multi-head attention whose position information and gate are objects passed in."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..encodings import NoPosition, Positions, RelativeEncoding
from ..kernels import PositionTerm


@dataclass
class KVCache:
    """Keys and values seen so far by one self-attention layer, for incremental decoding.

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
        gate: URPE's C, a module called with a `Positions` (`ToeplitzGate`, `RelationGate`),
            or None.
        normalization, dropout, backend: passed to `urpe.attention` (dropout only in training).
        kdim, vdim: widths of key/value inputs for cross-attention (default dim).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        position: RelativeEncoding | None = None,
        gate: nn.Module | None = None,
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
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
        positions: Positions | None = None,
        memory: Tensor | None = None,
        bias: PositionTerm | None = None,
        gate: PositionTerm | None = None,
    ) -> Tensor:
        """query (B, Lq, E) -> (B, Lq, E).

        Args:
            key, value: (B, Lk, kdim/vdim) for cross-attention (default: self-attention on query).
            key_padding_mask: (B, Lk) bool, True = padded, for the keys of this call (with memory
                either (B, M + Lq) or (B, Lq), memory then counting as real).
            attn_mask: SDPA's meaning, broadcastable to (B, H, Lq, Lk) over all keys (cache and
                memory included): bool True = takes part, float = added to the logits.
            is_causal: query i sees keys j <= i + Lk - Lq (by index: queries are the last Lq keys).
            cache: self-attention only; the new keys are appended and queries attend to all.
            positions: where queries and keys sit (`urpe.Positions`), over all Lk keys. Default:
                `Positions.sequence(Lq, past=cache length or M)` for self-attention,
                `Positions.aligned(Lq, Lk)` for cross-attention.
            memory: (B, M, E) hidden states of earlier positions (a previous segment,
                Transformer-XL style), prepended to the keys and values of self-attention; they
                sit before the segment and are not queries.
            bias, gate: precomputed terms (tensor, `Toeplitz` or `Relation`) that replace the
                encoding's bias and the module's gate for this call (e.g. computed once per
                batch by a graph model).
        """
        if not isinstance(query, Tensor) or query.dim() != 3:
            raise ValueError(f"query must be (B, L, E), got shape {tuple(query.shape)}")
        cross = key is not None or value is not None
        if cross and cache is not None:
            raise ValueError(
                "a KVCache is for self-attention: with cross-attention the given keys would be "
                "appended to it on every call; project the fixed keys once instead"
            )
        if memory is not None and (cross or cache is not None):
            raise ValueError("memory is for self-attention without a KVCache")
        b, lq = query.shape[:2]
        if cross:
            key = query if key is None else key
            value = key if value is None else value
            kv_input, past = (key, value), 0
        else:
            source = query
            if memory is not None:
                if memory.dim() != 3 or memory.shape[0] != b or memory.shape[2] != query.shape[2]:
                    raise ValueError(
                        f"memory must be (B, M, E) = ({b}, M, {query.shape[2]}), "
                        f"got {tuple(memory.shape)}"
                    )
                source = torch.cat([memory.to(query.dtype), query], dim=1)  # (B, M + Lq, E)
                key_padding_mask = _memory_padding(key_padding_mask, memory.shape[1], lq)
            kv_input = (source, source)
            past = cache.length if cache is not None else source.shape[1] - lq
        q = self._heads(self.q_proj(query))  # (B, H, Lq, hd)
        k = self._heads(self.k_proj(kv_input[0]))  # (B, H, L_new, hd)
        v = self._heads(self.v_proj(kv_input[1]))  # (B, H, L_new, hd)
        lk = past + k.shape[-2] if cache is not None else k.shape[-2]
        if positions is None:
            if cross:
                positions = Positions.aligned(lq, lk, device=query.device)
            else:
                positions = Positions.sequence(lq, past=past, device=query.device)
        elif not isinstance(positions, Positions):
            raise TypeError(f"positions must be a urpe.Positions, got {type(positions).__name__}")
        positions.check_shape(lq, lk, b, device=query.device)
        q = self.position.rotate(q, positions.query)
        k = self.position.rotate(k, positions.key[..., lk - k.shape[-2] :])  # the new keys
        if cache is not None:
            k, v = cache.append(k, v, key_padding_mask)
            key_padding_mask = cache.padding
        if gate is None and self.gate is not None:
            gate = self.gate(positions)
        extra = {} if attn_mask is None else {"attn_mask": attn_mask}
        if bias is not None:
            extra["bias"] = bias
        out = self.position.attend(
            q,
            k,
            v,
            positions=positions,
            scale=self.head_dim**-0.5,
            gate=gate,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            normalization=self.normalization,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
            **extra,
        )  # (B, H, Lq, hd)
        out = out.transpose(1, 2).reshape(b, lq, self.dim)  # (B, Lq, E)
        return self.out_proj(out)


def _memory_padding(mask: Tensor | None, memory: int, length: int) -> Tensor | None:
    """A segment's (B, L) padding mask extended over M memory keys (real), or a (B, M + L) one."""
    if mask is None or mask.dim() != 2 or mask.shape[-1] == memory + length:
        return mask
    if mask.shape[-1] != length:
        raise ValueError(
            f"with memory, key_padding_mask must be (B, M + L) = (B, {memory + length}) or "
            f"(B, L) = (B, {length}), got {tuple(mask.shape)}"
        )
    return torch.cat([mask.new_zeros(mask.shape[0], memory), mask], dim=-1)
