"""The C++ ops' arguments after q, k, v, as library.cpp takes them: codes, tiles, terms, operands.

`OpArguments` works out, once per kind of call, what the kind fixes (the compute dtype, term
codes, tiles, normalisation, scale, causality, dropout) and adds a call's tensors (`of`); the
helpers around it bring a Toeplitz table into the rows the loops read (`toeplitz_rows`), q, k
and v into the operands' dtype and layout (`operands`) and lay the output out as the forward
writes it (`output_like`).
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

from ..dropout import keep_threshold
from ..dtypes import HALF, compute_dtype
from ..layout import ForwardArgs
from ..masks import visible_key_counts
from ..normalization import NORMALIZATIONS
from ..spec import AttentionSpec
from ..terms import TERM_KINDS

# Codes of library.cpp's enums (the normalisations are those of the backend's capability table;
# the term kinds' are the classes' own `code`, terms.h's Kind).
NORMALIZATION_CODES = {"softmax": 0, "exp": 1, "l2": 2, "relu2": 3}
NO_TERM = 0
KIND_CODES = {
    "none": NO_TERM,
    **{name: kind.code for name, kind in TERM_KINDS.items() if kind.code is not None},
}
# A Toeplitz table handed over as it is (forward only; terms.h's kToeplitzTable): a decoding
# step's gate, no rows built per call. Read as rows in place where no offset of the call is
# clamped; else each row segment gathers its clamped columns, which is cheap for a few query
# rows (up to CLAMPED_ROWS per head: a decoding step past the table's reach, whose keys would
# otherwise be gathered into rows, Lk entries per head, on every call) but not for a long
# forward's (its rows are built once per call instead).
TABLE_IN_PLACE = 5
CLAMPED_ROWS = 16

# Tile sizes (queries x keys), forward and backward, chosen by measurement (benchmarks/README.md,
# issue 21): a tile of scores stays in the L2 cache while every per-element step runs on it.
FORWARD_TILES = (256, 512)
BACKWARD_TILES = (128, 512)
# Both passes' tiles where documents are given: smaller tiles skip more of the pairs that share
# no document (documents of 64-512 tokens at L = 4096, one thread: 128 x 128 took about 2/3 of
# the time of the default tiles forward+backward, on a loaded machine).
DOCUMENT_TILES = (128, 128)
# Entries of padding after each Toeplitz row: the C++ row loops read whole spans of this many
# (kLanes in tile.h).
LANES = 16
# Up to this many queries and keys a call reads q, k, v and dO where they lie (views of a
# training step's (B, L, H, D) projections) and writes their gradients in that layout; longer
# calls take contiguous copies. Measured with one thread, forward + backward with Toeplitz B
# and C, in place over copied: 0.90 at L = 24 (B = 64, H = 4, D = 16), 0.95-0.97 at L = 192-384,
# but 1.04-1.09 at L = 512-2048 (H = 8, D = 16-64): there each row is read by many tiles, and
# rows a (H * D)-wide stride apart cost more than one copy.
IN_PLACE_LENGTH = 256


def table_columns(table_width: int, lq: int, lk: int, device: torch.device) -> Tensor:
    """The table column of each entry of a row the C++ loops read, (Lq + Lk - 1 + LANES,):
    entry e is offset j - pos(i) = e - (Lk - 1), clamped to [-K, K], then LANES entries of
    padding (read as whole spans, never used as numbers: any valid column serves).

    A view: a slice of one vector of columns per table width over offsets -R..R + LANES, so a
    KV cache that grows by a key per decoding step builds nothing per step (the vector is
    rebuilt, twice as long, when a call reaches past it)."""
    key = (table_width, device)
    base = _COLUMN_BASES.get(key)
    reach = max(lq, lk) - 1
    if base is None or (base.shape[0] - LANES - 1) // 2 < reach:
        r = max(reach, 64 if base is None else (base.shape[0] - LANES - 1))
        k = (table_width - 1) // 2
        base = torch.arange(-r, r + LANES + 1, device=device).clamp(-k, k) + k
        _COLUMN_BASES[key] = base  # (one assignment: another thread reads the old or the new)
    r = (base.shape[0] - LANES - 1) // 2
    start = r - (lk - 1)  # the base's entry of offset -(Lk - 1), a row's first
    return base[start : start + lq + lk - 1 + LANES]


# (table width, device) -> columns over offsets -R..R + LANES (`table_columns`)
_COLUMN_BASES: dict[tuple[int, torch.device], Tensor] = {}


def toeplitz_rows(table: Tensor, lq: int, lk: int, dtype: torch.dtype) -> Tensor:
    """(H|1, Lq + Lk - 1 + LANES): the table at every offset of the call, then padding; one
    gather instead of building the rows op by op."""
    if table.dtype != dtype:
        table = table.to(dtype)
    return table.index_select(1, table_columns(table.shape[1], lq, lk, table.device))


def _term(kind: str, tensor, index, lq: int, lk: int, dtype, in_place: bool = False) -> tuple:
    """(code, tensor, index) as the C++ ops take a bias or gate, where the tensor does not go as
    it is (`table_keys`). in_place (the forward of a call that needs no gradient): a
    CrossDecay's rows where they lie, float64 sums of a float32 call not converted."""
    if kind == "none" or tensor is None:
        return NO_TERM, None, None
    if kind == "cross_decay" and in_place and tensor.stride(-1) == 1:
        # a forward reads rows where they lie (a growing cache's sums: no copy per step), and
        # float64 sums for a float32 call as they are (rounded as the loops read them)
        wide = tensor.dtype == torch.float64 and dtype == torch.float32
        if tensor.dtype != dtype and not wide:
            tensor = tensor.to(dtype)
        return KIND_CODES[kind], tensor, None
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if kind == "toeplitz":
        return KIND_CODES[kind], toeplitz_rows(tensor, lq, lk, dtype), None  # (H|1, rows)
    if kind == "relation":
        if index.dtype != torch.int64:
            index = index.to(torch.int64)
        return KIND_CODES[kind], _contiguous(tensor), _contiguous(index)
    if kind == "decay":  # c = cumsum(log_forget) (B|1, H|1, Lk): the loops read -|c_i - c_j|
        return KIND_CODES[kind], tensor.cumsum(-1).contiguous(), None
    if kind == "cross_decay":  # c (B|1, H|1, Lq + Lk) as given: the queries' c, the keys'
        return KIND_CODES[kind], _contiguous(tensor), None
    return KIND_CODES[kind], tensor, None  # dense, 4-D, strides as they are


