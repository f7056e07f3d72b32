"""The C++ kernel behind a pair of custom ops, on the raw-op layout every kernel shares.

`cpp_forward(ForwardArgs)` and `cpp_backward(BackwardArgs)` bring the arguments into the form
the C++ ops take (the compute dtype, contiguous, a Toeplitz table read out at every offset of
the call, the statistic of exp/relu2 counted up front) and turn the C++ gradients back into
gradients of the caller's tensors. `define_attention_ops` puts them behind
`urpe::cpp_attention_r2_forward` / `_backward` (`OPS`) with fake implementations, vmap rules and an
autograd Function, as for the blockwise and Triton kernels, so torch.func and torch.compile
compose with them.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..composable import define_attention_ops
from ..dropout import keep_threshold
from ..dtypes import compute_dtype
from ..layout import BackwardArgs, ForwardArgs
from ..masks import visible_key_counts
from ..normalization import NORMALIZATIONS

# Codes of library.cpp's enums (the normalisations are those of the backend's capability table).
NORMALIZATION_CODES = {"softmax": 0, "exp": 1, "l2": 2, "relu2": 3}
KIND_CODES = {"none": 0, "dense": 1, "toeplitz": 2, "relation": 3, "decay": 4}
# A Toeplitz table handed over as it is, read in place where no offset of the call is clamped
# (forward only; tile.h's kToeplitzTable): the decoding path's gate, no rows built per call
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


def toeplitz_columns(table_width: int, lq: int, lk: int, device) -> Tensor:
    """Table column of each offset the call meets: entry e = j - i + Lq - 1 of a row read by
    the C++ loop is offset j - pos(i) = e - (Lk - 1), clamped to [-K, K]. (Lq + Lk - 1,)"""
    k = (table_width - 1) // 2
    offsets = torch.arange(lq + lk - 1, device=device) - (lk - 1)
    return offsets.clamp(-k, k) + k


@functools.lru_cache(maxsize=64)
def padded_columns(table_width: int, lq: int, lk: int, device: torch.device) -> Tensor:
    """`toeplitz_columns`, then LANES more columns for the rows' padding (what the loops read
    past the last offset is never used as a number: any valid column serves). Cached: a model
    meets the same few (width, Lq, Lk) in every layer and every decoding step."""
    columns = toeplitz_columns(table_width, lq, lk, device)
    return torch.cat([columns, columns[-1:].expand(LANES)])


def sliding_columns(table_width: int, lq: int, lk: int, device: torch.device) -> Tensor:
    """`padded_columns`' first Lq + Lk - 1 entries, and valid columns as its padding, as a
    view: a slice of one vector of columns per table width, over offsets -R..R + LANES. A
    growing KV cache meets a new Lk at every decoding step, where a cache by (width, Lq, Lk)
    would miss and build three tensors."""
    key = (table_width, device)
    base = _COLUMN_BASES.get(key)
    reach = max(lq, lk) - 1
    if base is None or (base.shape[0] - LANES - 1) // 2 < reach:
        # (doubled: a cache growing one key a step rebuilds it log(L) times)
        r = max(reach, 64 if base is None else (base.shape[0] - LANES - 1))
        k = (table_width - 1) // 2
        base = _COLUMN_BASES[key] = torch.arange(-r, r + LANES + 1, device=device).clamp(-k, k) + k
    r = (base.shape[0] - LANES - 1) // 2
    start = r - (lk - 1)  # the base's entry of offset -(Lk - 1), a row's first
    return base[start : start + lq + lk - 1 + LANES]


# (table width, device) -> columns over offsets -R..R + LANES (`sliding_columns`)
_COLUMN_BASES: dict[tuple[int, torch.device], Tensor] = {}
# The slices themselves, remembered: a decoding step's layers all meet the same (width, Lq, Lk)
decoding_columns = functools.lru_cache(maxsize=16)(sliding_columns)


def toeplitz_rows(table: Tensor, lq: int, lk: int, dtype: torch.dtype) -> Tensor:
    """(H|1, Lq + Lk - 1 + LANES): the table at every offset of the call, then padding; one
    gather (with the columns cached) instead of building the rows op by op."""
    if table.dtype != dtype:
        table = table.to(dtype)
    # (the ops' bodies run eagerly, also under torch.compile: the cache is always usable here)
    return table.index_select(1, padded_columns(table.shape[1], lq, lk, table.device))


def _term(kind: str, tensor: Tensor | None, index: Tensor | None, lq: int, lk: int, dtype):
    """(code, tensor, index) as the C++ ops take a bias or gate."""
    if kind == "none" or tensor is None:
        return 0, None, None
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if kind == "toeplitz":  # (H|1, Lq + Lk - 1 + LANES): the table at every offset, then padding
        return KIND_CODES[kind], toeplitz_rows(tensor, lq, lk, dtype), None
    if kind == "relation":
        if index.dtype != torch.int64:
            index = index.to(torch.int64)
        return KIND_CODES[kind], tensor.contiguous(), index
    if kind == "decay":  # c = cumsum(log_forget) (B|1, H|1, Lk): the loops read -|c_i - c_j|
        return KIND_CODES[kind], tensor.cumsum(-1).contiguous(), None
    return KIND_CODES[kind], tensor, None  # dense, 4-D, strides as they are


def _statistic(call: ForwardArgs, dtype) -> Tensor | None:
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


def _op_arguments(call: ForwardArgs, tiles: tuple[int, int]) -> tuple:
    """The arguments the C++ ops share, after q, k, v (library.cpp's schema); `tiles`: the
    pass's default tile sizes, where the call names none."""
    dtype = compute_dtype(call.q.dtype)
    lq, lk = call.q.shape[2], call.k.shape[2]
    float_mask = None
    if call.attn_mask is not None and not _is_bool(call.attn_mask):
        float_mask = call.attn_mask.to(dtype)
    dropout_on = call.dropout_p > 0.0
    if call.document_ids is not None:
        tiles = DOCUMENT_TILES
    return (
        *_term(call.bias_kind, call.bias, call.bias_index, lq, lk, dtype),
        *_term(call.gate_kind, call.gate, call.gate_index, lq, lk, dtype),
        float_mask,
        call.attn_mask if _is_bool(call.attn_mask) else None,
        None if call.key_padding_mask is None else call.key_padding_mask.contiguous(),
        None if call.document_ids is None else call.document_ids.to(torch.int64).contiguous(),
        _statistic(call, dtype),
        call.is_causal,
        NORMALIZATION_CODES[call.normalization],
        call.scale,
        call.dropout_p,
        keep_threshold(call.dropout_p) if dropout_on else 0,
        call.dropout_seed if dropout_on else None,  # a tensor: read in C++, not here
        call.block_q or tiles[0],
        call.block_k or tiles[1],
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


def _operands(call: ForwardArgs) -> tuple[Tensor, Tensor, Tensor]:
    dtype = call.q.dtype if _bf16_products(call.q.dtype) else compute_dtype(call.q.dtype)
    in_place = reads_in_place(call.q, call.k)
    return tuple(_as_operand(t, dtype, in_place) for t in (call.q, call.k, call.v))


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
    return t if (in_place or t.is_contiguous()) and readable_rows(t) else t.contiguous()


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
    out, stat = _op("forward")(*_operands(call), *_op_arguments(call, FORWARD_TILES))
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
        columns = padded_columns(tensor.shape[1], lq, lk, tensor.device)[:offsets]
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
        *_op_arguments(call, BACKWARD_TILES),
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
