"""The blockwise URPE kernel: never holds an (Lq, Lk) matrix per head.

Same maths as the reference (the specification), computed one tile of bq queries x bk keys at a
time with the FlashAttention recurrence. URPE fits it exactly: the row normaliser is the plain
softmax sum, and the gate C only weights what is accumulated into the output,

    m_i = max_j s_ij,  l_i = sum_j exp(s_ij - m_i),  out_i = sum_j exp(s_ij - m_i) c_ij v_j / l_i,

with m, l and the output rescaled online as key blocks arrive. What differs per normalisation
(the running statistic, the final division, the tile weights and the backward dS rule) is read
from its `Normalization` entry. The backward pass recomputes each tile from the saved row
statistic r_i; with A = P * C and dropout keep mask D (scaled by 1 / (1 - p)):

    dA = D * (dO V^T),  dV += (D * A)^T dO,  dC = dA * P,  dP = dA * C,
    dS = normalization.grad_logits(dP, P, ...),   (softmax: dS = P * (dP - delta),
                                                    delta_i = rowsum(dO * O) = sum_j P_ij dP_ij)
    dQ += scale * dS K,  dK += dS^T (scale * Q),  bias and float-mask gradients += dS.

Keys are stored in reversed order so that Toeplitz tiles are strided views (see `tiles`). Causal
masking skips the keys no query of a block can see; only the first key block of each query block
is partly masked. Documents (`document_ids`) are compared per tile, and a tile whose query and
key blocks share no document is skipped: per block the smallest and largest id, disjoint ranges
(exact for any ids; it skips most tiles when each document is one contiguous run). A `Decay`
bias is computed per tile from the O(L) cumulative sums (`tiles.DecayTile`). Dropout hashes each
weight's flat index with the seed, so the backward pass regenerates exactly the mask the forward
pass (and the reference) used. Half precision is computed in float32. Pure PyTorch ops.

The two entry points, `blockwise_forward` and `blockwise_backward`, take only tensors and scalars:
they are the bodies of the custom ops in `urpe.kernels.blockwise`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..dropout import dropout_scale_at, seed_placement
from ..dtypes import compute_dtype
from ..host import may_read
from ..layout import BackwardArgs, ForwardArgs
from ..masks import visible_key_counts
from ..normalization import NORMALIZATIONS, Normalization
from .inputs import document_fields, may_hold_neg_inf
from .tiles import DenseTile, hankel_view, tile_reader

# Chosen by measurement on a 2-core AVX-512 CPU (see BENCHMARKS.md): tiles of 128 queries
# against up to 2048 keys keep Python overhead small while a tile stays a few MB per head.
BLOCK_Q = 128
BLOCK_K = 2048

# Key tiles where documents are given: tiles as wide as the default would span many documents
# and skip little (a 128 x 2048 tile meets ~8 documents of 256 tokens).
DOCUMENT_BLOCK_K = 256

# The built-in normalisations whose weights are exponentials (never negative)
EXPONENTIAL = ("softmax", "exp", "l2")
DECAY_KINDS = ("decay", "cross_decay")


@dataclass
class _Plan:
    """Everything about a call that is not a differentiable tensor."""

    batch: int
    heads: int
    lq: int
    lk: int
    norm: Normalization
    is_causal: bool
    key_padding_mask: Tensor | None  # (B|1, Lk), reversed key order
    # padded_prefix[c]: reversed columns < c padded in any row (None: not read, any may be)
    padded_prefix: list[int] | None
    keep: DenseTile | None  # a boolean attn_mask, read per tile
    # documents: key ids (B|1, Lk) reversed, query ids (B|1, Lq), and which queries have one
    key_documents: Tensor | None
    query_documents: Tensor | None
    placed: Tensor | None  # (1, 1, Lq, 1) bool: pos(i) >= 0
    # shares[query block][key block]: whether the two blocks may share a document (None: all)
    shares: list[list[bool]] | None
    dropout_p: float
    seed: Tensor | None  # int64 scalar tensor (dropout only): never read on the host
    block_q: int
    block_k: int
    one_shot: (
        bool  # whether a query block that meets all its keys in one tile may use norm.one_shot
    )
    compute_dtype: torch.dtype
    device: torch.device
    # weights below the dtype's smallest normal number set to 0 (see `_flushed`)
    flush_below: float | None = None


class _Workspace:
    """Reused tile buffers. Allocating a fresh multi-MB tensor per tile costs page faults on CPU
    that take as long as the arithmetic; each named buffer is allocated once per call."""

    def __init__(self, plan: _Plan) -> None:
        self.capacity = plan.batch * plan.heads * min(plan.block_q, plan.lq)
        self.capacity *= min(plan.block_k, plan.lk)
        self.plan = plan
        self.buffers: dict[str, Tensor] = {}

    def __call__(self, name: str, *shape: int) -> Tensor:
        size = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(
                max(size, self.capacity), dtype=self.plan.compute_dtype, device=self.plan.device
            )
            self.buffers[name] = buffer
        return buffer[:size].view(shape)


def _tiles(plan: _Plan):
    """(query block, key block) pairs: yields i0, i1, c0, c1, the causal threshold t, and
    whether this is the query block's first and its last key block. Tiles that share no
    document with the query block are left out (`shares`, per aligned key block: a causal tile,
    from Lq - i1, may overlap two); a query block left with none meets no tile (output 0).

    Causal: query i sees reversed column c iff i + c >= Lq - 1, so in a tile entry (r, s) is
    visible iff r + s >= t with t = Lq - 1 - i0 - c0 (everything visible when t <= 0).
    """
    for i0 in range(0, plan.lq, plan.block_q):
        i1 = min(i0 + plan.block_q, plan.lq)
        starts = range(_first_column(plan, i1), plan.lk, plan.block_k)
        if plan.shares is not None:
            row, bk, last = plan.shares[i0 // plan.block_q], plan.block_k, plan.lk - 1
            starts = [c0 for c0 in starts if row[c0 // bk] or row[min(c0 + bk - 1, last) // bk]]
        for n, c0 in enumerate(starts):
            c1 = min(c0 + plan.block_k, plan.lk)
            t = plan.lq - 1 - i0 - c0 if plan.is_causal else 0
            yield i0, i1, c0, c1, t, n == 0, n == len(starts) - 1


def _first_column(plan: _Plan, i1: int) -> int:
    """The first reversed column any query of a block ending at i1 sees (causal skipping). A
    block that sees no key at all (Lq > Lk) meets no tile and keeps its zero output."""
    return max(0, plan.lq - i1) if plan.is_causal else 0


def _masked_entries(plan: _Plan, i0: int, i1: int, c0: int, c1: int, t: int) -> Tensor | None:
    """Bool broadcastable to (B, H, bq, bk), True where the pair is hidden; None if none is."""
    masked = None
    if t > 0:
        m = torch.arange(i1 - i0 + c1 - c0 - 1, device=plan.device)
        masked = hankel_view(m < t, i1 - i0, c1 - c0)[None, None]
    prefix = plan.padded_prefix  # None: not known which blocks hold padding (not read)
    if plan.key_padding_mask is not None and (prefix is None or prefix[c1] > prefix[c0]):
        padded = plan.key_padding_mask[:, None, None, c0:c1]
        masked = padded if masked is None else masked | padded
    if plan.keep is not None:
        hidden = ~plan.keep.tile(i0, i1, c0, c1)
        masked = hidden if masked is None else masked | hidden
    if plan.key_documents is not None:  # (B|1, 1, bq, bk): another document, or none at all
        queries = plan.query_documents[:, None, i0:i1, None]
        other = queries != plan.key_documents[:, None, None, c0:c1]
        other |= ~plan.placed[:, :, i0:i1]
        masked = other if masked is None else masked | other
    return masked


def _dropout_keep(plan: _Plan, i0: int, i1: int, c0: int, c1: int) -> Tensor:
    """The tile's keep mask scaled by 1 / (1 - p), (B, H, bq, bk): the reference's hash of the
    seed tensor and of each weight's flat index (b, h, i, j), placed where the seed tensor says
    (`dropout.seed_placement`): the reference's mask, the seed never read on the host."""
    seed, row0, n_rows, col0, n_cols = seed_placement(plan.seed, plan.lq, plan.lk)
    rows = torch.arange(i0, i1, device=plan.device) + row0
    keys = plan.lk - 1 - torch.arange(c0, c1, device=plan.device) + col0  # reversed columns
    heads = torch.arange(plan.batch * plan.heads, device=plan.device)
    counter = (heads.view(plan.batch, plan.heads, 1, 1) * n_rows + rows[:, None]) * n_cols
    return dropout_scale_at(seed, plan.dropout_p, counter + keys, plan.compute_dtype)


