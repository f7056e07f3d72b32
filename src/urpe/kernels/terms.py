"""Terms of an attention call: the bias B, the gate C and the documents, one class per kind.

    out = dropout(normalize(scale * q k^T + B + M) * C) @ v

A bias or gate is a dense tensor broadcastable to (B, H, Lq, Lk) or one of the structured kinds
below, which tiled kernels read tile by tile instead of materialising an (Lq, Lk) matrix per
head: `Toeplitz` (a per-head table over clamped offsets j - i), `Relation` (a per-head table
indexed by an integer relation such as a shortest-path distance) and `Decay` (FoX's
data-dependent decay, a bias only). `Documents` (packed sequences, `documents.py`) hides pairs
instead.

Each kind is one class that carries everything the call path asks of it, so a new kind is added
in one place (see "Adding a term kind" in the attention guide):

- `check(role, call)`: one clear error naming the argument, against the call's shapes;
- `flattened(batch_shape)`: SDPA's leading batch dims brought to one (B|1);
- `checked_values(role)`: what must be read per call (a range, a sign), after `check`;
- `signature(lk)`: what a prepared call is keyed by (shapes, dtypes, devices; never values),
  with the keys' length Lk left out where it is a tensor's last dim;
- `dense(lq, lk)`: the same term as a dense tensor, which the reference kernel adds;
- `raw()` / `from_raw(tensor, index)`: the (tensor, index) pair the raw ops take, and back;
- `kind` (its name in capability tables and raw ops) and `code` (the compiled kernels' enum,
  terms.h's `Kind`; None where they have no form for it: they refuse it by name).

A plain tensor given as bias or gate is wrapped as `Dense` when the call is resolved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .checks import checked_relation_index
from .dtypes import HALF, compute_dtype
from .host import may_read
from .offsets import relative_offsets
from .term_shapes import (
    ANY_LENGTH,
    CallShape,
    broadcasts,
    check_device,
    check_dtype,
    flatten_leading,
    tensor_signature,
)

# ---------------------------------------------------------------------------------------------
# The interface


class Term:
    """A term of an attention call (module docstring). Subclasses are frozen dataclasses."""

    kind: ClassVar[str]
    code: ClassVar[int | None] = None
    roles: ClassVar[tuple[str, ...]] = ("bias", "gate")

    def check(self, role: str, call: CallShape) -> None:
        """TypeError / ValueError naming `role` unless this term fits the call."""
        raise NotImplementedError(f"{type(self).__name__}.check")

    def flattened(self, batch_shape: tuple[int, ...]) -> Term:
        """The term for the call's flattened batch (B|1); the same term where nothing changes."""
        return self

    def checked_values(self, role: str) -> Term:
        """The term after the checks that read values (per call, after `check`)."""
        return self

    def signature(self, lk: int) -> tuple:
        """What a prepared call of this term is keyed by (module docstring)."""
        tensor, index = self.raw()
        return (type(self), tensor_signature(tensor, lk), tensor_signature(index, lk))

    def dense(self, lq: int, lk: int) -> Tensor:
        """The term as a tensor broadcastable to (B|1, H|1, Lq, Lk)."""
        raise NotImplementedError(f"{type(self).__name__}.dense")

    def in_dtype(self, dtype: torch.dtype) -> Term:
        """The term as a call whose compute dtype is `dtype` reads it, where that converts
        values before they are combined (a `CrossDecay`'s float64 sums: each rounded, then
        subtracted); by default the term itself (`dense_term`)."""
        return self

    def raw(self) -> tuple[Tensor | None, Tensor | None]:
        """(tensor, index) as the raw ops take them; the tensor is what gradients reach. By
        default a dataclass term's first field, and no index."""
        name = _FIRST_FIELD.get(type(self))
        if name is None:
            if not dataclasses.is_dataclass(self) or not dataclasses.fields(self):
                raise NotImplementedError(f"{type(self).__name__}.raw")
            name = _FIRST_FIELD[type(self)] = dataclasses.fields(self)[0].name
        return getattr(self, name), None

    @classmethod
    def from_raw(cls, tensor: Tensor | None, index: Tensor | None) -> Term:
        """The term the raw ops' (tensor, index) stand for (inside an op's body). By default
        the class called with the tensor."""
        return cls(tensor)


_FIRST_FIELD: dict[type, str] = {}  # a dataclass term's first field, by class (`Term.raw`)

# name -> class: the raw ops name a term's kind, and their bodies rebuild it from (tensor, index)
TERM_KINDS: dict[str, type[Term]] = {}