def table_keys(term: tuple, lq: int) -> int:
    """The most keys a forward of Lq queries may have for this bias's or gate's (tensor, index,
    kind) to go as it is (`TABLE_IN_PLACE`), so that a decoding step builds no rows: any number
    for a Toeplitz table and up to CLAMPED_ROWS queries, else as many as its offsets -K..K
    reach with the rows' padding (none clamped); -1 where it never goes so. Fixed by the kind
    of call (the table's width, Lq), the keys are not."""
    tensor, _, kind = term
    if kind != "toeplitz" or tensor is None:
        return -1
    if lq <= CLAMPED_ROWS:
        return sys.maxsize
    reach = (tensor.shape[1] - 1) // 2
    return reach + 1 if reach >= lq - 1 + LANES else -1


_NO_TERM = (NO_TERM, None, None)  # `_term` of an absent bias or gate
NO_TERM_ARGUMENTS = (None, None, "none")  # `term_arguments(None)`


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _statistic(call: ForwardArgs | AttentionSpec, dtype) -> Tensor | None:
    """r_i of the normalisations that know it before the first tile: (B, H, Lq)."""
    norm = NORMALIZATIONS[call.normalization]
    if norm.fixed_statistic is None:
        return None
    b, h, lq, _ = call.q.shape
    keep = call.attn_mask if _is_bool(call.attn_mask) else None
    counts = visible_key_counts(
        call.key_padding_mask,
        keep,
        call.is_causal,
        lq,
        call.k.shape[-2],
        device=call.q.device,
        document_ids=call.document_ids,
    )  # (B|1, H|1, Lq)
    counts = counts.to(dtype).expand(b, h, lq).contiguous()
    return norm.fixed_statistic(counts).contiguous()


