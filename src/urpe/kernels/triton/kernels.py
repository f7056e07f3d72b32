"""The Triton programs behind `urpe.kernels.triton`: forward, dK/dV and dQ kernels.

FlashAttention-2 with URPE's gate. One program owns a block of BLOCK_M queries (forward, dQ) or
BLOCK_N keys (dK/dV) of one (batch, head) and walks the other axis tile by tile. Per tile, with
s the logits, P the normalised weights, C the gate, D the dropout keep mask (scaled by 1/(1-p)):

    forward (softmax)   m_i <- max(m_i, max_j s_ij),
                        l_i <- l_i e^(m_old - m_i) + sum_j e^(s_ij - m_i),
                        acc_i <- acc_i e^(m_old - m_i) + sum_j e^(s_ij - m_i) c_ij D_ij v_j,
                        out_i = acc_i / l_i,  stat_i = m_i + log l_i
    backward            P = e^(s - stat),  dA = D (dO V^T),  dV += (D P C)^T dO,
                        dC = dA P,  dP = dA C,  dS = P (dP - delta),  delta_i = dO_i . O_i,
                        dQ += scale dS K,  dK += scale dS^T Q,  dB = dS.

C multiplies only what goes into the accumulator: the normaliser l stays the plain softmax sum,
so URPE costs one multiply per score in the forward pass and a few in the backward pass.
The other normalisations follow the same recurrence ("l2": l_i sums e^(2(s - m)), stat =
m + log(l)/2, dS = P (dP - P delta); "exp": no normaliser, dS = P dP; "relu2": a = relu(s)^2 / n_i
with n_i the visible keys of row i, dS = 2 relu(s) dP / n_i).

Bias and gate are read per tile from their own storage, never as an (L, L) tensor: a Toeplitz
table by the clamped offset j - pos(i), a Relation table through its index tile, a dense term by
its (possibly zero, i.e. broadcast) strides. Their gradients are reduced per tile in registers
(a Toeplitz tile's anti-diagonals through one `tl.gather`, giving BLOCK_M + BLOCK_N - 1 sums) and
combined across tiles with float32 atomic adds; a dense term's gradient is stored, each entry
written once. See `urpe.kernels.triton` for why atomics (not deterministic).

A Decay bias is formed per tile from c = cumsum(log_forget) (B|1, H|1, Lk), computed once by
the launcher: b_ij = -|c_pos(i) - c_j|. Its gradient d c is a row sum of dB * sign (the queries'
share, dQ kernel) and a column sum (the keys' share, dK/dV kernel), each entry written once; the
launcher adds the two and takes the reversed cumulative sum (d log_forget).

Causal masking follows urpe's rule, query i sees key j <= i + Lk - Lq; tiles that no query of a
block can see are never visited. Key padding (one byte per key) and a boolean attn_mask (one byte
per pair, read through its strides, 0 where it broadcasts) hide pairs the same way: a hidden pair
has weight exactly 0 under every normalisation, and a row that sees nothing gives 0. Documents
arrive as spans (`ops._document_spans`, O(L) memory): for each key, the first key of its
document, and running bounds on the first and last keys of the documents around it. Two
positions share a document exactly when their first keys are equal (compared pair by pair,
whatever the order of the ids), and a block walks only the keys (dK/dV: queries) between the
bounds at its two ends: with packed (sorted) documents the tiles that cross none of the block's
documents are never visited; interleaved ids widen the span, never the result. Key padding
narrows the keys a block walks to those between the first and the last unpadded key (the spans'
rows 3 and 4), and a dK/dV block of padded keys walks no query: the tiles of a padded tail cost
nothing, and neither do those of queries whose documents hold padded keys only.
Dropout regenerates its keep mask from a counter-based Philox stream: counter (i Lk + j,
batch*heads index, offset), key = seed. Nothing here allocates memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (  # noqa: F401 - the codes are read by the launcher as K.<CODE>
    DECAY,
    DENSE,
    EXP,
    L2,
    NO_TERM,
    RELATION,
    RELU2,
    SOFTMAX,
    TOEPLITZ,
    any_unpadded,
    decay_at,
    decay_grad,
    document_span,
    dot,
    dropout_keep,
    origin,
    program,
    term_grad,
    term_tile,
    tile,
    unpadded_keys,
    visible,
    weights,
    wide,
)


@triton.jit(do_not_specialize=["offset"])  # the seed is read on the device
def dropout_mask_kernel(
    keep_ptr, seed_ptr, offset, lq, lk, heads, dropout_p, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Write the keep mask (B, H, Lq, Lk) that the attention kernels use (for tests)."""
    pid_m, bh = program(lq, BLOCK_M)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(tl.load(seed_ptr), offset, bh, offs_m, offs_n, lk, dropout_p)
    off = (bh.to(tl.int64) * lq + offs_m[:, None]) * lk + offs_n[None, :]
    tl.store(
        keep_ptr + off, keep.to(tl.uint8), mask=(offs_m[:, None] < lq) & (offs_n[None, :] < lk)
    )