def register_term_kind(cls: type[Term]) -> type[Term]:
    """Make `cls` a term kind: its name in raw ops and capability tables. A class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Term)) or not isinstance(
        getattr(cls, "kind", None), str
    ):
        raise TypeError("a term kind is a subclass of urpe.kernels.Term with a `kind` name")
    known = TERM_KINDS.get(cls.kind)
    if known is not None and known is not cls and known.__module__ == __name__:
        raise ValueError(f"term kind {cls.kind!r} is built in; choose another name")
    TERM_KINDS[cls.kind] = cls
    return cls


def _check_table(kind: str, table, shape: str) -> None:
    """A per-head table is a 2-D floating-point tensor (H or 1 rows); else one clear error."""
    if not isinstance(table, Tensor):
        raise TypeError(f"{kind} table must be a Tensor, got {type(table).__name__}")
    if table.dim() != 2:
        raise ValueError(f"{kind} table must have shape {shape}, got {tuple(table.shape)}")
    if not table.is_floating_point():
        raise TypeError(f"{kind} table must be floating point, got {table.dtype}")


def _check_table_against(role: str, table: Tensor, call: CallShape) -> None:
    if table.shape[0] not in (1, call.heads):
        raise ValueError(
            f"{role} table has {table.shape[0]} heads, expected 1 or {call.heads} (q's heads)"
        )
    if table.dtype != call.dtype and call.dtype not in HALF:
        raise TypeError(f"{role} table dtype {table.dtype} does not match q dtype {call.dtype}")
    check_device(f"{role} table", table, call)


# ---------------------------------------------------------------------------------------------
# The built-in kinds (codes: terms.h's Kind)


@register_term_kind
@dataclass(frozen=True)
class Dense(Term):
    """A dense term: a floating-point tensor broadcastable to (..., H, Lq, Lk)."""

    kind: ClassVar[str] = "dense"
    code: ClassVar[int] = 1

    tensor: Tensor

    def check(self, role: str, call: CallShape) -> None:
        t = self.tensor
        if not t.is_floating_point():
            raise TypeError(f"{role} must be a floating-point tensor, got {t.dtype}")
        broadcasts(role, tuple(t.shape), call.full, "(..., H, Lq, Lk)")
        check_device(role, t, call)

    def flattened(self, batch_shape: tuple[int, ...]) -> Dense:
        flat = flatten_leading(self.tensor, batch_shape, 3)  # (B|1, H|1, Lq|1, Lk|1)
        return self if flat is self.tensor else Dense(flat)

    def dense(self, lq: int, lk: int) -> Tensor:
        return self.tensor


@register_term_kind
@dataclass(frozen=True)
class Toeplitz(Term):
    """A per-head Toeplitz term: value(i, j) = table[:, clamp(j - pos(i), -K, K) + K].

    table: (H, 2K+1), or (1, 2K+1) to share one row across heads. Offsets beyond K reuse the edge
    value, so a table trained at one length works at any length (the paper's "clipped" RPE).
    """

    kind: ClassVar[str] = "toeplitz"
    code: ClassVar[int] = 2

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

    def check(self, role: str, call: CallShape) -> None:
        _check_table_against(role, self.table, call)

    def signature(self, lk: int) -> tuple:
        t = self.table  # its width is a number of offsets, never Lk
        return (Toeplitz, type(t), t.shape, t.dtype, t.device)

    def raw(self) -> tuple[Tensor, None]:
        return self.table, None

    def dense(self, lq: int, lk: int) -> Tensor:
        """(1, H, Lq, Lk)."""
        return self.table[:, self.index(lq, lk)].unsqueeze(0)


@register_term_kind
@dataclass(frozen=True)
class Relation(Term):
    """A per-head term indexed by an integer relation: value(b, h, i, j) = table[h, index[b, i, j]].

    table: (H, R) (or (1, R)); index: (..., Lq, Lk) integer in [0, R), its leading dims
    broadcastable to the call's batch dims (so (B, Lq, Lk), or (Lq, Lk) for one index shared by
    the batch). On graphs the index is the shortest-path distance, as in Graphormer's spatial
    encoding. `urpe.attention` checks the range (ValueError naming `bias` or `gate`) unless
    `in_range` says the index was built in range or checked already (clamped offsets, buckets,
    a relation checked once per forward pass): then no layer reads it again, which on a GPU
    would make the host wait for the device.
    """

    kind: ClassVar[str] = "relation"
    code: ClassVar[int] = 3

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

    def check(self, role: str, call: CallShape) -> None:
        _check_table_against(role, self.table, call)
        want = (*call.batch, call.lq, call.lk)
        if self.index.shape[-2:] != want[-2:]:
            raise ValueError(
                f"{role} index has shape {tuple(self.index.shape)}, expected (..., "
                f"{want[-2]}, {want[-1]}) with leading dims broadcastable to {want[:-2]}"
            )
        broadcasts(f"{role} index", tuple(self.index.shape), want, "(..., Lq, Lk)")
        check_device(f"{role} index", self.index, call)

    def flattened(self, batch_shape: tuple[int, ...]) -> Relation:
        index = flatten_leading(self.index, batch_shape, 2)  # (B|1, Lq, Lk)
        return self if index is self.index else Relation(self.table, index, self.in_range)

    def checked_values(self, role: str) -> Relation:
        """int64 indices, range-checked once (then marked in range)."""
        if self.in_range:  # built in range, or checked once already
            if self.index.dtype == torch.int64:
                return self
            return Relation(self.table, self.index.long(), True)
        index = checked_relation_index(self.index, self.num_relations, role)
        return Relation(self.table, index, True)

    def dense(self, lq: int, lk: int) -> Tensor:
        """The term as a dense tensor of shape (..., H, Lq, Lk), the index's leading dims first."""
        if self.index.shape[-2:] != (lq, lk):
            raise ValueError(
                f"Relation index has shape {tuple(self.index.shape)}, expected (..., {lq}, {lk})"
            )
        # table[:, index] is (H, ..., Lq, Lk); move heads behind the leading dims.
        return self.table[:, self.index.long()].movedim(0, -3)

    def raw(self) -> tuple[Tensor, Tensor]:
        return self.table, self.index

    @classmethod
    def from_raw(cls, tensor: Tensor, index: Tensor) -> Relation:
        return cls(tensor, index, in_range=True)  # checked when the call was resolved


