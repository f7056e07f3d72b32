"""The one interface through which position information enters an attention layer.

An encoding may rotate queries and keys (RoPE), return a term added to the logits (RPE, T5,
ALiBi, KERPLE, FIRE, relation bias), or take over the whole attention call when it also changes
the values (Shaw) or the content term (Transformer-XL). The attention module never branches on
which. Every method reads where queries and keys sit from a `Positions` object.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..kernels import PositionTerm, Relation, Toeplitz, attention
from .positions import Positions
from .registry import register_position


class RelativeEncoding(nn.Module):
    """Base class, and by itself "no position information" (NoPE).

    Two class attributes state what an encoding is, for documentation and for tests that
    enumerate the registry:
        value_side: adds position information to the values as well (Shaw), so it can tell
            identical tokens apart under softmax; False for encodings that only edit logits.
        shift_invariant: depends on offsets key - query only, never on absolute positions
            (False for FIRE, which normalises by the query position).
        query_independent: `bias` reads the queries' dtype and device only, not their values,
            so one term serves every layer that shares this encoding's parameters in a forward
            pass (`urpe.nn.AttentionContext.term`). Opt-in: False unless a class says so.
    """

    value_side: bool = False
    shift_invariant: bool = True
    query_independent: bool = False
    # whether `attend` takes `calls=` (set per class: an encoding written before it existed
    # forwards its keywords to urpe.attention, and is given none)
    takes_calls: bool = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.takes_calls = "calls" in inspect.signature(cls.attend).parameters

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Applied to q and k as they are produced.

        x: (B, H, L, D). positions: (L,) or (B, L) absolute positions of those L rows
        (`Positions.query` for queries, the new keys' part of `Positions.key` for keys).
        """
        return x

    def key_state(self, x: Tensor) -> Tensor | None:
        """What this encoding reads per key from the layer's input x (B, L, kdim) at those keys:
        (B, H, L), kept beside the keys in a KV cache and given to `attend` as `key_state=` over
        all keys; None (the default) for encodings that read no input (all but FoX's)."""
        return None

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm | None:
        """The pre-normalisation term for queries q (B, H, Lq, D) at `positions`.

        Returns a `Toeplitz` table when the positions are aligned (see `Positions.is_aligned`),
        else an exact `Relation` or dense (B or 1, H, Lq, Lk) term; None for no term.
        """
        return None

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        positions: Positions,
        scale: float,
        bias: PositionTerm | None = None,
        calls: Callable[..., Tensor] = attention,
        **kwargs,
    ) -> Tensor:
        """The attention call with this encoding; kwargs are `urpe.attention`'s (gate, masks...).

        bias: a precomputed term that replaces this encoding's own bias.
        calls: the attention function to call (`urpe.attention`, or a caller's own
            `urpe.kernels.AttentionCalls`, which keeps its prepared calls).
        """
        if bias is None:
            bias = self.bias(q, positions, scale)
        return calls(q, k, v, bias=bias, scale=scale, **kwargs)


@register_position("none", lambda s: NoPosition())
class NoPosition(RelativeEncoding):
    """NoPE: attention sees no position at all (causal masking may still leak some)."""


def refuse_precomputed_bias(encoding: RelativeEncoding, bias: PositionTerm | None) -> None:
    """For encodings that compute their own position term inside `attend` (Shaw, Transformer-XL):
    a precomputed bias could not replace it, so it is an error rather than ignored."""
    if bias is not None:
        raise ValueError(
            f"{type(encoding).__name__} computes its own position term; a precomputed bias "
            "cannot replace it (use an encoding that only adds a bias, or NoPosition)"
        )


def clipped_table_term(table: Tensor, positions: Positions) -> Toeplitz | Relation:
    """A per-head table over clipped offsets, table (H, 2K+1) with column d + K for offset d.

    Aligned positions keep the `Toeplitz` structure, and so do contiguous ones (a static KV
    cache) over the table shifted to their offsets (`shifted_table`); otherwise the same lookup
    as an exact `Relation` indexed by clamp(key - query, -K, K) + K.
    """
    if positions.is_aligned:
        return Toeplitz(table)
    k = (table.shape[-1] - 1) // 2
    shift = positions.toeplitz_shift
    if shift is not None:
        offsets = shifted_offsets(positions, shift)
        return Toeplitz(table.index_select(1, offsets.clamp(-k, k) + k))
    index = positions.offsets().clamp(-k, k) + k  # (B or 1, Lq, Lk), in range by construction
    return Relation(table, index, in_range=True)


def shifted_offsets(positions: Positions, shift: Tensor | int) -> Tensor:
    """The true offset at each column of the Toeplitz table of contiguous positions: offsets
    -M..M (M = max(Lq, Lk) - 1, all that Lq queries over Lk keys meet) plus the shift, shape
    (2M+1,). A table indexed by them is the term as a `Toeplitz` (column d + M at j - pos(i) =
    d): one lookup per offset, no (Lq, Lk) index, the shift never read on the host."""
    m = max(positions.query_length, positions.key_length, 1) - 1
    return torch.arange(-m, m + 1, device=positions.device) + shift
