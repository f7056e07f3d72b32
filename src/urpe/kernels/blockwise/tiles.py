"""Tile readers for the blockwise kernel: a bias, gate or mask read one tile at a time.

The blockwise kernel stores keys in REVERSED order (column c holds key j = Lk - 1 - c). Then the
relative offset of query i and column c is

    d = j - pos(i) = (Lq - 1) - (i + c),

a function of i + c only, so a Toeplitz tile is a Hankel matrix: a strided view with strides
(1, 1) over a short vector of bq + bk - 1 table entries. Reading it costs no gather and no copy,
and its gradient is a sum along the tile's anti-diagonals. Dense and `Relation` terms are sliced
(and flipped) per tile instead.

Every reader gives `tile(i0, i1, c0, c1)` broadcastable to (B, H, bq, bk) in the compute dtype and,
when its tensor needs a gradient, accumulates `add_grad(i0, i1, c0, c1, grad)` tile by tile.
A term kind without a reader of its own (one registered outside urpe) is read from its dense
form (`DenseFormTile`), its gradient taken back through `Term.dense` by autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..terms import CrossDecay, Decay, Dense, Relation, Term, Toeplitz


def antidiagonal_sums(x: Tensor, scratch: dict | None = None) -> Tensor:
    """out[..., m] = sum over r + s = m of x[..., r, s]. x (..., R, S) -> (..., R + S - 1).

    This is the adjoint of reading a Hankel tile. Full anti-diagonals (R - 1 <= m <= S - 1) are
    summed through a strided view of x, with no copy; the two corner triangles go through a small
    skewed copy (kept zero-padded in `scratch` between calls of the same shape).
    """
    x = x.contiguous()
    *lead, rows, cols = x.shape
    flat = x.reshape(-1, rows, cols)
    n = flat.shape[0]
    out = flat.new_zeros(n, rows + cols - 1)
    if cols < 2 * rows:
        out.copy_(_skewed(flat, scratch).sum(1))
        return out.reshape(*lead, rows + cols - 1)
    # view[b, m', r] = x[b, r, m' + rows - 1 - r] for m' in [0, cols - rows]
    full = flat.as_strided(
        (n, cols - rows + 1, rows), (rows * cols, 1, cols - 1), flat.storage_offset() + rows - 1
    )
    out[:, rows - 1 : cols] = full.sum(-1)
    corner = rows - 1
    if corner > 0:
        out[:, :corner] = _skewed(flat[:, :, :corner], scratch).sum(1)[:, :corner]
        out[:, cols:] = _skewed(flat[:, :, cols - corner :], scratch).sum(1)[:, corner:]
    return out.reshape(*lead, rows + cols - 1)


def _skewed(x: Tensor, scratch: dict | None) -> Tensor:
    """y[b, r, r + s] = x[b, r, s], zero elsewhere. x (N, R, S) -> (N, R, R + S - 1)."""
    n, rows, cols = x.shape
    width = rows + cols - 1
    key = (n, rows, cols, x.dtype, x.device)
    y = None if scratch is None else scratch.get(key)
    if y is None:  # the band is overwritten on every call; the rest stays zero
        y = x.new_zeros(n, rows, width)
        if scratch is not None:
            scratch[key] = y
    y.as_strided((n, rows, cols), (rows * width, width + 1, 1)).copy_(x)
    return y


def hankel_view(vector: Tensor, rows: int, cols: int) -> Tensor:
    """(..., rows + cols - 1) -> (..., rows, cols) view with out[..., r, s] = vector[..., r + s]."""
    vector = vector.contiguous()
    lead = vector.shape[:-1]
    lead_strides = vector.stride()[:-1]
    return vector.as_strided((*lead, rows, cols), (*lead_strides, 1, 1))


class DenseTile:
    """A dense tensor broadcastable to (B, H, Lq, Lk)."""

    def __init__(self, term: Tensor, lk: int, dtype: torch.dtype, needs_grad: bool) -> None:
        self.shape = term.shape
        self.term = term.reshape((1,) * (4 - term.dim()) + tuple(term.shape))  # 4-D
        self.lk = lk
        self.dtype = dtype
        self.grad = (
            torch.zeros(self.term.shape, dtype=dtype, device=term.device) if needs_grad else None
        )

    def _rows(self, i0: int, i1: int) -> slice:
        return slice(i0, i1) if self.term.shape[2] > 1 else slice(None)

    def _cols(self, c0: int, c1: int) -> slice:
        # reversed columns c0..c1-1 are original keys Lk-c1 .. Lk-c0-1, read back to front
        return slice(self.lk - c1, self.lk - c0) if self.term.shape[3] > 1 else slice(None)

    def tile(self, i0: int, i1: int, c0: int, c1: int) -> Tensor:
        t = self.term[:, :, self._rows(i0, i1), self._cols(c0, c1)]
        if t.shape[3] > 1:
            t = t.flip(-1)
        return t.to(self.dtype)

    def add_grad(self, i0: int, i1: int, c0: int, c1: int, grad: Tensor) -> None:
        dims = tuple(d for d in range(4) if self.term.shape[d] == 1 and grad.shape[d] != 1)
        if dims:
            grad = grad.sum(dims, keepdim=True)
        if grad.shape[3] > 1:
            grad = grad.flip(-1)
        self.grad[:, :, self._rows(i0, i1), self._cols(c0, c1)] += grad

    def grads(self) -> Tensor | None:
        return None if self.grad is None else self.grad.reshape(self.shape)


class ToeplitzTile:
    """A `Toeplitz` table read as Hankel views over the reversed keys."""

    def __init__(self, table: Tensor, lq: int, dtype: torch.dtype, needs_grad: bool) -> None:
        self.table = table.to(dtype)  # (Hh, 2K+1)
        self.max_offset = (table.shape[1] - 1) // 2
        self.lq = lq
        self.grad = torch.zeros_like(self.table) if needs_grad else None
        self.scratch: dict = {}

    def _columns(self, i0: int, i1: int, c0: int, c1: int) -> Tensor:
        # entry m of the tile's vector sits at i + c = i0 + c0 + m, offset d = Lq - 1 - (i + c)
        first = self.lq - 1 - i0 - c0
        m = torch.arange(i1 - i0 + c1 - c0 - 1, device=self.table.device)
        k = self.max_offset
        return (first - m).clamp(-k, k) + k

    def tile(self, i0: int, i1: int, c0: int, c1: int) -> Tensor:
        vector = self.table[:, self._columns(i0, i1, c0, c1)]  # (Hh, bq + bk - 1)
        return hankel_view(vector, i1 - i0, c1 - c0).unsqueeze(0)  # (1, Hh, bq, bk)

    def add_grad(self, i0: int, i1: int, c0: int, c1: int, grad: Tensor) -> None:
        if self.table.shape[0] == 1:
            grad = grad.sum((0, 1), keepdim=True)[0]
        else:
            grad = grad[0] if grad.shape[0] == 1 else grad.sum(0)  # (Hh, bq, bk)
        sums = antidiagonal_sums(grad, self.scratch)
        self.grad.index_add_(1, self._columns(i0, i1, c0, c1), sums)

    def grads(self) -> Tensor | None:
        return self.grad


class RelationTile:
    """A `Relation` table read through index tiles."""

    def __init__(
        self, table: Tensor, index: Tensor, lk: int, dtype: torch.dtype, needs_grad: bool
    ) -> None:
        self.table = table.to(dtype)  # (Hh, R)
        self.index = index  # (Bi, Lq, Lk), int64, range-checked by dispatch
        self.lk = lk
        self.grad = torch.zeros_like(self.table) if needs_grad else None

    def _index(self, i0: int, i1: int, c0: int, c1: int) -> Tensor:
        return self.index[:, i0:i1, self.lk - c1 : self.lk - c0].flip(-1).long()  # (Bi, bq, bk)

    def tile(self, i0: int, i1: int, c0: int, c1: int) -> Tensor:
        return self.table[:, self._index(i0, i1, c0, c1)].transpose(0, 1)  # (Bi, Hh, bq, bk)

    def add_grad(self, i0: int, i1: int, c0: int, c1: int, grad: Tensor) -> None:
        index = self._index(i0, i1, c0, c1)
        if index.shape[0] == 1:
            grad = grad.sum(0, keepdim=True)
        if self.table.shape[0] == 1:
            grad = grad.sum(1, keepdim=True)
        # grad (Bi, Hh, bq, bk) -> (Hh, Bi * bq * bk), scattered by the index into (Hh, R)
        values = grad.transpose(0, 1).reshape(grad.shape[1], -1)
        self.grad.scatter_add_(1, index.reshape(1, -1).expand_as(values), values)

    def grads(self) -> Tensor | None:
        return self.grad


class DecayTile:
    """A `Decay` bias, -|c_pos(i) - c_j| with c = cumsum(log_forget), read per tile from c
    (O(L) numbers per row, never an (Lq, Lk) matrix). Its gradient flows to c per query and per
    key (d/dx -|x| = -sign x), then to log_forget as a reversed cumulative sum."""

    def __init__(self, log_forget: Tensor, lq: int, dtype: torch.dtype, needs_grad: bool) -> None:
        self.shape, self.dtype = log_forget.shape, log_forget.dtype  # (B|1, H|1, Lk)
        self.lq = lq
        c = log_forget.to(dtype).cumsum(-1)
        lk = c.shape[-1]
        if lq > lk:  # queries before the first key read c = 0 (they see no key)
            c_all = torch.cat([c.new_zeros(*c.shape[:-1], lq - lk), c], -1)
        else:
            c_all = c
        self._read(c_all[..., c_all.shape[-1] - lq :], c, needs_grad)

    def _read(self, c_queries: Tensor, c_keys: Tensor, needs_grad: bool) -> None:
        """c at the queries (B|1, H|1, Lq) and at the keys (B|1, H|1, Lk), original order."""
        self.c_queries = c_queries.contiguous()
        self.c_keys = c_keys.flip(-1).contiguous()  # reversed, as the kernel's columns
        self.grad = self.grad_queries = self.grad_keys = None
        if needs_grad:
            self.grad = True  # (the additive readers' marker: a gradient is wanted)
            self.grad_queries = torch.zeros_like(self.c_queries)
            self.grad_keys = torch.zeros_like(self.c_keys)

    def _difference(self, i0: int, i1: int, c0: int, c1: int) -> Tensor:
        return self.c_queries[..., i0:i1, None] - self.c_keys[..., None, c0:c1]

    def tile(self, i0: int, i1: int, c0: int, c1: int) -> Tensor:
        return self._difference(i0, i1, c0, c1).abs_().neg_()  # (B|1, H|1, bq, bk)

    def add_grad(self, i0: int, i1: int, c0: int, c1: int, grad: Tensor) -> None:
        signed = self._difference(i0, i1, c0, c1).sign_() * grad  # (B, H, bq, bk)
        dims = tuple(d for d in range(2) if self.c_keys.shape[d] == 1 and signed.shape[d] != 1)
        if dims:
            signed = signed.sum(dims, keepdim=True)
        self.grad_queries[..., i0:i1] -= signed.sum(-1)
        self.grad_keys[..., c0:c1] += signed.sum(-2)

    def grads(self) -> Tensor | None:
        if self.grad_keys is None:
            return None
        grad_c = self.grad_keys.flip(-1)  # original key order
        lk = grad_c.shape[-1]
        placed = min(self.lq, lk)  # queries with pos(i) >= 0: the last Lk of them at most
        grad_c[..., lk - placed :] += self.grad_queries[..., self.lq - placed :]
        # c_t = sum_{s <= t} log_forget_s: d log_forget_s = sum_{t >= s} d c_t
        return grad_c.flip(-1).cumsum(-1).flip(-1).to(self.dtype)


class CrossDecayTile(DecayTile):
    """A `CrossDecay` bias, -|c_i - c_(Lq + j)|: the same tiles, c given at the queries and at
    the keys apart, and the gradient that of c itself (B|1, H|1, Lq + Lk)."""

    def __init__(self, cumulative: Tensor, lq: int, dtype: torch.dtype, needs_grad: bool) -> None:
        self.shape, self.dtype = cumulative.shape, cumulative.dtype
        self.lq = lq
        c = cumulative.to(dtype)
        self._read(c[..., :lq], c[..., lq:], needs_grad)

    def grads(self) -> Tensor | None:
        if self.grad_keys is None:
            return None
        return torch.cat([self.grad_queries, self.grad_keys.flip(-1)], -1).to(self.dtype)


class DenseFormTile(DenseTile):
    """Any other term kind, read from its dense form `term.dense(Lq, Lk)`; its raw tensor's
    gradient is the dense gradient taken back through `dense` (a vector-Jacobian product)."""

    def __init__(
        self, kind: type[Term], tensor: Tensor, index, lq: int, lk: int, dtype, needs_grad: bool
    ) -> None:
        self.leaf = tensor.detach().requires_grad_(needs_grad)
        with torch.enable_grad():
            self.dense_form = kind.from_raw(self.leaf, index).dense(lq, lk)
        super().__init__(self.dense_form.detach(), lk, dtype, needs_grad)

    def grads(self) -> Tensor | None:
        dense_grad = super().grads()
        if dense_grad is None:
            return None
        (grad,) = torch.autograd.grad(self.dense_form, self.leaf, dense_grad.to(self.leaf.dtype))
        return grad


Reader = DenseTile | ToeplitzTile | RelationTile | DecayTile | CrossDecayTile


def tile_reader(term: Term | None, lq: int, lk: int, dtype, needs_grad: bool) -> Reader | None:
    """The tile reader of a bias or gate (None: no term)."""
    if term is None:
        return None
    if type(term) is Toeplitz:
        return ToeplitzTile(term.table, lq, dtype, needs_grad)
    if type(term) is Relation:
        return RelationTile(term.table, term.index, lk, dtype, needs_grad)
    if type(term) is Decay:
        return DecayTile(term.log_forget, lq, dtype, needs_grad)
    if type(term) is CrossDecay:
        return CrossDecayTile(term.cumulative, lq, dtype, needs_grad)
    if type(term) is Dense:
        return DenseTile(term.tensor, lk, dtype, needs_grad)
    tensor, index = term.raw()
    return DenseFormTile(type(term), tensor, index, lq, lk, dtype, needs_grad)
