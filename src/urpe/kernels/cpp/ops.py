"""The C++ kernel's layers, on the raw-op layout every kernel shares.

`cpp_forward(ForwardArgs)` and `cpp_backward(BackwardArgs)` bring the arguments into the form
the C++ ops take (the compute dtype, contiguous, a Toeplitz table read out at every offset of
the call, the statistic of exp/relu2 counted up front) and turn the C++ gradients back into
gradients of the caller's tensors. `define_attention_ops` puts them behind
`urpe::cpp_attention_r2_forward` / `_backward` (`OPS`) with fake implementations, vmap rules and an
autograd Function, as for the blockwise and Triton kernels, so torch.func and torch.compile
compose with them.

`forward_no_grad(AttentionSpec)` is the forward of calls that need no gradient: one op call that
also finds NaN/inf in q, k and v (`urpe_cpp::forward_if_finite`), returning None where it met
one. `GUARDED_FORWARD` runs it as one opaque op under torch.compile, applying the non-finite rule
itself at run time, where values may be read.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..composable import define_attention_ops
from ..dropout import keep_threshold
from ..dtypes import HALF, compute_dtype
from ..layout import FORWARD_SCHEMA, BackwardArgs, ForwardArgs, term_arguments
from ..masks import visible_key_counts
from ..nonfinite import guarded
from ..normalization import NORMALIZATIONS
from ..spec import AttentionSpec
from ..terms import TERM_KINDS

# Codes of library.cpp's enums (the normalisations are those of the backend's capability table;
# the term kinds' are the classes' own `code`, tile.h's TermKind).
NORMALIZATION_CODES = {"softmax": 0, "exp": 1, "l2": 2, "relu2": 3}
NO_TERM = 0
KIND_CODES = {
    "none": NO_TERM,
    **{name: kind.code for name, kind in TERM_KINDS.items() if kind.code is not None},
}
# A Toeplitz table handed over as it is, read in place where no offset of the call is clamped
# (forward only; tile.h's kToeplitzTable): a decoding step's gate, no rows built per call
TABLE_IN_PLACE = 5

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
# Backward work items wanted per thread: with fewer (batch, kv head) pairs than that, the query
# blocks are split into ranges with their own dk/dv copies, so a slowed thread can be helped.
ITEMS_PER_THREAD = 4


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


def covers_call(table: Tensor, lq: int, lk: int) -> bool:
    """Whether a Toeplitz table's offsets -K..K reach every offset of the call and the rows'
    padding, so that the forward reads it in place (`TABLE_IN_PLACE`): no rows are built."""
    k = (table.shape[1] - 1) // 2
    return k >= lk - 1 and k >= lq - 1 + LANES


def _term(kind: str, tensor, index, lq: int, lk: int, dtype, in_place: bool = False) -> tuple:
    """(code, tensor, index) as the C++ ops take a bias or gate. in_place: a Toeplitz table
    that covers the call goes as it is (the forward of a call that needs no gradient)."""
    if kind == "none" or tensor is None:
        return NO_TERM, None, None
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if kind == "toeplitz":
        if in_place and covers_call(tensor, lq, lk):
            return TABLE_IN_PLACE, _contiguous(tensor), None
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


_NO_TERM = (NO_TERM, None, None)  # `_term` of an absent bias or gate
_NO_TERM_ARGUMENTS = (None, None, "none")  # `term_arguments(None)`


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


def _raw_terms(call: ForwardArgs) -> tuple[tuple, tuple]:
    """The op arguments' bias and gate, each as (tensor, index, kind)."""
    return (call.bias, call.bias_index, call.bias_kind), (
        call.gate,
        call.gate_index,
        call.gate_kind,
    )


def _forward_arguments(call: ForwardArgs, tiles: tuple[int, int]) -> tuple:
    """`_op_arguments` of the forward op's arguments."""
    return _op_arguments(call, _raw_terms(call), tiles, (call.block_q, call.block_k))


def _op_arguments(
    call: ForwardArgs | AttentionSpec,
    terms: tuple[tuple, tuple],
    tiles: tuple[int, int],
    blocks: tuple[int, int] = (0, 0),
    in_place: bool = False,
) -> tuple:
    """The arguments the C++ ops share, after q, k, v (library.cpp's schema). `call`: the op's
    arguments or a spec (the fields they share); terms: the bias's and the gate's (tensor,
    index, kind); `tiles`: the pass's default tile sizes, where `blocks` names none; in_place:
    Toeplitz tables that cover the call go as they are (a forward only)."""
    dtype = compute_dtype(call.q.dtype)
    (bias, bias_index, bias_kind), (gate, gate_index, gate_kind) = terms
    if bias is not None or gate is not None:
        lq, lk = call.q.shape[2], call.k.shape[2]
    mask = call.attn_mask
    bool_mask = mask is not None and mask.dtype == torch.bool
    dropout_on = call.dropout_p > 0.0
    ids = call.document_ids
    if ids is not None:
        tiles = DOCUMENT_TILES
    if bias is not None:
        bias = _term(bias_kind, bias, bias_index, lq, lk, dtype, in_place)
    if gate is not None:
        gate = _term(gate_kind, gate, gate_index, lq, lk, dtype, in_place)
    return (
        *(bias or _NO_TERM),  # (code, tensor, index)
        *(gate or _NO_TERM),
        None if mask is None or bool_mask else mask.to(dtype),  # float: added to the logits
        mask if bool_mask else None,
        None if call.key_padding_mask is None else call.key_padding_mask.contiguous(),
        None if ids is None else ids.to(torch.int64).contiguous(),
        _statistic(call, dtype),
        call.is_causal,
        NORMALIZATION_CODES[call.normalization],
        call.scale,
        call.dropout_p,
        keep_threshold(call.dropout_p) if dropout_on else 0,
        call.dropout_seed if dropout_on else None,  # a tensor: read in C++, not here
        blocks[0] or tiles[0],
        blocks[1] or tiles[1],
    )