@register_term_kind
@dataclass(frozen=True)
class Decay(Term):
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
    c (O(L) memory); `dense()` builds the (..., H, Lq, Lk) tensor the reference adds. Half
    precision is summed in float32.
    """

    kind: ClassVar[str] = "decay"
    code: ClassVar[int] = 4
    roles: ClassVar[tuple[str, ...]] = ("bias",)

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

    def check(self, role: str, call: CallShape) -> None:
        lf = self.log_forget
        if lf.shape[-1] != call.lk or lf.shape[-2] not in (1, call.heads):
            raise ValueError(
                f"Decay log_forget must have shape (..., H|1, Lk) = (..., {call.heads}, "
                f"{call.lk}), got {tuple(lf.shape)}"
            )
        full = (*call.batch, call.heads, call.lk)
        broadcasts("Decay log_forget", tuple(lf.shape), full, "(..., H, Lk)")
        if lf.dtype != call.dtype and call.dtype not in HALF:
            raise TypeError(
                f"Decay log_forget dtype {lf.dtype} does not match q dtype {call.dtype}"
            )
        check_device("Decay log_forget", lf, call)

    def flattened(self, batch_shape: tuple[int, ...]) -> Decay:
        flat = flatten_leading(self.log_forget, batch_shape, 2)  # (B|1, H|1, Lk)
        return self if flat is self.log_forget else Decay(flat)

    def checked_values(self, role: str) -> Decay:
        checked_log_forget(self.log_forget)
        return self

    def cumulative(self) -> Tensor:
        """c = cumsum(log_forget) along the keys, (..., H, Lk), in the compute dtype (float32
        for half precision: a long bfloat16 sum loses most of its digits)."""
        lf = self.log_forget
        return lf.cumsum(-1, dtype=compute_dtype(lf.dtype))

    def dense(self, lq: int, lk: int) -> Tensor:
        """The term as a dense tensor of shape (..., H, Lq, Lk), in the compute dtype."""
        c = self.cumulative()  # (..., H, Lk)
        c_query = c[..., lk - lq :] if lq <= lk else _query_cumulative(c, lq, lk)  # (..., H, Lq)
        return -(c_query[..., :, None] - c[..., None, :]).abs()


@register_term_kind
@dataclass(frozen=True)
class CrossDecay(Term):
    """A decay bias between queries and keys that sit apart: value(b, h, i, j) =
    -|c[b, h, i] - c[b, h, Lq + j]|, with c the cumulative log forget gates at the queries'
    positions (the first Lq entries) and then at the keys' (the last Lk).

    `Decay` reads both from one sequence (the queries are the last Lq keys); here they are
    given apart, so the queries may sit anywhere, e.g. one chunk of a sequence against another
    chunk of it (context parallelism, `urpe.distributed`, whose c runs over the whole
    sequence). cumulative: (..., H|1, Lq + Lk), leading dims broadcastable to the call's batch
    dims, any real values (a `Decay`'s c is cumsum(log_forget)). Gradients flow to c. A bias
    only, for the reasons `Decay` gives.

    c has q's dtype, or float64 for float32 q (any floating dtype for half precision): sums
    kept in double (a KV cache's) go as they are, and every backend reads each c rounded to
    the call's compute dtype before it subtracts (`in_dtype`), the values of c converted first.
    """

    kind: ClassVar[str] = "cross_decay"
    code: ClassVar[int] = 6
    roles: ClassVar[tuple[str, ...]] = ("bias",)

    cumulative: Tensor

    def __post_init__(self) -> None:
        t = self.cumulative
        if not isinstance(t, Tensor):
            raise TypeError(f"CrossDecay cumulative must be a Tensor, got {type(t).__name__}")
        if t.dim() < 2 or not t.is_floating_point():
            raise ValueError(
                f"CrossDecay cumulative must be a floating-point (..., H, Lq + Lk) tensor, got "
                f"{t.dtype} {tuple(t.shape)}"
            )

    num_heads = property(lambda self: self.cumulative.shape[-2])

    def check(self, role: str, call: CallShape) -> None:
        c = self.cumulative
        if c.shape[-1] != call.lq + call.lk or c.shape[-2] not in (1, call.heads):
            raise ValueError(
                f"CrossDecay cumulative must have shape (..., H|1, Lq + Lk) = (..., "
                f"{call.heads}, {call.lq + call.lk}), got {tuple(c.shape)}"
            )
        full = (*call.batch, call.heads, call.lq + call.lk)
        broadcasts("CrossDecay cumulative", tuple(c.shape), full, "(..., H, Lq + Lk)")
        if not (c.dtype == torch.float64 and call.dtype == torch.float32):
            check_dtype("CrossDecay cumulative", c, call)
        check_device("CrossDecay cumulative", c, call)

    def signature(self, lk: int) -> tuple:
        c = self.cumulative  # its last dim is Lq + Lk: the keys' length left out
        return (CrossDecay, type(c), (*c.shape[:-1], f"Lq+{ANY_LENGTH}"), c.dtype, c.device)

    def flattened(self, batch_shape: tuple[int, ...]) -> CrossDecay:
        flat = flatten_leading(self.cumulative, batch_shape, 2)  # (B|1, H|1, Lq + Lk)
        return self if flat is self.cumulative else CrossDecay(flat)

    def in_dtype(self, dtype: torch.dtype) -> CrossDecay:
        c = self.cumulative
        return self if c.dtype == dtype else CrossDecay(c.to(dtype))

    def dense(self, lq: int, lk: int) -> Tensor:
        """(..., H|1, Lq, Lk), in the compute dtype of c (`in_dtype` first for a call's)."""
        c = self.cumulative.to(compute_dtype(self.cumulative.dtype))
        return -(c[..., :lq, None] - c[..., None, lq:]).abs()


def _query_cumulative(c: Tensor, lq: int, lk: int) -> Tensor:
    """c at pos(i) for Lq > Lk: queries before the first key (pos(i) < 0) read c = 0, the value
    before any key (they see no key of a document, and causality hides every key from them)."""
    pad = c.new_zeros(*c.shape[:-1], lq - lk)
    return torch.cat([pad, c], -1)


def checked_log_forget(log_forget: Tensor) -> None:
    """ValueError unless every value is <= 0 and finite; only where values may be read (on an
    accelerator the check would make the host wait for the device: it is skipped there)."""
    if not may_read(log_forget) or log_forget.numel() == 0:
        return
    with torch.no_grad():
        # One pass over the values (a decoding step checks every cached key's log f per layer);
        # NaN propagates into both ends, and fails "<= 0" below.
        low, high = (x.item() for x in torch.aminmax(log_forget))
        if not high <= 0:
            bad = ~(log_forget <= 0)
            value = log_forget[bad].flatten()[0].item()
            raise ValueError(
                f"Decay log_forget must be <= 0 and finite (log of a forget gate in (0, 1], "
                f"e.g. F.logsigmoid(x)), got {value}"
            )
        if low == float("-inf"):
            raise ValueError(
                "Decay log_forget must be finite (-inf would forget everything before it): "
                "clamp it, e.g. log_forget.clamp_min(-1e4)"
            )


PositionTerm = Tensor | Term  # what `urpe.attention` takes as bias or gate


def as_term(term: PositionTerm | None) -> Term | None:
    """A bias or gate as a `Term` (a plain tensor becomes `Dense`)."""
    return Dense(term) if isinstance(term, Tensor) else term


def dense_term(
    term: PositionTerm | None, lq: int, lk: int, dtype: torch.dtype | None = None
) -> Tensor | None:
    """Expand a bias or gate of any accepted form to a tensor broadcastable to (B, H, Lq, Lk).
    dtype: the call's compute dtype, where the term is read as such a call reads it
    (`Term.in_dtype`)."""
    if term is None or isinstance(term, Tensor):
        return term
    if dtype is not None:
        term = term.in_dtype(dtype)
    return term.dense(lq, lk)