def _scores(plan, q_tile, k_blk, additive, i0, i1, c0, c1, masked, out: Tensor) -> Tensor:
    """s = scale q k^T + B + M for one tile, hidden pairs at the normalisation's hidden logit,
    written into `out` (B*H, bq, bk); returned as (B, H, bq, bk)."""
    s = torch.bmm(q_tile, k_blk.transpose(1, 2), out=out)
    s = s.view(plan.batch, plan.heads, i1 - i0, c1 - c0)
    for term in additive:
        s.add_(term.tile(i0, i1, c0, c1))
    if masked is not None:
        s.masked_fill_(masked, plan.norm.hidden_logit)
    return s


def _flushed(plan: _Plan, p: Tensor) -> Tensor:
    """p with weights below the smallest normal number set to 0, in place, where the plan asks.

    A decay bias pushes a band of each row's logits to where exp lands in float32's subnormal
    range (e^-87 .. e^-104), and a matrix product over subnormal operands runs many times
    slower on x86 (measured: 6x for the whole call). Such a weight is below 1.2e-38 of the row's
    largest: dropping it changes no result beyond rounding (the C++ kernel's exp flushes them
    too). Forward and backward flush alike, so the gradients stay those of the forward."""
    if plan.flush_below is not None:
        torch.nn.functional.threshold_(p, plan.flush_below, 0.0)
    return p


