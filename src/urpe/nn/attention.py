"""Multi-head attention whose position information and gate are objects passed in."""

from __future__ import annotations

from torch import Tensor, nn

from ..encodings import NoPosition, RelativeEncoding
from ..kernels import attention
from .context import AttentionContext
from .past import KVCache


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

    def project_keys_values(
        self, states: Tensor, key_positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys (rotated at key_positions (M,) or (B, M)) and values (B, H, M, hd) of states
        (B, M, kdim), and the encoding's key state (B, H, M) or None: what
        `KVCache.from_memory` stores for segment memory."""
        k = self.position.rotate(self._heads(self.k_proj(states)), key_positions)
        return k, self._heads(self.v_proj(states)), self.position.key_state(states)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        context: AttentionContext | None = None,
        *,
        past: KVCache | None = None,
        **keywords,
    ) -> Tensor:
        """query (B, Lq, E) -> (B, Lq, E).

        Args:
            key, value: (B, Lk, kdim/vdim) for cross-attention (default: self-attention on query).
            context: the forward pass's `AttentionContext` (positions over all keys, masks, causal
                flag, precomputed terms); None: a plain sequence, no masks.
            past: self-attention only; past keys (a decoding cache, or segment memory as
                `KVCache.from_memory`) before this call's keys: the new keys are appended to it
                and the queries attend to all.
            keywords: the per-call form, `key_padding_mask=`, `attn_mask=`, `is_causal=`,
                `positions=`, `bias=`, `gate=`, `document_ids=` (an `AttentionContext` is built
                from them),
                `cache=` (= past) and `memory=` (B, M, E) hidden states of M earlier positions
                (Transformer-XL; made into past keys here, at positions 0 .. M - 1 before the
                segment, with key_padding_mask (B, M + Lq) or (B, Lq)).
        """
        if not isinstance(query, Tensor) or query.dim() != 3:
            raise ValueError(f"query must be (B, L, E), got shape {tuple(query.shape)}")
        cross = key is not None or value is not None
        if keywords:
            if context is not None:
                raise TypeError("give an AttentionContext or per-call keywords, not both")
            context, pasts = AttentionContext.from_keywords(**keywords)
            past = self._past_from_keywords(query, cross, context, past, **pasts)
        context = context if context is not None else AttentionContext()
        if cross and past is not None:
            raise ValueError(
                "a KVCache is for self-attention: with cross-attention the given keys would be "
                "appended to it on every call; project the fixed keys once instead"
            )
        b, lq = query.shape[:2]
        if cross:
            key = query if key is None else key
            value = key if value is None else value
        else:
            key = value = query
        q = self._heads(self.q_proj(query))  # (B, H, Lq, hd)
        k = self._heads(self.k_proj(key))  # (B, H, L_new, hd)
        v = self._heads(self.v_proj(value))  # (B, H, L_new, hd)
        lk = k.shape[-2] + (past.length if past is not None else 0)
        positions = context.positions_for(lq, lk, b, query.device)
        q = self.position.rotate(q, positions.query)
        k = self.position.rotate(k, positions.key[..., lk - k.shape[-2] :])  # the new keys
        key_padding_mask, documents = context.key_padding_mask, context.document_ids
        key_state = self.position.key_state(key)  # (B, H, L_new) or None
        calls = context.calls
        if past is not None:
            k, v = past.append(k, v, key_padding_mask, documents, key_state)
            key_padding_mask, documents, key_state = past.padding, past.documents, past.key_state
            calls = past.calls
        scale = self.head_dim**-0.5
        extra = {} if context.attn_mask is None else {"attn_mask": context.attn_mask}
        if documents is not None:
            extra["document_ids"] = documents
        if key_state is not None:
            extra["key_state"] = key_state
        if calls is not attention and self.position.takes_calls:
            extra["calls"] = calls
        bias = context.bias
        if bias is None and self.position.query_independent:  # one term per pass (and tie)
            bias = context.term(
                "bias",
                self.position,
                positions,
                lambda: self.position.bias(q, positions, scale),
                q.dtype,
                scale,
            )
        if bias is not None:
            extra["bias"] = bias
        gate = context.gate
        if gate is None and self.gate is not None:
            gate = context.term("gate", self.gate, positions, lambda: self.gate(positions))
        out = self.position.attend(
            q,
            k,
            v,
            positions=positions,
            scale=scale,
            gate=gate,
            key_padding_mask=key_padding_mask,
            is_causal=context.is_causal,
            normalization=self.normalization,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
            **extra,
        )  # (B, H, Lq, hd)
        out = out.transpose(1, 2).reshape(b, lq, self.dim)  # (B, Lq, E)
        return self.out_proj(out)

    def _past_from_keywords(
        self,
        query: Tensor,
        cross: bool,
        context: AttentionContext,
        past: KVCache | None,
        cache: KVCache | None,
        memory: Tensor | None,
    ) -> KVCache | None:
        """The past keys of the per-call form: `cache=` as is, `memory=` projected (in place of
        the context's key_padding_mask, the part over the segment)."""
        if cache is not None:
            if past is not None:
                raise TypeError("give past= or cache=, not both")
            past = cache
        if memory is None:
            return past
        if cross or past is not None:
            raise ValueError("memory is for self-attention without a KVCache")
        b, lq, dim = query.shape
        if memory.dim() != 3 or memory.shape[0] != b or memory.shape[2] != dim:
            raise ValueError(
                f"memory must be (B, M, E) = ({b}, M, {dim}), got {tuple(memory.shape)}"
            )
        m = memory.shape[1]
        positions = context.positions_for(lq, m + lq, b, query.device)
        memory_padding, context.key_padding_mask = split_memory_padding(
            context.key_padding_mask, m, lq
        )
        keys = positions.key[..., :m]
        return KVCache.from_memory(self, memory.to(query.dtype), keys, memory_padding)


def split_memory_padding(
    mask: Tensor | None, memory: int, length: int
) -> tuple[Tensor | None, Tensor | None]:
    """A padding mask given with M memory keys as (memory part, segment part): a (B, M + L) mask
    is split, a (B, L) one counts the memory as real (None)."""
    if mask is None or mask.dim() != 2 or mask.shape[-1] == length:
        return None, mask
    if mask.shape[-1] != memory + length:
        raise ValueError(
            f"with memory, key_padding_mask must be (B, M + L) = (B, {memory + length}) or "
            f"(B, L) = (B, {length}), got {tuple(mask.shape)}"
        )
    return mask[:, :memory], mask[:, memory:]