@functools.cache
def _op(name: str):
    """The C++ op's overload (looked up once: through torch.ops it costs a microsecond a call)."""
    return getattr(torch.ops.urpe_cpp, name).default


def _bf16_products(dtype: torch.dtype) -> bool:
    """Whether the products take bfloat16 operands as they are (bf16 x bf16 -> float BLAS, as
    SDPA multiplies them), instead of converting q, k, v to float32."""
    return dtype == torch.bfloat16 and _has_bf16_products()


@functools.cache
def _has_bf16_products() -> bool:
    return bool(torch.ops.urpe_cpp.bf16_products())  # fixed for the loaded library


def _operands(call: ForwardArgs | AttentionSpec) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the ops take them (`_as_operand`)."""
    q, k, v = call.q, call.k, call.v
    dtype = q.dtype
    if dtype in HALF and not _bf16_products(dtype):
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
        _as_operand(q, dtype, in_place),
        _as_operand(k, dtype, in_place),
        _as_operand(v, dtype, in_place),
    )


def reads_in_place(q: Tensor, k: Tensor) -> bool:
    """Whether a call of these q (B, H, Lq, D) and k (B, Hkv, Lk, D) reads its operands where
    they lie (`IN_PLACE_LENGTH`)."""
    return q.shape[-2] <= IN_PLACE_LENGTH and k.shape[-2] <= IN_PLACE_LENGTH


def _as_operand(t: Tensor, dtype: torch.dtype, in_place: bool) -> Tensor:
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


def forward_fake(args: ForwardArgs) -> tuple[Tensor, Tensor]:
    """The forward op's outputs as `cpp_forward` lays them out."""
    dtype = compute_dtype(args.q.dtype)
    b, h, lq, _ = args.q.shape
    return output_like(args.q, args.v, dtype), args.q.new_empty(b, h, lq, 1, dtype=dtype)


def cpp_forward(call: ForwardArgs) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, Dv) laid out as `output_like`, row statistic (B, H, Lq, 1)), both in the
    compute dtype."""
    out, stat = _op("forward")(*_operands(call), *_forward_arguments(call, FORWARD_TILES))
    return out, stat.unsqueeze(-1)


def _output_rows(out: Tensor, dtype: torch.dtype) -> Tensor:
    """The forward's output as the backward reads it: where it lies (only one pass over its
    rows reads it, at any length)."""
    return _as_operand(out, dtype, in_place=True)


def _term_gradient(kind: str, tensor: Tensor, grad: Tensor, lq: int, lk: int) -> Tensor:
    """The C++ gradient of a term's tensor as the gradient of the caller's tensor."""
    if kind == "toeplitz":  # per offset (the padding dropped) -> per table column
        offsets = lq + lk - 1
        if lq == lk and tensor.shape[1] == offsets:  # a table of exactly the call's offsets
            return grad[:, :offsets].to(tensor.dtype)  # (its columns: no sum, no clipping)
        columns = table_columns(tensor.shape[1], lq, lk, tensor.device)[:offsets]
        grad = grad.new_zeros(tensor.shape).index_add_(1, columns, grad[:, :offsets])
    elif kind == "decay":  # d c -> d log_forget: c_t sums log_forget_s for s <= t
        grad = grad.flip(-1).cumsum(-1).flip(-1)
    return grad.to(tensor.dtype)


def cpp_backward(args: BackwardArgs):
    """(dq, dk, dv, d bias, d gate, d float attn_mask); None for a term not asked for."""
    call = args.forward
    dtype = compute_dtype(call.q.dtype)
    lq, lk = call.q.shape[2], call.k.shape[2]
    operand = call.q.dtype if _bf16_products(call.q.dtype) else dtype  # dO as q, k, v go in
    in_place = reads_in_place(call.q, call.k)
    grad_out = _as_operand(args.grad_out, operand, in_place)
    stat = args.stat.reshape(args.stat.shape[:3]).contiguous()  # (B, H, Lq)
    dq, dk, dv, *term_grads = _op("backward")(
        grad_out,
        stat,
        _output_rows(args.out, dtype),  # (B, H, Lq, Dv): for sum_e dO O per row
        *_operands(call),
        *_forward_arguments(call, BACKWARD_TILES),
        *args.needs,
        ITEMS_PER_THREAD,
    )
    grads = []
    for (kind, tensor), needed, grad in zip(
        (
            (call.bias_kind, call.bias),
            (call.gate_kind, call.gate),
            ("dense", call.attn_mask),
        ),
        args.needs,
        term_grads,
        strict=True,
    ):
        useful = needed and tensor is not None and kind != "none" and grad.numel() > 0
        grads.append(_term_gradient(kind, tensor, grad, lq, lk) if useful else None)
    return (dq.to(call.q.dtype), dk.to(call.k.dtype), dv.to(call.v.dtype), *grads)


# Inductor's and AOTAutograd's on-disk caches key a compiled graph by its code, which names the
# ops it calls but not the strides their fakes promise: where an op's output layout changes, its
# name must change too, or a graph compiled by an earlier urpe is loaded and fails its stride
# check. Revision 2: the output lies in (B, Lq, H, Dv) memory.
REVISION = 2
OPS = f"cpp_attention_r{REVISION}"  # urpe::{OPS}_forward / _backward
CPP = define_attention_ops(OPS, cpp_forward, cpp_backward, forward_fake)


# ---------------------------------------------------------------------------------------------
# Calls that need no gradient


def forward_no_grad(spec: AttentionSpec, block_q: int = 0, block_k: int = 0) -> Tensor | None:
    """(B, H, Lq, Dv) in q's dtype, laid out as `output_like`; None where q, k or v hold a NaN
    or inf the call reads (or a logit or output came out non-finite: the caller then asks).
    block_q, block_k: tile sizes (0: the defaults).

    One op call, `urpe_cpp::forward_if_finite`, which finds non-finite numbers in the rows of
    q, k and v that the tiles it computes read (for one query row per head: in the logits and
    outputs it computes, so that a decoding step reads its KV cache once), never in those of
    skipped tiles (a padded tail). Calls it takes no arguments for (documents, a statistic known
    up front, dropout) run `urpe_cpp::forward_checked`, the same with the forward's arguments."""
    bias, gate = spec.bias, spec.gate
    terms = (
        _NO_TERM_ARGUMENTS if bias is None else term_arguments(bias),
        _NO_TERM_ARGUMENTS if gate is None else term_arguments(gate),
    )
    return _forward_if_finite(spec, terms, (block_q, block_k))