def _below_range(plan: _Plan, s: Tensor, shift: Tensor) -> Tensor:
    """s with the logits whose exp(s - shift) would be subnormal at -inf, where the plan
    flushes (`_flushed`): computing a subnormal exp costs about 20x a normal one."""
    if plan.flush_below is not None:
        s.masked_fill_(s < shift + math.log(plan.flush_below), float("-inf"))
    return s


def _single_block(plan: _Plan, i0: int, i1: int) -> bool:
    """Whether query block [i0, i1) meets all its keys in one tile. A normalisation with a
    `one_shot` form then runs it as one fused op instead of the online recurrence."""
    return plan.one_shot and plan.lk - _first_column(plan, i1) <= plan.block_k


def _accumulate(target: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """target = a @ b on the first call, target += a @ b after (batched)."""
    if first:
        torch.bmm(a, b, out=target)
    else:
        target.baddbmm_(a, b)


def _fixed_statistic(plan: _Plan, call: ForwardArgs) -> Tensor | None:
    """r_i for normalisations that know it before the first tile, as (B, H, Lq, 1)."""
    if plan.norm.fixed_statistic is None:
        return None
    attn_mask = call.attn_mask
    keep = attn_mask if attn_mask is not None and attn_mask.dtype == torch.bool else None
    counts = visible_key_counts(
        call.key_padding_mask,
        keep,
        plan.is_causal,
        plan.lq,
        plan.lk,
        device=plan.device,
        document_ids=call.document_ids,
    )  # (B|1, H|1, Lq), keys in their original order
    counts = counts.to(plan.compute_dtype)[..., None].expand(plan.batch, plan.heads, plan.lq, 1)
    return plan.norm.fixed_statistic(counts.contiguous())


def _forward(plan: _Plan, q_s, k_r, v_r, additive, gate, fixed):
    """Output (B*H, Lq, Dv) and the row statistic r (B, H, Lq, 1) used by the backward pass."""
    b, h, n = plan.batch, plan.heads, plan.batch * plan.heads
    dtype, device = plan.compute_dtype, q_s.device
    norm = plan.norm
    out = torch.zeros(n, plan.lq, v_r.shape[-1], dtype=dtype, device=device)
    power = norm.running_power
    row_max = torch.full((b, h, plan.lq, 1), float("-inf"), dtype=dtype, device=device)
    row_sum = torch.zeros(b, h, plan.lq, 1, dtype=dtype, device=device)
    work = _Workspace(plan)
    for i0, i1, c0, c1, t, first, last in _tiles(plan):
        bq, bk = i1 - i0, c1 - c0
        rows = slice(None), slice(None), slice(i0, i1)
        if first:  # contiguous operands keep the batched matmuls on their fast path
            q_tile = q_s[:, i0:i1].contiguous()
            acc = work("acc", n, bq, v_r.shape[-1])
            one_shot = _single_block(plan, i0, i1)
        masked = _masked_entries(plan, i0, i1, c0, c1, t)
        s = _scores(
            plan, q_tile, k_r[:, c0:c1], additive, i0, i1, c0, c1, masked, work("s", n, bq, bk)
        )
        if one_shot:  # already normalised; rows with nothing visible come out nan, zeroed below
            m = s.amax(-1, keepdim=True)
            p = _flushed(plan, norm.one_shot(s))
            # the row statistic all the same (the backward pass recomputes weights from it, and
            # context parallelism merges rows by it): the largest weight is exp(m_i - r_i)
            seen = torch.isfinite(m)
            row_max[rows] = torch.where(seen, m - p.amax(-1, keepdim=True).log(), m)
            row_sum[rows] = seen.to(dtype)  # 1: no division below; 0: r_i = inf (no key)
            if masked is not None and gate is None:
                p.masked_fill_(masked, 0.0)
        elif power is not None:  # online statistic: rescale what earlier key blocks gave
            m_old = row_max[rows]
            m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
            shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p, _ = norm.tile_weights(_below_range(plan, s, shift), shift)
            p = _flushed(plan, p)
            if not first:
                alpha = torch.exp(m_old - shift)  # m_old <= shift, or both -inf -> 0
                row_sum[rows] *= alpha if power == 1 else alpha.pow(power)
                acc.mul_(alpha.view(n, bq, 1))
            row_sum[rows] += (p if power == 1 else p.pow(power)).sum(-1, keepdim=True)
            row_max[rows] = m_new
        else:  # the statistic is known up front
            p, _ = norm.tile_weights(_below_range(plan, s, fixed[rows]), fixed[rows])
            p = _flushed(plan, p)
        if gate is not None:
            p.mul_(gate.tile(i0, i1, c0, c1))
            if masked is not None:  # a gate may hold inf/nan far away: hidden pairs stay 0
                p.masked_fill_(masked, 0.0)
        if plan.dropout_p > 0.0:
            p.mul_(_dropout_keep(plan, i0, i1, c0, c1))
        _accumulate(acc, p.view(n, bq, bk), v_r[:, c0:c1], first)
        if last:  # the query block's last key block
            out[:, i0:i1] = acc
    if power is None:
        return out, fixed
    out.div_(torch.where(row_sum > 0, row_sum.pow(1.0 / power), 1.0).view(n, plan.lq, 1))
    stat = torch.where(row_sum > 0, row_max + row_sum.log() / power, float("inf"))
    return out, stat


def _backward(plan: _Plan, q_s, k_r, v_r, additive, gate, out, stat, grad_out):
    """Gradients for q (unscaled by `scale`), reversed k and reversed v; terms accumulate theirs."""
    b, h, n = plan.batch, plan.heads, plan.batch * plan.heads
    norm = plan.norm
    dq = torch.zeros_like(q_s)
    dk = torch.zeros_like(k_r)
    dv = torch.zeros_like(v_r)
    delta = None
    if norm.needs_delta:
        delta = (grad_out * out).sum(-1).view(b, h, plan.lq, 1)
    additive_grads = [term for term in additive if term.grad is not None]
    work = _Workspace(plan)
    for i0, i1, c0, c1, t, first, last in _tiles(plan):
        bq, bk = i1 - i0, c1 - c0
        if first:
            q_tile = q_s[:, i0:i1].contiguous()
            do = grad_out[:, i0:i1].contiguous()  # (N, bq, Dv)
            dq_tile = work("dq", n, bq, q_s.shape[-1])
        k_blk, v_blk = k_r[:, c0:c1], v_r[:, c0:c1]
        masked = _masked_entries(plan, i0, i1, c0, c1, t)
        s = _scores(plan, q_tile, k_blk, additive, i0, i1, c0, c1, masked, work("s", n, bq, bk))
        rows = slice(None), slice(None), slice(i0, i1)
        # from the statistic r_i, which need not be this call's own: a caller that merged rows
        # (context parallelism) passes the whole row's
        p, aux = norm.tile_weights(_below_range(plan, s, stat[rows]), stat[rows])
        p = _flushed(plan, p)
        da = torch.bmm(do, v_blk.transpose(1, 2), out=work("da", n, bq, bk))
        da = da.view(b, h, bq, bk)
        keep = None
        if plan.dropout_p > 0.0:
            keep = _dropout_keep(plan, i0, i1, c0, c1)
            da.mul_(keep)
        a, dp = p, da
        if gate is not None:
            c = gate.tile(i0, i1, c0, c1)
            a = torch.mul(p, c, out=work("a", b, h, bq, bk))
            if gate.grad is not None:
                gate.add_grad(i0, i1, c0, c1, torch.mul(da, p, out=work("dc", b, h, bq, bk)))
            dp = da.mul_(c)
            if masked is not None:  # a gate may hold inf/nan far away: hidden pairs stay 0
                a.masked_fill_(masked, 0.0)
                dp.masked_fill_(masked, 0.0)
        if keep is not None:
            a = torch.mul(a, keep, out=work("a", b, h, bq, bk))
        _accumulate_keys(dv, c0, c1, a.view(n, bq, bk).transpose(1, 2), do, work)
        ds = norm.grad_logits(dp, p, aux, None if delta is None else delta[rows], stat[rows])
        for term in additive_grads:
            term.add_grad(i0, i1, c0, c1, ds)
        ds = ds.view(n, bq, bk)
        _accumulate(dq_tile, ds, k_blk, first)
        _accumulate_keys(dk, c0, c1, ds.transpose(1, 2), q_tile, work)
        if last:
            dq[:, i0:i1] = dq_tile
    return dq, dk, dv


def _accumulate_keys(target: Tensor, c0: int, c1: int, a: Tensor, b: Tensor, work) -> None:
    """target[:, c0:c1] += a @ b; through a contiguous buffer unless the slice is all of it."""
    if c0 == 0 and c1 == target.shape[1]:
        target.baddbmm_(a, b)
    else:
        target[:, c0:c1] += torch.bmm(a, b, out=work("keys", *a.shape[:2], b.shape[-1]))


# ---------------------------------------------------------------------------------------------
# Entry points on tensors and scalars (the bodies of the custom ops)


def _plan(call: ForwardArgs) -> tuple[_Plan, dict]:
    b, h, lq, _ = call.q.shape
    lk = call.k.shape[-2]
    dtype = compute_dtype(call.q.dtype)
    norm = NORMALIZATIONS[call.normalization]
    mask_r = padded_prefix = None
    if call.key_padding_mask is not None:  # (B|1, Lk|1): a key dim of 1 stands for every key
        mask_r = call.key_padding_mask.expand(-1, lk).flip(-1)
        if may_read(mask_r):  # which key blocks hold any padding at all (one read)
            padded_any = mask_r.any(0).to(torch.int64).cumsum(0).tolist()
            padded_prefix = [0, *padded_any]
            if padded_prefix[-1] == 0:
                mask_r = padded_prefix = None
    keep = None
    if call.attn_mask is not None and call.attn_mask.dtype == torch.bool:
        keep = DenseTile(call.attn_mask, lk, torch.bool, needs_grad=False)
    block_q = int(call.block_q) or BLOCK_Q  # 0: the default tiles
    block_k = int(call.block_k) or (BLOCK_K if call.document_ids is None else DOCUMENT_BLOCK_K)
    documents = document_fields(call.document_ids, lq, lk, block_q, block_k)
    plan = _Plan(
        batch=b,
        heads=h,
        lq=lq,
        lk=lk,
        norm=norm,
        is_causal=call.is_causal,
        key_padding_mask=mask_r,
        padded_prefix=padded_prefix,
        keep=keep,
        **documents,
        dropout_p=float(call.dropout_p),
        seed=call.dropout_seed,
        block_q=block_q,
        block_k=block_k,
        # (where values may not be read the online recurrence runs, which is always right)
        one_shot=norm.one_shot is not None
        and may_read(call.q)
        and not may_hold_neg_inf(call, dtype),
        compute_dtype=dtype,
        device=call.q.device,
        # only exponential weights (>= 0) under a decay bias, in float32 (half computes in it)
        flush_below=(
            torch.finfo(dtype).tiny
            if call.bias_kind in DECAY_KINDS and dtype == torch.float32 and norm.name in EXPONENTIAL
            else None
        ),
    )
    return plan, dict(groups=h // call.k.shape[1])


def _operands(call: ForwardArgs, plan: _Plan, groups: int):
    """(B*H, L, D) in the compute dtype; keys and values reversed (column c = key Lk-1-c) and
    repeated over query groups."""
    b, h, lq, d = call.q.shape
    dtype = plan.compute_dtype
    k, v = call.k, call.v
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q_s = (call.q.to(dtype) * call.scale).reshape(b * h, lq, d)
    k_r = k.to(dtype).flip(-2).reshape(b * h, plan.lk, d)
    v_r = v.to(dtype).flip(-2).reshape(b * h, plan.lk, v.shape[-1])
    return q_s, k_r, v_r


def _empty(call: ForwardArgs) -> bool:
    b, h, lq, _ = call.q.shape
    return b * h * lq * call.v.shape[-1] == 0 or call.k.shape[-2] == 0


def blockwise_forward(call: ForwardArgs) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, Dv) in the compute dtype, row statistic (B, H, Lq, 1))."""
    b, h, lq, _ = call.q.shape
    dtype = compute_dtype(call.q.dtype)
    if _empty(call):
        out = call.q.new_zeros(b, h, lq, call.v.shape[-1], dtype=dtype)
        return out, call.q.new_zeros(b, h, lq, 1, dtype=dtype)
    plan, info = _plan(call)
    q_s, k_r, v_r = _operands(call, plan, info["groups"])
    lk = plan.lk
    bias = tile_reader(call.term("bias"), lq, lk, dtype, False)
    mask = None
    if call.attn_mask is not None and call.attn_mask.dtype != torch.bool:
        mask = DenseTile(call.attn_mask, lk, dtype, False)
    gate = tile_reader(call.term("gate"), lq, lk, dtype, False)
    additive = [t for t in (bias, mask) if t is not None]
    fixed = _fixed_statistic(plan, call)
    out, stat = _forward(plan, q_s, k_r, v_r, additive, gate, fixed)
    return out.view(b, h, lq, -1), stat


def blockwise_backward(
    args: BackwardArgs,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients (dq, dk, dv, d bias tensor, d gate tensor, d float attn_mask); `args.needs` says
    which of the last three are wanted (None otherwise)."""
    call, grad_out, out, stat, needs = args.forward, args.grad_out, args.out, args.stat, args.needs
    b, h, lq, d = call.q.shape
    if _empty(call):
        grads = [torch.zeros_like(t) for t in (call.q, call.k, call.v)]
        terms = (call.bias, call.gate, call.attn_mask)
        return (
            *grads,
            *(torch.zeros_like(t) if w else None for t, w in zip(terms, needs, strict=True)),
        )
    plan, info = _plan(call)
    dtype, lk = plan.compute_dtype, plan.lk
    q_s, k_r, v_r = _operands(call, plan, info["groups"])
    bias = tile_reader(call.term("bias"), lq, lk, dtype, needs[0])
    gate = tile_reader(call.term("gate"), lq, lk, dtype, needs[1])
    mask = None
    if call.attn_mask is not None and call.attn_mask.dtype != torch.bool:
        mask = DenseTile(call.attn_mask, lk, dtype, needs[2])
    additive = [t for t in (bias, mask) if t is not None]
    grad_out = grad_out.to(dtype).reshape(b * h, lq, -1)
    out = out.reshape(b * h, lq, -1)
    dq, dk, dv = _backward(plan, q_s, k_r, v_r, additive, gate, out, stat, grad_out)
    dq = (dq * call.scale).view(b, h, lq, d).to(call.q.dtype)
    dk = dk.view(b, h, lk, d).flip(-2)
    dv = dv.view(b, h, lk, -1).flip(-2)
    groups = info["groups"]
    if groups > 1:  # a key/value head's gradient sums over the query heads that read it
        dk = dk.view(b, h // groups, groups, lk, d).sum(2)
        dv = dv.view(b, h // groups, groups, lk, -1).sum(2)
    term_grads = []
    for reader, tensor in ((bias, call.bias), (gate, call.gate), (mask, call.attn_mask)):
        grad = None if reader is None or reader.grad is None else reader.grads()
        term_grads.append(None if grad is None else grad.to(tensor.dtype))
    return (dq, dk.to(call.k.dtype), dv.to(call.v.dtype), *term_grads)
