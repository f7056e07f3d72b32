"""A bias or gate of the whole sequence, read at one pair of chunks (a query chunk, a key chunk).

The kernels take a term over the queries and keys of one call; a context-parallel call runs
them on chunk pairs, whose positions are not the call's own:

- `Toeplitz` (offsets key - query over the global positions): for query chunk start a and key
  chunk start b the pair's offsets are its own j - i plus b - a, so the pair reads a table of
  its 2C - 1 offsets, `table[clamp(m + b - a, -K, K) + K]` for m in -(C-1)..C-1 (the same
  shift `urpe.encodings.base.shifted_offsets` gives a static KV cache). Its gradient goes back
  to those columns (index_add): each rank ends with its part of the table's gradient.
- `Decay`: c = cumsum(log_forget) runs over the global positions, so a pair of chunks reads a
  `CrossDecay` of c at the queries' positions and c at the keys' (which travel with the keys).
  Its gradient splits the same way; the keys' share travels back to the keys' owner.
- `Dense` terms that broadcast over the keys (B|1, H|1, L|1, 1): the pair's query rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .layout import Segment


@dataclass(frozen=True)
class Pair:
    """A query chunk against a key chunk; `causal`: the same chunk under causal masking."""

    query: Segment
    key: Segment
    causal: bool

    @property
    def diagonal(self) -> bool:
        return self.query.start == self.key.start


class ChunkTerm:
    """The interface: `at(pair, key_side)` -> (raw tensor, kind) for the pair's kernel call,
    `add_grad(pair, grad, key_grad_side)` with that tensor's gradient, `grad()` the caller's."""

    kind: str
    key_side: Tensor | None = None  # what travels with the keys (None: nothing)

    def at(self, pair: Pair, key_side: Tensor | None) -> tuple[Tensor, str]:
        raise NotImplementedError

    def add_grad(self, pair: Pair, grad: Tensor, key_grad: Tensor | None) -> None:
        raise NotImplementedError


class ToeplitzChunks(ChunkTerm):
    """A Toeplitz table (H|1, 2K+1) over global offsets (module docstring)."""

    def __init__(self, table: Tensor, needs_grad: bool) -> None:
        self.table = table
        self.max_offset = (table.shape[1] - 1) // 2
        self.grad = torch.zeros_like(table) if needs_grad else None
        self._columns: dict[tuple[int, int], Tensor] = {}

    def columns(self, pair: Pair) -> Tensor:
        """(2C-1,): the table column of each of the pair's offsets m = -(C-1)..C-1."""
        shift, length = pair.key.start - pair.query.start, pair.query.length
        found = self._columns.get((shift, length))
        if found is None:
            offsets = torch.arange(1 - length, length, device=self.table.device) + shift
            found = offsets.clamp(-self.max_offset, self.max_offset) + self.max_offset
            self._columns[(shift, length)] = found
        return found

    def at(self, pair: Pair, key_side: Tensor | None) -> tuple[Tensor, str]:
        return self.table.index_select(1, self.columns(pair)), "toeplitz"

    def add_grad(self, pair: Pair, grad: Tensor, key_grad: Tensor | None) -> None:
        self.grad.index_add_(1, self.columns(pair), grad.to(self.grad.dtype))


class DenseChunks(ChunkTerm):
    """A dense term broadcast over the keys, (B|1, H|1, L|1, 1) with L this rank's shard."""

    def __init__(self, tensor: Tensor, needs_grad: bool) -> None:
        self.tensor = tensor
        self.grad = torch.zeros_like(tensor) if needs_grad else None

    def _rows(self, pair: Pair) -> slice:
        return pair.query.rows if self.tensor.shape[2] > 1 else slice(None)

    def at(self, pair: Pair, key_side: Tensor | None) -> tuple[Tensor, str]:
        return self.tensor[:, :, self._rows(pair)], "dense"

    def add_grad(self, pair: Pair, grad: Tensor, key_grad: Tensor | None) -> None:
        self.grad[:, :, self._rows(pair)] += grad.to(self.grad.dtype)


class DecayChunks(ChunkTerm):
    """A `Decay`'s c = cumsum(log_forget) over the global positions, (B|1, H|1, L) at this
    rank's shard; the keys' c travels with the keys (`key_side`)."""

    def __init__(self, cumulative: Tensor, needs_grad: bool) -> None:
        self.cumulative = cumulative
        self.key_side = cumulative
        self.grad = torch.zeros_like(cumulative) if needs_grad else None

    def at(self, pair: Pair, key_side: Tensor | None) -> tuple[Tensor, str]:
        c_queries = self.cumulative[..., pair.query.rows]
        c_keys = key_side[..., pair.key.rows]
        return torch.cat([c_queries, c_keys], -1), "cross_decay"

    def add_grad(self, pair: Pair, grad: Tensor, key_grad: Tensor | None) -> None:
        length = pair.query.length
        self.grad[..., pair.query.rows] += grad[..., :length].to(self.grad.dtype)
        key_grad[..., pair.key.rows] += grad[..., length:].to(key_grad.dtype)
