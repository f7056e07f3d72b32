"""The one interface through which position information enters an attention layer.

An encoding may rotate queries and keys (RoPE), return a term added to the logits (RPE, T5,
ALiBi, KERPLE, FIRE), or take over the whole attention call when it also changes the values
(Shaw) or the content term (Transformer-XL). The attention module never branches on which.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..kernels import PositionTerm, attention


class RelativeEncoding(nn.Module):
    """Base class, and by itself "no position information" (NoPE)."""

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Applied to q and k as they are produced. x (B, H, L, D), positions (L,) absolute."""
        return x

    def bias(self, q: Tensor, lk: int, scale: float) -> PositionTerm | None:
        """The pre-normalisation term for queries q (B, H, Lq, D) against Lk keys.

        Queries are the last Lq of the Lk positions (see `urpe.kernels.query_positions`).
        """
        return None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, **kwargs) -> Tensor:
        """The attention call with this encoding; kwargs are `urpe.attention`'s (gate, masks...)."""
        return attention(q, k, v, bias=self.bias(q, k.shape[-2], scale), scale=scale, **kwargs)


class NoPosition(RelativeEncoding):
    """NoPE: attention sees no position at all (causal masking may still leak some)."""