def _is_bool(mask: Tensor | None) -> bool:
    return mask is not None and mask.dtype == torch.bool


class OpArguments:
    """The arguments the C++ ops share after q, k, v (library.cpp's schema), for one kind of
    call: what the kind fixes (the compute dtype, which terms and masks there are, the tiles,
    the normalisation, scale, causality, dropout, whether a Toeplitz table can go as it is) is
    worked out here once; `of` adds a call's tensors. A prepared call keeps one
    (`NoGradForward`); the other routes make one per call.

    `call`: the op's arguments or a spec (the fields they share); `tiles`: the pass's default
    tile sizes, where `blocks` names none; checked: the layout of `forward_if_finite`, which
    takes no documents, statistic or dropout (`checks_finite`); terms: the bias's and the
    gate's (tensor, index, kind) of a forward that may read tables as they are
    (`table_keys`: a call that needs no gradient), None for the others.
    """

    def __init__(
        self,
        call: ForwardArgs | AttentionSpec,
        tiles: tuple[int, int],
        blocks: tuple[int, int] = (0, 0),
        checked: bool = False,
        terms: tuple[tuple, tuple] | None = None,
    ) -> None:
        self.dtype = compute_dtype(call.q.dtype)
        self.lq = call.q.shape[2]
        self.in_place = terms is not None
        # per term: the most keys for which its table goes as it is (-1: never)
        self.table_keys = (-1, -1)
        if terms is not None:
            self.table_keys = (table_keys(terms[0], self.lq), table_keys(terms[1], self.lq))
        self.checked = checked
        mask = call.attn_mask
        self.mask = None if mask is None else ("bool" if mask.dtype == torch.bool else "float")
        self.statistic = NORMALIZATIONS[call.normalization].fixed_statistic is not None
        dropout_on = call.dropout_p > 0.0
        self.dropout = dropout_on
        if call.document_ids is not None:
            tiles = DOCUMENT_TILES
        self.scalars = (call.is_causal, NORMALIZATION_CODES[call.normalization], call.scale)
        self.dropout_scalars = (call.dropout_p, keep_threshold(call.dropout_p) if dropout_on else 0)
        self.blocks = (blocks[0] or tiles[0], blocks[1] or tiles[1])
        # What the kind fixes after the terms: everything, where it has no mask, padding,
        # documents, statistic or dropout (a decoding step), worked out here once; then a call
        # adds only its terms' (code, tensor, index), and without terms it adds nothing.
        self.tail = self.fixed = None
        if (
            mask is None
            and call.key_padding_mask is None
            and call.document_ids is None
            and not (self.statistic or dropout_on)
        ):
            self.tail = self._after_terms(call)
            if call.bias is None and call.gate is None:
                self.fixed = (*_NO_TERM, *_NO_TERM, *self.tail)

    def of(self, call: ForwardArgs | AttentionSpec, terms: tuple[tuple, tuple]) -> tuple:
        """The arguments for this call; terms: the bias's and the gate's (tensor, index, kind)."""
        if self.fixed is not None:
            return self.fixed
        bias, gate = terms
        lk = call.k.shape[2]
        bias_keys, gate_keys = self.table_keys
        bias = _NO_TERM if bias[0] is None else self._operands(bias, bias_keys, lk)
        gate = _NO_TERM if gate[0] is None else self._operands(gate, gate_keys, lk)
        tail = self.tail
        if tail is None:
            tail = self._after_terms(call)
        return (*bias, *gate, *tail)

    def _operands(self, term: tuple, keys: int, lk: int) -> tuple:
        """(code, tensor, index) of a bias's or gate's (tensor, index, kind) at Lk keys; keys:
        the most for which its table goes as it is (`table_keys`)."""
        tensor, index, kind = term
        dtype = self.dtype
        if lk <= keys:
            if tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            return TABLE_IN_PLACE, tensor if tensor.is_contiguous() else tensor.contiguous(), None
        return _term(kind, tensor, index, self.lq, lk, dtype, self.in_place)

    def _after_terms(self, call: ForwardArgs | AttentionSpec) -> tuple:
        """The arguments after the bias's and the gate's, for this call."""
        dtype = self.dtype
        mask, padding = call.attn_mask, call.key_padding_mask
        masks = (
            None if self.mask != "float" else mask.to(dtype),  # float: added to the logits
            mask if self.mask == "bool" else None,
            None if padding is None else padding.contiguous(),
        )
        if self.checked:
            return (*masks, *self.scalars, *self.blocks)
        ids = call.document_ids
        return (
            *masks,
            None if ids is None else ids.to(torch.int64).contiguous(),
            _statistic(call, dtype) if self.statistic else None,
            *self.scalars,
            *self.dropout_scalars,
            call.dropout_seed if self.dropout else None,  # a tensor: read in C++, not here
            *self.blocks,
        )