@triton.jit(do_not_specialize=["rng_offset"])  # the seed is read on the device
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, stat_ptr, pad_ptr, mask_ptr, M_sb, M_sh, M_si, M_sj, span_ptr,
    B_ptr, B_idx, B_sb, B_sh, B_si, B_sj, B_K,
    C_ptr, C_idx, C_sb, C_sh, C_si, C_sj, C_K,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    heads, group, lq, lk, head_dim, value_dim, scale, dropout_p, seed_ptr, rng_offset,
    lq_bucket, lk_bucket,
    B_KIND: tl.constexpr, C_KIND: tl.constexpr, NORM: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, HAS_MASK: tl.constexpr, DOCS: tl.constexpr, DROPOUT: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M queries of one (batch, head) against all keys they may see."""
    pid_m, bh = program(lq, BLOCK_M)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    hk = h // group  # grouped-query attention: `group` query heads share a key/value head
    shift = lk - lq
    m0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_m = m0 + rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        tile(q_ptr + origin(b, sqb, h, sqh, m0, sqm, 0, 0), rows, offs_d, sqm, sqd),
        mask=(offs_m[:, None] < lq) & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    lo = 0
    hi = lk
    if CAUSAL:  # keys beyond the block's last query position are skipped, tile and all
        hi = tl.minimum(lk, (pid_m + 1) * BLOCK_M + shift)
    if B_KIND == DECAY:  # c at the queries' positions
        c_q = decay_at(B_ptr, B_sb, B_sh, b, h, offs_m + shift, lk)
    if DOCS:  # keys outside the span of the block's documents are skipped, tile and all
        first, last = document_span(span_ptr, b, m0 + shift, m0 + BLOCK_M - 1 + shift, lk)
        lo = first
        hi = tl.minimum(hi, last + 1)
    if HAS_PAD:  # and those before the first unpadded key or after the last
        lo, hi = unpadded_keys(span_ptr, b, lo, hi, lk)
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        offs_n = n0 + cols
        kt = tl.load(
            tile(k_base + wide(n0) * skn, offs_d, cols, skd, skn),
            mask=(offs_n[None, :] < lk) & (offs_d[:, None] < head_dim),
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        s = dot(q, kt, PRECISION, UPCAST).to(ACC) * scale
        inside = (offs_m[:, None] < lq) & (offs_n[None, :] < lk)
        keep = visible(
            offs_m, offs_n, m0, n0, b, h, lq, lk, shift, pad_ptr, mask_ptr, M_sb, M_sh, M_si, M_sj,
            span_ptr, CAUSAL, HAS_PAD, HAS_MASK, DOCS,
        )  # fmt: skip
        if B_KIND == DECAY:  # -|c_pos(i) - c_j|
            c_k = decay_at(B_ptr, B_sb, B_sh, b, h, offs_n, lk)
            s += -tl.abs(c_q[:, None] - c_k[None, :])
        elif B_KIND != NO_TERM:
            s += term_tile(
                B_KIND, B_ptr, B_idx, B_sb, B_sh, B_si, B_sj, B_K, b, h, offs_m, offs_n, m0, n0,
                shift, inside, ACC,
            )  # fmt: skip
        if NORM == SOFTMAX or NORM == L2:
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            if NORM == SOFTMAX:
                l_i = l_i * alpha + tl.sum(p, 1)
            else:
                l_i = l_i * alpha * alpha + tl.sum(p * p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        elif NORM == EXP:
            p = tl.where(keep, tl.exp(s), 0.0)
        else:  # relu2: l_i counts the visible keys
            r = tl.where(keep, tl.maximum(s, 0.0), 0.0)
            p = r * r
            l_i += tl.sum(keep.to(ACC), 1)
        if C_KIND != NO_TERM:
            c = term_tile(
                C_KIND, C_ptr, C_idx, C_sb, C_sh, C_si, C_sj, C_K, b, h, offs_m, offs_n, m0, n0,
                shift, inside, ACC,
            )  # fmt: skip
            p = tl.where(keep, p * c, 0.0)  # hidden keys stay 0 even where C is inf or nan
        if DROPOUT:
            drop_keep = dropout_keep(
                tl.load(seed_ptr), rng_offset, bh, offs_m, offs_n, lk, dropout_p
            )
            p = tl.where(drop_keep, p / (1.0 - dropout_p), 0.0)
        vt = tl.load(
            tile(v_base + wide(n0) * svn, cols, offs_dv, svn, svd),
            mask=(offs_n[:, None] < lk) & (offs_dv[None, :] < value_dim),
            other=0.0,
        )  # (BLOCK_N, BLOCK_DV)
        acc += dot(p.to(vt.dtype), vt, PRECISION, UPCAST).to(ACC)
    if NORM == SOFTMAX:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        stat = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    elif NORM == L2:
        out = acc / tl.where(l_i > 0, tl.sqrt(l_i), 1.0)[:, None]
        stat = tl.where(l_i > 0, m_i + 0.5 * tl.log(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    elif NORM == EXP:
        out = acc
        stat = l_i
    else:
        stat = tl.maximum(l_i, 1.0)
        out = acc / stat[:, None]
    o_corner = o_ptr + (wide(bh) * lq + m0) * value_dim
    tl.store(
        tile(o_corner, rows, offs_dv, value_dim, 1),
        out.to(o_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < lq) & (offs_dv[None, :] < value_dim),
    )
    tl.store(stat_ptr + wide(bh) * lq + offs_m, stat, mask=offs_m < lq)


@triton.jit(do_not_specialize=["rng_offset"])  # the seed is read on the device
def attention_bwd_kv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stat_ptr, delta_ptr, dk_ptr, dv_ptr,
    pad_ptr, mask_ptr, M_sb, M_sh, M_si, M_sj, span_ptr,
    B_ptr, B_idx, B_sb, B_sh, B_si, B_sj, B_K, dB_ptr,
    C_ptr, C_idx, C_sb, C_sh, C_si, C_sj, C_K,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    heads, group, lq, lk, head_dim, value_dim, scale, dropout_p, seed_ptr, rng_offset,
    lq_bucket, lk_bucket,
    B_KIND: tl.constexpr, C_KIND: tl.constexpr, NORM: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, HAS_MASK: tl.constexpr, DOCS: tl.constexpr, DROPOUT: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, B_GRAD: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N keys of one (batch, key/value head); walks every query of the heads
    that share them. Writes dK, dV (the table and dense term gradients are the dQ kernel's: it
    holds one accumulator where this one holds two, and the registers they need) and, for a
    Decay bias (B_GRAD = DECAY), the keys' share of d c (a vector per head: no atomics)."""
    pid_n, bhk = program(lk, BLOCK_N)
    kv_heads = heads // group
    b = (bhk // kv_heads).to(tl.int64)
    hk = (bhk % kv_heads).to(tl.int64)
    shift = lk - lq
    n0 = pid_n * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_n = n0 + cols
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kt = tl.load(
        tile(k_ptr + origin(b, skb, hk, skh, n0, skn, 0, 0), offs_d, cols, skd, skn),
        mask=(offs_n[None, :] < lk) & (offs_d[:, None] < head_dim),
        other=0.0,
    )  # (BLOCK_D, BLOCK_N)
    vt = tl.load(
        tile(v_ptr + origin(b, svb, hk, svh, n0, svn, 0, 0), offs_dv, cols, svd, svn),
        mask=(offs_n[None, :] < lk) & (offs_dv[:, None] < value_dim),
        other=0.0,
    )  # (BLOCK_DV, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], ACC)
    lo = 0
    hi = lq
    if CAUSAL:  # queries before n0 - shift see none of these keys
        lo = tl.maximum(n0 - shift, 0) // BLOCK_M * BLOCK_M
    if DOCS:  # queries outside the span of the keys' documents are skipped, tile and all
        first, last = document_span(span_ptr, b, n0, n0 + BLOCK_N - 1, lk)
        lo = tl.maximum(lo, tl.maximum(first - shift, 0) // BLOCK_M * BLOCK_M)
        hi = tl.minimum(hi, last + 1 - shift)
    if HAS_PAD:  # keys that are all padded are seen by no query
        hi = tl.where(any_unpadded(span_ptr, b, n0, n0 + BLOCK_N, lk), hi, 0)
    for g in range(0, group):
        h = hk * group + g
        bh = b * heads + h
        if B_KIND == DECAY:  # c at these keys, for this query head
            c_k = decay_at(B_ptr, B_sb, B_sh, b, h, offs_n, lk)
        if B_GRAD == DECAY:  # d c at these keys from this query head, summed over the queries
            dc = tl.zeros([BLOCK_N], ACC)
        for m0 in range(lo, hi, BLOCK_M):
            offs_m = m0 + rows
            row_ok = offs_m < lq
            q = tl.load(
                tile(q_ptr + origin(b, sqb, h, sqh, m0, sqm, 0, 0), rows, offs_d, sqm, sqd),
                mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
                other=0.0,
            )
            do = tl.load(
                tile(do_ptr + (bh * lq + m0) * value_dim, rows, offs_dv, value_dim, 1),
                mask=row_ok[:, None] & (offs_dv[None, :] < value_dim),
                other=0.0,
            )
            stat = tl.load(stat_ptr + bh * lq + offs_m, mask=row_ok, other=1.0)
            s = dot(q, kt, PRECISION, UPCAST).to(ACC) * scale
            inside = row_ok[:, None] & (offs_n[None, :] < lk)
            keep = visible(
                offs_m, offs_n, m0, n0, b, h, lq, lk, shift, pad_ptr, mask_ptr, M_sb, M_sh, M_si,
                M_sj, span_ptr, CAUSAL, HAS_PAD, HAS_MASK, DOCS,
            )  # fmt: skip
            if B_KIND == DECAY:
                c_q = decay_at(B_ptr, B_sb, B_sh, b, h, offs_m + shift, lk)
                s += -tl.abs(c_q[:, None] - c_k[None, :])
            elif B_KIND != NO_TERM:
                s += term_tile(
                    B_KIND, B_ptr, B_idx, B_sb, B_sh, B_si, B_sj, B_K, b, h, offs_m, offs_n,
                    m0, n0, shift, inside, ACC,
                )  # fmt: skip
            p, r = weights(s, keep, stat, NORM)
            da = dot(do, vt, PRECISION, UPCAST).to(ACC)  # dO V^T, (BLOCK_M, BLOCK_N)
            if DROPOUT:
                drop_keep = dropout_keep(
                    tl.load(seed_ptr), rng_offset, bh, offs_m, offs_n, lk, dropout_p
                )
                da = tl.where(drop_keep, da / (1.0 - dropout_p), 0.0)
            a = p
            dp = da
            if C_KIND != NO_TERM:
                c = term_tile(
                    C_KIND, C_ptr, C_idx, C_sb, C_sh, C_si, C_sj, C_K, b, h, offs_m, offs_n,
                    m0, n0, shift, inside, ACC,
                )  # fmt: skip
                a = tl.where(keep, p * c, 0.0)
                dp = tl.where(keep, da * c, 0.0)
            if DROPOUT:
                a = tl.where(drop_keep, a / (1.0 - dropout_p), 0.0)
            dv += dot(tl.trans(a).to(do.dtype), do, PRECISION, UPCAST).to(ACC)
            if NORM == SOFTMAX:
                delta = tl.load(delta_ptr + bh * lq + offs_m, mask=row_ok, other=0.0)
                ds = p * (dp - delta[:, None])
            elif NORM == L2:
                delta = tl.load(delta_ptr + bh * lq + offs_m, mask=row_ok, other=0.0)
                ds = p * (dp - p * delta[:, None])
            elif NORM == EXP:
                ds = p * dp
            else:
                ds = 2.0 * r * dp / stat[:, None]
            ds = tl.where(keep, ds, 0.0)
            if B_GRAD == DECAY:
                dc += decay_grad(ds, c_q, c_k)[1]
            dk += dot(tl.trans(ds).to(q.dtype), q, PRECISION, UPCAST).to(ACC)
        if B_GRAD == DECAY:  # (B, H, Lk), each entry written once
            tl.store(dB_ptr + bh * lk + offs_n, dc, mask=offs_n < lk)
    dk = dk * scale
    kv_mask = offs_n[:, None] < lk
    dk_corner = dk_ptr + (wide(bhk) * lk + n0) * head_dim
    tl.store(
        tile(dk_corner, cols, offs_d, head_dim, 1),
        dk.to(dk_ptr.dtype.element_ty),
        mask=kv_mask & (offs_d[None, :] < head_dim),
    )
    dv_corner = dv_ptr + (wide(bhk) * lk + n0) * value_dim
    tl.store(
        tile(dv_corner, cols, offs_dv, value_dim, 1),
        dv.to(dv_ptr.dtype.element_ty),
        mask=kv_mask & (offs_dv[None, :] < value_dim),
    )


@triton.jit(do_not_specialize=["rng_offset"])  # the seed is read on the device
def attention_bwd_q_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stat_ptr, delta_ptr, dq_ptr,
    pad_ptr, mask_ptr, M_sb, M_sh, M_si, M_sj, span_ptr,
    B_ptr, B_idx, B_sb, B_sh, B_si, B_sj, B_K, dB_ptr, dB_sh,
    C_ptr, C_idx, C_sb, C_sh, C_si, C_sj, C_K, dC_ptr, dC_sh,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    heads, group, lq, lk, head_dim, value_dim, scale, dropout_p, seed_ptr, rng_offset,
    lq_bucket, lk_bucket,
    B_KIND: tl.constexpr, C_KIND: tl.constexpr, NORM: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, HAS_MASK: tl.constexpr, DOCS: tl.constexpr, DROPOUT: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, B_GRAD: tl.constexpr, C_GRAD: tl.constexpr,
    WIDTH: tl.constexpr,
):  # fmt: skip
    """One program: dQ for BLOCK_M queries of one (batch, head), recomputing each tile; adds
    the bias and gate gradients. B_GRAD, C_GRAD: the kind of gradient buffer (NO_TERM: none
    wanted; DENSE for a table term in deterministic mode, reduced afterwards in a fixed order;
    DECAY: the queries' share of d c, (B, H, Lq), the keys' share being the dK/dV kernel's)."""
    pid_m, bh = program(lq, BLOCK_M)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    hk = h // group
    bh = bh.to(tl.int64)
    if DROPOUT:  # read once on the device (the launch never reads it on the host)
        seed = tl.load(seed_ptr)
    shift = lk - lq
    m0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_m = m0 + rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < lq
    q = tl.load(
        tile(q_ptr + origin(b, sqb, h, sqh, m0, sqm, 0, 0), rows, offs_d, sqm, sqd),
        mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    do = tl.load(
        tile(do_ptr + (bh * lq + m0) * value_dim, rows, offs_dv, value_dim, 1),
        mask=row_ok[:, None] & (offs_dv[None, :] < value_dim),
        other=0.0,
    )
    stat = tl.load(stat_ptr + bh * lq + offs_m, mask=row_ok, other=1.0)
    if NORM == SOFTMAX or NORM == L2:
        delta = tl.load(delta_ptr + bh * lq + offs_m, mask=row_ok, other=0.0)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    if B_GRAD == DECAY:  # d c at the queries' positions, summed over the keys
        dc = tl.zeros([BLOCK_M], ACC)
    lo = 0
    hi = lk
    if CAUSAL:
        hi = tl.minimum(lk, (pid_m + 1) * BLOCK_M + shift)
    if B_KIND == DECAY:
        c_q = decay_at(B_ptr, B_sb, B_sh, b, h, offs_m + shift, lk)
    if DOCS:
        first, last = document_span(span_ptr, b, m0 + shift, m0 + BLOCK_M - 1 + shift, lk)
        lo = first
        hi = tl.minimum(hi, last + 1)
    if HAS_PAD:
        lo, hi = unpadded_keys(span_ptr, b, lo, hi, lk)
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        offs_n = n0 + cols
        col_ok = offs_n < lk
        kt = tl.load(
            tile(k_base + wide(n0) * skn, offs_d, cols, skd, skn),
            mask=col_ok[None, :] & (offs_d[:, None] < head_dim),
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        vt = tl.load(
            tile(v_base + wide(n0) * svn, offs_dv, cols, svd, svn),
            mask=col_ok[None, :] & (offs_dv[:, None] < value_dim),
            other=0.0,
        )  # (BLOCK_DV, BLOCK_N)
        s = dot(q, kt, PRECISION, UPCAST).to(ACC) * scale
        inside = row_ok[:, None] & col_ok[None, :]
        keep = visible(
            offs_m, offs_n, m0, n0, b, h, lq, lk, shift, pad_ptr, mask_ptr, M_sb, M_sh, M_si, M_sj,
            span_ptr, CAUSAL, HAS_PAD, HAS_MASK, DOCS,
        )  # fmt: skip
        if B_KIND == DECAY:  # -|c_pos(i) - c_j|
            c_k = decay_at(B_ptr, B_sb, B_sh, b, h, offs_n, lk)
            s += -tl.abs(c_q[:, None] - c_k[None, :])
        elif B_KIND != NO_TERM:
            s += term_tile(
                B_KIND, B_ptr, B_idx, B_sb, B_sh, B_si, B_sj, B_K, b, h, offs_m, offs_n, m0, n0,
                shift, inside, ACC,
            )  # fmt: skip
        p, r = weights(s, keep, stat, NORM)
        dp = dot(do, vt, PRECISION, UPCAST).to(ACC)
        if DROPOUT:
            drop_keep = dropout_keep(seed, rng_offset, bh, offs_m, offs_n, lk, dropout_p)
            dp = tl.where(drop_keep, dp / (1.0 - dropout_p), 0.0)
        if C_KIND != NO_TERM:
            c = term_tile(
                C_KIND, C_ptr, C_idx, C_sb, C_sh, C_si, C_sj, C_K, b, h, offs_m, offs_n, m0, n0,
                shift, inside, ACC,
            )  # fmt: skip
            if C_GRAD != NO_TERM:
                term_grad(
                    C_GRAD, tl.where(keep, dp * p, 0.0), dC_ptr, dC_sh, C_idx, C_sb, C_si, C_sj,
                    C_K, b, h, offs_m, offs_n, m0, n0, shift, inside, lq, lk, BLOCK_M, BLOCK_N,
                    WIDTH,
                )  # fmt: skip
            dp = tl.where(keep, dp * c, 0.0)
        if NORM == SOFTMAX:
            ds = p * (dp - delta[:, None])
        elif NORM == L2:
            ds = p * (dp - p * delta[:, None])
        elif NORM == EXP:
            ds = p * dp
        else:
            ds = 2.0 * r * dp / stat[:, None]
        ds = tl.where(keep, ds, 0.0)
        if B_GRAD == DECAY:
            dc += decay_grad(ds, c_q, c_k)[0]
        elif B_GRAD != NO_TERM:
            term_grad(
                B_GRAD, ds, dB_ptr, dB_sh, B_idx, B_sb, B_si, B_sj, B_K, b, h, offs_m, offs_n,
                m0, n0, shift, inside, lq, lk, BLOCK_M, BLOCK_N, WIDTH,
            )  # fmt: skip
        k_tile = tl.trans(kt)  # (BLOCK_N, BLOCK_D)
        dq += dot(ds.to(k_tile.dtype), k_tile, PRECISION, UPCAST).to(ACC)
    if B_GRAD == DECAY:  # (B, H, Lq), each entry written once
        tl.store(dB_ptr + bh * lq + offs_m, dc, mask=row_ok)
    dq = dq * scale
    dq_corner = dq_ptr + (bh * lq + m0) * head_dim
    tl.store(
        tile(dq_corner, rows, offs_d, head_dim, 1),
        dq.to(dq_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
    )
