"""Transformer encoder and causal decoder assembled from a `TransformerConfig`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn import KVCache
from .builders import build_absolute, build_layers
from .config import TransformerConfig
from .markers import MarkerTokens


def check_tokens(tokens: Tensor, vocab_size: int, key_padding_mask: Tensor | None) -> None:
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError("tokens must be an integer tensor of shape (B, L)")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}), got {tokens.min()}..{tokens.max()}"
        )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or key_padding_mask.shape != tokens.shape
    ):
        raise ValueError(
            f"key_padding_mask must be bool of shape {tuple(tokens.shape)} (True = padded)"
        )


class _Transformer(nn.Module):
    causal: bool = False

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = c = config
        self.markers = MarkerTokens(c.dim, append_end=not self.causal) if c.markers else None
        length = c.max_len + (self.markers.count if self.markers else 0)
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.absolute = build_absolute(c, length)
        self.embed_norm = nn.LayerNorm(c.dim) if c.embedding_norm else nn.Identity()
        self.embed_dropout = nn.Dropout(c.dropout)
        self.layers = build_layers(c, self.causal, length)
        self.final_norm = nn.LayerNorm(c.dim) if c.norm_first else nn.Identity()

    def _hidden(
        self, tokens: Tensor, key_padding_mask: Tensor | None, cache: list[KVCache] | None
    ) -> Tensor:
        """tokens (B, L) -> hidden states (B, L, E) of the real tokens."""
        check_tokens(tokens, self.config.vocab_size, key_padding_mask)
        offset = cache[0].length if cache else 0
        x = self.embed(tokens)  # (B, L, E)
        wrap = self.markers is not None and offset == 0  # later chunks find it in the cache
        if wrap:
            x, key_padding_mask = self.markers.wrap(x, key_padding_mask)
        if self.absolute is not None:
            x = self.absolute(x, offset)
        x = self.embed_dropout(self.embed_norm(x))
        for index, layer in enumerate(self.layers):
            x = layer(
                x,
                key_padding_mask=key_padding_mask,
                is_causal=self.causal,
                cache=None if cache is None else cache[index],
            )
        x = self.final_norm(x)
        return self.markers.unwrap(x, tokens.shape[1]) if wrap else x


class TransformerEncoder(_Transformer):
    """Bidirectional encoder: tokens (B, L) -> hidden states (B, L, E)."""

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self._hidden(tokens, key_padding_mask, cache=None)


class TransformerDecoder(_Transformer):
    """Causal language model: tokens (B, L) -> next-token logits (B, L, V).

    Pass `cache=model.new_cache()` and feed tokens a chunk at a time to decode incrementally;
    the result equals the full forward pass.
    """

    causal = True

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def new_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def forward(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None = None,
        cache: list[KVCache] | None = None,
    ) -> Tensor:
        return self.head(self._hidden(tokens, key_padding_mask, cache))