def bf16_products(dtype: torch.dtype) -> bool:
    """Whether the products take bfloat16 operands as they are (bf16 x bf16 -> float BLAS, as
    SDPA multiplies them), instead of converting q, k, v to float32."""
    return dtype == torch.bfloat16 and _hasbf16_products()


@functools.cache
def _hasbf16_products() -> bool:
    return bool(torch.ops.urpe_cpp.bf16_products())  # fixed for the loaded library


def operands(call: ForwardArgs | AttentionSpec) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the ops take them (`_as_operand`)."""
    q, k, v = call.q, call.k, call.v
    dtype = q.dtype
    if dtype in HALF and not bf16_products(dtype):
        dtype = torch.float32
    if (
        k.dtype == dtype == v.dtype == q.dtype
        and q.is_contiguous()
        and k.is_contiguous()
        and v.is_contiguous()
    ):
        return q, k, v  # (most calls: nothing to convert)
    in_place = reads_in_place(q, k)
    return (
        as_operand(q, dtype, in_place),
        as_operand(k, dtype, in_place),
        as_operand(v, dtype, in_place),
    )


def reads_in_place(q: Tensor, k: Tensor) -> bool:
    """Whether a call of these q (B, H, Lq, D) and k (B, Hkv, Lk, D) reads its operands where
    they lie (`IN_PLACE_LENGTH`)."""
    return q.shape[-2] <= IN_PLACE_LENGTH and k.shape[-2] <= IN_PLACE_LENGTH


def as_operand(t: Tensor, dtype: torch.dtype, in_place: bool) -> Tensor:
    """t in `dtype`: where it lies for a call that reads in place and rows the kernel can read
    (a view of a (B, L, H, E) projection: no copy here, and its gradient comes back in that
    layout), else contiguous."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.is_contiguous():
        return t
    return t if in_place and readable_rows(t) else t.contiguous()


def readable_rows(t: Tensor) -> bool:
    """Whether the C++ ops read a (B, H, L, E) tensor as it lies (library.cpp's
    `readable_rows`): E contiguous, rows at least a row apart."""
    _, _, length, e = t.shape
    return (e <= 1 or t.stride(3) == 1) and (length <= 1 or t.stride(2) >= e)


def output_like(q: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty output as the C++ forward lays it out: (B, H, Lq, Dv), a view of (B, Lq, H, Dv)
    memory, whose (B, Lq, H * Dv) rows for a model's out projection are a view, not a copy."""
    b, h, lq, _ = q.shape
    return q.new_empty(b, lq, h, v.shape[-1], dtype=dtype).transpose(1, 2)


def laid_out(out: Tensor) -> Tensor:
    """out (B, H, Lq, Dv) with the strides `output_like` gives (a copy where it has others: the
    non-finite rule's output)."""
    b, h, lq, dv = out.shape
    if out.stride() == (lq * h * dv, dv, h * dv, 1):
        return out
    return out.new_empty(b, lq, h, dv).transpose(1, 2).copy_(out)