def _forward_if_finite(
    call: AttentionSpec | ForwardArgs, terms: tuple[tuple, tuple], blocks: tuple[int, int]
) -> Tensor | None:
    """`forward_no_grad` of a spec or of the op's arguments (under compile), its terms as the
    raw ops' (tensor, index, kind)."""
    q, k, v = _operands(call)
    args = _op_arguments(call, terms, FORWARD_TILES, blocks, in_place=True)
    if call.document_ids is None and args[10] is None and call.dropout_p == 0.0:
        # (the forward's arguments without documents, statistic and dropout: library.cpp)
        out, finite = _op("forward_if_finite")(q, k, v, *args[:9], *args[11:14], *args[17:])
        if not finite:
            return None
    else:
        out, finite = _op("forward_checked")(q, k, v, *args)
        if not finite:
            return None
    return out if out.dtype == call.q.dtype else out.to(call.q.dtype)


# Under torch.compile a call that needs no gradient runs as one opaque op whose body runs
# eagerly at run time, where the CPU's values may be read: `forward_no_grad`, or (non-finite
# inputs) the non-finite rule applied directly. Traced instead, the rule would be tensor ops
# around the kernel (masked copies of q, k, v: a whole static KV cache per layer and step),
# about as costly as a decoding call itself. Registered as a plain CPU kernel, not with
# `torch.library.custom_op`, whose autograd, redispatch and dynamo-disabling layers cost about
# 10 us per call (the op is only called where nothing records a gradient, from compiled
# graphs, where dynamo is off already).
def _guarded_forward(*flat) -> Tensor:
    call = ForwardArgs(*flat)
    out = _forward_if_finite(call, _raw_terms(call), (call.block_q, call.block_k))
    if out is None:  # (the rule below makes q, k and v finite)
        spec = call.to_spec().replace(finite=True)
        out, _ = guarded(_forward_finite, spec, finds_nonfinite=False)
    return laid_out(out)


def _forward_finite(spec: AttentionSpec) -> Tensor:
    """The forward of a call whose q, k and v hold no NaN/inf."""
    out, _ = cpp_forward(ForwardArgs.from_spec(spec))
    return out if out.dtype == spec.q.dtype else out.to(spec.q.dtype)


_LIBRARY = torch.library.Library("urpe", "FRAGMENT")
GUARDED = f"cpp_guarded_forward_r{REVISION}"  # named by the layout's revision (above)
_LIBRARY.define(GUARDED + FORWARD_SCHEMA.replace("-> (Tensor, Tensor)", "-> Tensor"))
_LIBRARY.impl(GUARDED, _guarded_forward, "CPU")
torch.library.register_fake(
    f"urpe::{GUARDED}",
    lambda *flat: output_like(flat[0], flat[2], flat[0].dtype),
    lib=_LIBRARY,
)
GUARDED_FORWARD = getattr(torch.ops.urpe, GUARDED).default
