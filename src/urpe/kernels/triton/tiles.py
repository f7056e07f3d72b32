"""Pieces the Triton attention kernels share: kind and normalisation codes, tile addressing,
masking, term reads and their gradients, dropout, the normalised weights (see `kernels`)."""

from __future__ import annotations

import triton
import triton.language as tl

# Kinds of a bias or gate term, and normalisations (each combination compiles its own program).
# They must be `tl.constexpr` objects: a compiled kernel may read no other module global (the CPU
# interpreter allows plain ints, which is how a plain int here once broke every GPU launch).
# The launcher takes their plain values (`.value`). The kinds' codes are the term classes' own
# (`urpe.kernels.Term.code`, terms.h's Kind; tests/test_terms.py checks all three agree).
NO_TERM, DENSE, TOEPLITZ, RELATION, DECAY = (tl.constexpr(code) for code in range(5))
SOFTMAX, EXP, L2, RELU2 = (tl.constexpr(code) for code in range(4))


@triton.jit
def program(length, BLOCK: tl.constexpr):
    """(tile, row) of this program. The grid is one axis of tiles * rows, tiles fastest (axis 0
    takes 2^31 - 1 programs; axes 1 and 2 stop at 65,535, too few for batch * heads)."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(length, BLOCK)
    return pid % tiles, pid // tiles


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 (or float64) accumulation. UPCAST: multiply in float32 (the
    interpreter's numpy backend has no bfloat16 matrix product)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def wide(x):
    """x as int64: offsets into a (B, H, L, L) tensor pass 2^31 where B * H * L^2 does."""
    return tl.to_tensor(x).to(tl.int64)


@triton.jit
def origin(b, s_b, h, s_h, m0, s_i, n0, s_j):
    """Offset (int64) of element (b, h, m0, n0) of a 4-D tensor with these strides: the corner
    of a tile. Every factor is widened first: b * s_b or m0 * s_i alone can pass 2^31."""
    return wide(b) * s_b + wide(h) * s_h + wide(m0) * s_i + wide(n0) * s_j


@triton.jit
def tile(corner_ptr, rows, cols, s_i, s_j):
    """Pointers (R, C) of a tile: its corner (the first row and column, offset in int64 by the
    caller) plus rows (R,) and cols (C,) within the tile, whose int32 offsets stay small."""
    return corner_ptr + rows[:, None] * s_i + cols[None, :] * s_j


@triton.jit
def document_of(span_ptr, b, positions, lk, missing):
    """The document of the keys at these positions (a query's: i + Lk - Lq), named by its first
    key; `missing` (< 0) outside [0, Lk). span_ptr: (B, 5, Lk) int32 (`ops._document_spans`)."""
    inside = (positions >= 0) & (positions < lk)
    return tl.load(span_ptr + b * 5 * lk + positions, mask=inside, other=missing)


@triton.jit
def document_span(span_ptr, b, start, end, lk):
    """(first, last): keys first..last hold every key of the documents of positions start..end
    (a block's; clamped to [0, Lk), last = -1 when end < 0). Two scalar loads of the spans'
    running bounds, not a min/max over the block's ids (with which the bf16 D=128 dK/dV kernel
    on sm_90 went from 238 registers to 255 and a 16 B spill): exact for packed, sorted ids,
    wider for interleaved ones."""
    row = span_ptr + b * 5 * lk
    first = tl.load(row + lk + tl.minimum(tl.maximum(start, 0), lk - 1))
    last = tl.load(row + 2 * lk + tl.minimum(tl.maximum(end, 0), lk - 1))
    return first, tl.where(end < 0, -1, last)


@triton.jit
def unpadded_keys(span_ptr, b, lo, hi, lk):
    """Keys [lo, hi) narrowed to those from the first unpadded key on to the last unpadded one
    (empty where all are padded): the keys past either end are hidden from every query, and a
    padded tail's tiles are never visited. Two scalar loads of the spans' rows 3 and 4."""
    row = span_ptr + b * 5 * lk
    after = tl.load(row + 3 * lk + tl.minimum(tl.maximum(lo, 0), lk - 1))
    before = tl.load(row + 4 * lk + tl.minimum(tl.maximum(hi - 1, 0), lk - 1))
    return tl.maximum(lo, after), tl.minimum(hi, before + 1)


@triton.jit
def any_unpadded(span_ptr, b, n0, n1, lk):
    """Whether any key of [n0, n1) is unpadded (a dK/dV block of padded keys is seen by no
    query: it walks none)."""
    after = tl.load(span_ptr + b * 5 * lk + 3 * lk + tl.minimum(n0, lk - 1))
    return after < tl.minimum(n1, lk)


@triton.jit
def visible(
    offs_m,
    offs_n,
    m0,
    n0,
    b,
    h,
    lq,
    lk,
    shift,
    pad_ptr,
    mask_ptr,
    M_sb,
    M_sh,
    M_si,
    M_sj,
    span_ptr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_MASK: tl.constexpr,
    DOCS: tl.constexpr,
):
    """Bool (BLOCK_M, BLOCK_N): query offs_m may see key offs_n (in range, unpadded, causal,
    in the same document (`document_of`), allowed by the boolean attn_mask, read through its
    strides: 0 where it broadcasts)."""
    if DOCS:  # one compare: queries out of range (or before the first key) read document -1,
        # keys out of range -2, so equal documents imply both in range
        q_doc = document_of(span_ptr, b, offs_m + shift, lk, -1)
        k_doc = document_of(span_ptr, b, offs_n, lk, -2)
        keep = q_doc[:, None] == k_doc[None, :]
    else:
        keep = (offs_m[:, None] < lq) & (offs_n[None, :] < lk)
    if CAUSAL:  # query i sits at position i + shift, shift = Lk - Lq
        keep = keep & (offs_n[None, :] <= offs_m[:, None] + shift)
    if HAS_PAD:
        padded = tl.load(pad_ptr + b * lk + offs_n, mask=offs_n < lk, other=1)
        keep = keep & (padded == 0)[None, :]
    if HAS_MASK:
        corner = origin(b, M_sb, h, M_sh, m0, M_si, n0, M_sj)
        allowed = tl.load(
            tile(mask_ptr + corner, offs_m - m0, offs_n - n0, M_si, M_sj), mask=keep, other=0
        )
        keep = keep & (allowed != 0)
    return keep


@triton.jit
def term_tile(
    KIND: tl.constexpr,
    ptr,
    idx_ptr,
    s_b,
    s_h,
    s_i,
    s_j,
    max_offset,
    b,
    h,
    offs_m,
    offs_n,
    m0,
    n0,
    shift,
    inside,
    ACC: tl.constexpr,
):
    """One tile of a bias or gate, (BLOCK_M, BLOCK_N) in the accumulator dtype.

    TOEPLITZ: table[h, clamp(j - pos(i), -K, K) + K] (s_h = 0 shares one row across heads).
    RELATION: table[h, index[b, i, j]] (index strides s_b, s_i, s_j; s_b = 0 shares one index).
    DENSE: term[b, h, i, j] through strides, 0 where the term broadcasts.
    (A DECAY bias is the kernels' own: `decay_at`.)
    """
    if KIND == TOEPLITZ:
        d = offs_n[None, :] - offs_m[:, None] - shift
        col = tl.minimum(tl.maximum(d, -max_offset), max_offset) + max_offset
        val = tl.load(ptr + h * s_h + col, mask=inside, other=0.0)
    elif KIND == RELATION:
        corner = idx_ptr + origin(b, s_b, 0, 0, m0, s_i, n0, s_j)
        rel = tl.load(tile(corner, offs_m - m0, offs_n - n0, s_i, s_j), mask=inside, other=0)
        val = tl.load(ptr + h * s_h + rel, mask=inside, other=0.0)  # rel < table width
    else:
        corner = ptr + origin(b, s_b, h, s_h, m0, s_i, n0, s_j)
        val = tl.load(tile(corner, offs_m - m0, offs_n - n0, s_i, s_j), mask=inside, other=0.0)
    return val.to(ACC)


@triton.jit
def decay_at(ptr, s_b, s_h, b, h, positions, lk):
    """A Decay's c = cumsum(log_forget) at these positions: ptr (B|1, H|1, Lk) through s_b, s_h
    (0 where it broadcasts); 0 outside [0, Lk) (a query before the first key reads 0). The
    kernels load c at their fixed positions once and c at the walked ones per tile, and form
    the bias -|c_pos(i) - c_j| in registers."""
    row = ptr + wide(b) * s_b + wide(h) * s_h
    return tl.load(row + positions, mask=(positions >= 0) & (positions < lk), other=0.0)


@triton.jit
def decay_grad(ds, c_q, c_k):
    """A tile's gradient of c through b_ij = -|c_q_i - c_k_j| from dB = ds: (per query, per
    key) sums, -sum_j ds_ij sign(c_q_i - c_k_j) and sum_i ds_ij sign(...). sign(0) = 0, as
    torch's |x| has it. The dQ kernel keeps the first, the dK/dV kernel the second: each entry
    is written once (no atomics)."""
    diff = c_q[:, None] - c_k[None, :]
    # (ds times a sign computed as a number cost the sm_90 bf16 D=128 dQ kernel an 8 B spill)
    signed = tl.where(diff > 0, ds, tl.where(diff < 0, -ds, 0.0))
    return -tl.sum(signed, 1), tl.sum(signed, 0)


@triton.jit
def term_grad(
    KIND: tl.constexpr,
    grad,
    gptr,
    g_sh,
    idx_ptr,
    s_b,
    s_i,
    s_j,
    max_offset,
    b,
    h,
    offs_m,
    offs_n,
    m0,
    n0,
    shift,
    inside,
    lq,
    lk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """Add one tile's gradient `grad` (BLOCK_M, BLOCK_N) into the term's gradient buffer.

    TOEPLITZ: the tile's entries on one diagonal share a table entry. Skewing the tile (row r
    shifted by BLOCK_M - 1 - r, one `tl.gather`) lines the diagonals up as columns, so one
    column sum gives all BLOCK_M + BLOCK_N - 1 diagonal sums; each is added atomically.
    RELATION: every entry is added atomically at its index. DENSE: stored, each entry once.
    """
    if KIND == TOEPLITZ:
        t = tl.arange(0, WIDTH)
        rows = tl.arange(0, BLOCK_M)
        src = t[None, :] - (BLOCK_M - 1) + rows[:, None]  # the column on diagonal t in row r
        on_tile = (src >= 0) & (src < BLOCK_N)
        skewed = tl.gather(grad, tl.minimum(tl.maximum(src, 0), BLOCK_N - 1), 1)
        sums = tl.sum(tl.where(on_tile, skewed, 0.0), 0)  # (WIDTH,)
        d = n0 - m0 - shift - (BLOCK_M - 1) + t  # offset j - pos(i) of diagonal t
        col = tl.minimum(tl.maximum(d, -max_offset), max_offset) + max_offset
        tl.atomic_add(gptr + h * g_sh + col, sums, mask=t < BLOCK_M + BLOCK_N - 1)
    elif KIND == RELATION:
        corner = idx_ptr + origin(b, s_b, 0, 0, m0, s_i, n0, s_j)
        rel = tl.load(tile(corner, offs_m - m0, offs_n - n0, s_i, s_j), mask=inside, other=0)
        tl.atomic_add(gptr + h * g_sh + rel, grad, mask=inside)
    else:  # a full (B, H, Lq, Lk) buffer, contiguous
        corner = gptr + ((wide(b) * g_sh + h) * lq + m0) * lk + n0  # int64 throughout
        tl.store(tile(corner, offs_m - m0, offs_n - n0, lk, 1), grad, mask=inside)


@triton.jit
def dropout_keep(seed, offset, bh, offs_m, offs_n, lk, dropout_p):
    """Bool (BLOCK_M, BLOCK_N): keep entry (i, j) of head bh. Counter-based, so the backward
    kernels regenerate exactly the forward pass's mask. `seed`: the int64 loaded from the seed
    tensor (never read on the host)."""
    # i Lk + j is exact in 32 bits: the launcher refuses dropout where Lq Lk >= 2^32
    c0 = offs_m[:, None].to(tl.uint32) * tl.to_tensor(lk).to(tl.uint32) + offs_n[None, :].to(
        tl.uint32
    )
    c1 = tl.to_tensor(bh).to(tl.uint32)
    c2 = tl.to_tensor(offset).to(tl.uint32)
    r0, _, _, _ = tl.philox(seed, c0, c1, c2, tl.to_tensor(0).to(tl.uint32))
    return tl.uint_to_uniform_float(r0) >= dropout_p


@triton.jit
def weights(s, keep, stat, NORM: tl.constexpr):
    """Backward recomputation: normalised weights of a tile from the saved row statistic.
    Returns (P, relu(s) for relu2 else P)."""
    if NORM == SOFTMAX or NORM == L2:
        p = tl.where(keep, tl.exp(s - stat[:, None]), 0.0)  # stat = +inf on empty rows: 0
        r = p
    elif NORM == EXP:
        p = tl.where(keep, tl.exp(s), 0.0)
        r = p
    else:
        r = tl.where(keep, tl.maximum(s, 0.0), 0.0)
        p = r * r / stat[:, None]
    return p, r
