"""One Transformer block: a token mixer (attention or a Yun et al. mixer) and a feed-forward net."""

from __future__ import annotations

from torch import Tensor, nn

from .context import AttentionContext
from .past import KVCache

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class FeedForward(nn.Sequential):
    """A Transformer layer's position-wise feed-forward block: x (..., dim) -> Linear(dim,
    hidden) -> activation (a name in `ACTIVATIONS`) -> dropout -> Linear(hidden, dim)."""

    def __init__(self, dim: int, hidden: int, activation: str = "gelu", dropout: float = 0.0):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        super().__init__(
            nn.Linear(dim, hidden),
            ACTIVATIONS[activation](),
            nn.Dropout(dropout),
            nn.Linear(hidden, dim),
        )


class TransformerLayer(nn.Module):
    """Residual mixer + feed-forward, with LayerNorm after (post-LN, the paper's RoBERTa host)
    or before (pre-LN) each residual branch."""

    def __init__(
        self,
        mixer: nn.Module,
        dim: int,
        ffn_dim: int,
        *,
        dropout: float = 0.0,
        norm_first: bool = False,
        activation: str = "gelu",
    ):
        super().__init__()
        self.mixer = mixer
        self.ffn = FeedForward(dim, ffn_dim, activation, dropout)
        self.norm_mixer, self.norm_ffn = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(
        self,
        x: Tensor,
        context: AttentionContext | None = None,
        *,
        past: KVCache | None = None,
        **keywords,
    ) -> Tensor:
        """x (B, L, E) -> (B, L, E).

        context: the forward pass's `AttentionContext`; past: this layer's past keys (a decoding
        cache, or `memory_cache` of segment memory). keywords: the mixer's per-call form
        (key_padding_mask=, positions=, cache=, memory= (B, M, E) states at this layer's input,
        pre-LN: normalised like x), passed on.
        """
        if keywords.get("memory") is not None and self.norm_first:
            keywords["memory"] = self.norm_mixer(keywords["memory"])
        if self.norm_first:
            x = x + self.dropout(
                self.mixer(self.norm_mixer(x), context=context, past=past, **keywords)
            )
            return x + self.dropout(self.ffn(self.norm_ffn(x)))
        x = self.norm_mixer(x + self.dropout(self.mixer(x, context=context, past=past, **keywords)))
        return self.norm_ffn(x + self.dropout(self.ffn(x)))

    def memory_cache(
        self, states: Tensor, key_positions: Tensor, padding: Tensor | None = None
    ) -> KVCache:
        """Past keys of segment memory: M hidden states (B, M, E) at this layer's input (what it
        saw as x for them), at key_positions (M,) or (B, M); normalised first in a pre-LN
        layer, as x is."""
        if not hasattr(self.mixer, "project_keys_values"):
            raise ValueError("segment memory needs attention in every layer (no mixers)")
        states = self.norm_mixer(states) if self.norm_first else states
        return KVCache.from_memory(self.mixer, states, key_positions, padding)
