"""Structured relative-position terms: per-head tables looked up by a relation between i and j.

A bias or gate in `urpe.attention` is either a dense tensor broadcastable to (B, H, Lq, Lk) or one
of the two structured forms here. Structured forms let tiled kernels read the term tile by tile
instead of materialising an (Lq, Lk) matrix per head; `dense()` gives the equivalent dense tensor,
which is what the reference kernel uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def query_positions(lq: int, lk: int, device: torch.device | None = None) -> Tensor:
    """Absolute positions of the queries: query i sits at i + Lk - Lq (the last Lq of Lk keys).

    This is what decoding with a KV cache needs: the Lq new queries are the newest positions.
    """
    return torch.arange(lk - lq, lk, device=device)


def relative_offsets(lq: int, lk: int, device: torch.device | None = None) -> Tensor:
    """Offsets d_ij = j - pos(i), key position minus query position. Shape (Lq, Lk), int64."""
    keys = torch.arange(lk, device=device)
    return keys[None, :] - query_positions(lq, lk, device)[:, None]


def _check_table(kind: str, table, shape: str) -> None:
    """A per-head table is a 2-D floating-point tensor (H or 1 rows); else one clear error."""
    if not isinstance(table, Tensor):
        raise TypeError(f"{kind} table must be a Tensor, got {type(table).__name__}")
    if table.dim() != 2:
        raise ValueError(f"{kind} table must have shape {shape}, got {tuple(table.shape)}")
    if not table.is_floating_point():
        raise TypeError(f"{kind} table must be floating point, got {table.dtype}")


@dataclass(frozen=True)
class Toeplitz:
    """A per-head Toeplitz term: value(i, j) = table[:, clamp(j - pos(i), -K, K) + K].

    table: (H, 2K+1), or (1, 2K+1) to share one row across heads. Offsets beyond K reuse the edge
    value, so a table trained at one length works at any length (the paper's "clipped" RPE).
    """

    table: Tensor

    def __post_init__(self) -> None:
        _check_table("Toeplitz", self.table, "(H, 2K+1)")
        if self.table.shape[1] % 2 == 0:
            raise ValueError(
                f"Toeplitz table width must be odd (2K+1 offsets -K..K), got {self.table.shape[1]}"
            )

    num_heads = property(lambda self: self.table.shape[0])

    @property
    def max_offset(self) -> int:
        """K: the largest offset with its own entry."""
        return (self.table.shape[1] - 1) // 2

    def index(self, lq: int, lk: int) -> Tensor:
        """Column of the table used at each (i, j). Shape (Lq, Lk), int64."""
        k = self.max_offset
        return relative_offsets(lq, lk, self.table.device).clamp(-k, k) + k

    def dense(self, lq: int, lk: int) -> Tensor:
        """The term as a dense tensor of shape (1, H, Lq, Lk)."""
        return self.table[:, self.index(lq, lk)].unsqueeze(0)


@dataclass(frozen=True)
class Relation:
    """A per-head term indexed by an integer relation: value(b, h, i, j) = table[h, index[b, i, j]].

    table: (H, R) (or (1, R)); index: (..., Lq, Lk) integer in [0, R), its leading dims
    broadcastable to the call's batch dims (so (B, Lq, Lk), or (Lq, Lk) for one index shared by
    the batch). On graphs the index is the shortest-path distance, as in Graphormer's spatial
    encoding. `urpe.attention` checks the range (ValueError naming `bias` or `gate`) unless
    `in_range` says the index was built in range or checked already (clamped offsets, buckets,
    a relation checked once per forward pass): then no layer reads it again, which on a GPU
    would make the host wait for the device.
    """

    table: Tensor
    index: Tensor
    in_range: bool = False

    def __post_init__(self) -> None:
        _check_table("Relation", self.table, "(H, R)")
        if not isinstance(self.index, Tensor):
            raise TypeError(f"Relation index must be a Tensor, got {type(self.index).__name__}")
        if self.index.dim() < 2:
            raise ValueError(
                f"Relation index must have shape (..., Lq, Lk), got {tuple(self.index.shape)}"
            )
        if self.index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"Relation index must be an integer tensor, got {self.index.dtype}")

    num_heads = property(lambda self: self.table.shape[0])

    @property
    def num_relations(self) -> int:
        """R: indices must lie in [0, R)."""
        return self.table.shape[1]

    def dense(self, lq: int, lk: int) -> Tensor:
        """The term as a dense tensor of shape (..., H, Lq, Lk), the index's leading dims first."""
        if self.index.shape[-2:] != (lq, lk):
            raise ValueError(
                f"Relation index has shape {tuple(self.index.shape)}, expected (..., {lq}, {lk})"
            )
        # table[:, index] is (H, ..., Lq, Lk); move heads behind the leading dims.
        return self.table[:, self.index.long()].movedim(0, -3)


