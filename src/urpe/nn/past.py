"""Past keys: the one type for a KV cache (incremental decoding) and segment memory
(Transformer-XL). Both are keys and values of earlier positions that come before the queries'
own keys; a memory is such a cache built from hidden states, a decoding cache grows in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ..kernels import AttentionCalls


class ProjectsKeys(Protocol):
    """What `KVCache.from_memory` needs of an attention module."""

    def project_keys_values(
        self, states: Tensor, key_positions: Tensor
    ) -> tuple[
        Tensor, Tensor, Tensor | None
    ]: ...  # (B, M, E) -> keys, values (B, H, M, hd) (rotated as the encoding does), key state


@dataclass
class KVCache:
    """Keys and values seen so far by one self-attention layer.

    keys, values: (B, H, L, D) (already rotated where the encoding rotates); padding: (B, L) bool
    or None; documents: (B, L) document ids of packed sequences, or None; key_state: (B, H, L)
    what the encoding computed per key from the layer's input (FoX's log forget gates), or None.
    Starts empty; `MultiheadAttention` appends the keys of each call to it in place, and its
    queries attend to all of them. `calls` keeps the layer's prepared attention calls while it
    decodes: the prompt's and the steps' (one kind for every step: the number of keys is not
    part of a kind), so a step neither checks its arguments nor chooses a backend again.
    """

    keys: Tensor | None = None
    values: Tensor | None = None
    padding: Tensor | None = None
    documents: Tensor | None = None
    key_state: Tensor | None = None
    calls: AttentionCalls = field(default_factory=lambda: AttentionCalls(capacity=2), repr=False)

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    @classmethod
    def from_memory(
        cls,
        attention: ProjectsKeys,
        states: Tensor,
        key_positions: Tensor | None = None,
        padding: Tensor | None = None,
    ) -> KVCache:
        """The past keys that M hidden states (B, M, E) give in `attention` (segment memory).

        key_positions: (M,) or (B, M) positions of the memory keys (default 0 .. M - 1), for
        encodings that rotate keys. padding: (B, M) bool, True = padded, or None (all real).
        Differentiable in the attention's projections (the states are used as given).
        """
        if key_positions is None:
            key_positions = torch.arange(states.shape[1], device=states.device)
        cache = cls()
        k, v, key_state = attention.project_keys_values(states, key_positions)
        cache.append(k, v, padding, key_state=key_state)
        return cache

    def append(
        self,
        k: Tensor,
        v: Tensor,
        padding: Tensor | None,
        documents: Tensor | None = None,
        key_state: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Add the keys and values (B, H, n, D) of n new positions (with their padding (B, n),
        document ids (B, n) and key state (B, H, n), where given); returns all keys, values."""
        old = self.length
        self.documents = _extended(self.documents, documents, old, "document ids")
        self.key_state = _extended(self.key_state, key_state, old, "key states")
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


def _extended(held: Tensor | None, new: Tensor | None, old: int, what: str) -> Tensor | None:
    """`held` (over the `old` cached keys) with `new` appended along the last dimension; a cache
    holds them for all of its keys or for none."""
    if new is None and held is None:
        return None
    if new is None or (held is None and old > 0):
        raise ValueError(
            f"this KVCache holds {what} for {'all' if new is None else 'none'} of its {old} keys: "
            "give them with every call or with none (start a new cache)"
        )
    return new if held is None else torch.cat([held, new], dim=-1)