@dataclass(frozen=True)
class Decay:
    """A data-dependent decay bias: value(b, h, i, j) = -|c[b, h, pos(i)] - c[b, h, j]| with
    c = cumsum(log_forget, -1) along the keys and pos(i) = i + Lk - Lq.

    For j <= pos(i) this is sum_{t = j+1 .. pos(i)} log f_t, the Forgetting Transformer's decay
    bias (FoX: Lin, Nikishin, He and Courville, "Forgetting Transformer: Softmax Attention with
    a Forget Gate", ICLR 2025), with per-token, per-head forget gates f_t in (0, 1] given as
    log_forget = log f_t <= 0. Keys after the query (j > pos(i)) get the mirrored sum, so the
    term is defined without a causal mask too.

    log_forget: (..., H, Lk) or (..., 1, Lk), leading dims broadcastable to the call's batch
    dims; values must be <= 0 and finite (`urpe.attention` checks that where it may read values:
    on the CPU, outside torch.compile). Gradients flow to log_forget. A bias term only: it is a
    log-space weight, so `gate=Decay(...)` raises TypeError (a gate multiplies after the
    normalisation, where -|...| <= 0 would flip signs). Native kernels compute it per tile from
    c (O(L) memory); `dense()` builds the (..., H, Lq, Lk) tensor the reference adds.
    """

    log_forget: Tensor

    def __post_init__(self) -> None:
        t = self.log_forget
        if not isinstance(t, Tensor):
            raise TypeError(f"Decay log_forget must be a Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"Decay log_forget must have shape (..., H, Lk), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"Decay log_forget must be floating point, got {t.dtype}")

    num_heads = property(lambda self: self.log_forget.shape[-2])

    def cumulative(self) -> Tensor:
        """c = cumsum(log_forget) along the keys, (..., H, Lk) (float64 for float64 input)."""
        return self.log_forget.cumsum(-1)

    def dense(self, lq: int, lk: int) -> Tensor:
        """The term as a dense tensor of shape (..., H, Lq, Lk)."""
        c = self.cumulative()  # (..., H, Lk)
        c_query = c[..., lk - lq :] if lq <= lk else _query_cumulative(c, lq, lk)  # (..., H, Lq)
        return -(c_query[..., :, None] - c[..., None, :]).abs()


def _query_cumulative(c: Tensor, lq: int, lk: int) -> Tensor:
    """c at pos(i) for Lq > Lk: queries before the first key (pos(i) < 0) read c = 0, the value
    before any key (they see no key of a document, and causality hides every key from them)."""
    pad = c.new_zeros(*c.shape[:-1], lq - lk)
    return torch.cat([pad, c], -1)


PositionTerm = Tensor | Toeplitz | Relation | Decay


def dense_term(term: PositionTerm | None, lq: int, lk: int) -> Tensor | None:
    """Expand a bias or gate of any accepted form to a tensor broadcastable to (B, H, Lq, Lk)."""
    if term is None or isinstance(term, Tensor):
        return term
    return term.dense(lq, lk)
