"""Fused URPE attention: blockwise, never holding an (Lq, Lk) matrix per head.

Same maths as `reference_attention` (the specification), computed one tile of bq queries x bk keys
at a time with the FlashAttention recurrence. URPE fits it exactly: the row normaliser is the plain
softmax sum, and the gate C only weights what is accumulated into the output,

    m_i = max_j s_ij,  l_i = sum_j exp(s_ij - m_i),  out_i = sum_j exp(s_ij - m_i) c_ij v_j / l_i,

with m, l and the output rescaled online as key blocks arrive. The backward pass recomputes each
tile from the saved row statistic r_i (a_ij = exp(s_ij - r_i)); with A = P * C and dropout keep
mask D (scaled by 1 / (1 - p)):

    dA = D * (dO V^T),  dV += (D * A)^T dO,  dC = dA * P,  dP = dA * C,
    softmax: dS = P * (dP - delta),  delta_i = rowsum(dO * O) = sum_j P_ij dP_ij,
    l2:      dS = P * (dP - P * delta)   (a = exp(s - r), r = log(sum exp(2 s)) / 2),
    exp:     dS = P * dP,
    relu2:   dS = dP * 2 relu(s) / n,
    dQ += scale * dS K,  dK += dS^T (scale * Q),  bias gradient += dS.

Keys are stored in reversed order so that Toeplitz tiles are strided views (see `fused_terms`).
Causal masking skips the keys no query of a block can see; only the first key block of each
query block is partly masked. Dropout draws its keep mask from a generator seeded per tile, so the
backward pass regenerates exactly the mask the forward pass used. Half precision is computed in
float32. Pure PyTorch ops: runs wherever PyTorch does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .fused_terms import DenseTile, RelationTile, ToeplitzTile, hankel_view, term_reader
from .tables import PositionTerm, Relation, Toeplitz

# Chosen by measurement on a 2-core AVX-512 CPU (see BENCHMARKS.md): tiles of 128 queries
# against up to 2048 keys keep Python overhead small while a tile stays a few MB per head.
BLOCK_Q = 128
BLOCK_K = 2048

Reader = DenseTile | ToeplitzTile | RelationTile


@dataclass
class _Plan:
    """Everything about a call that is not a differentiable tensor."""

    batch: int
    heads: int
    lq: int
    lk: int
    scale: float
    normalization: str
    is_causal: bool
    key_padding_mask: Tensor | None  # (B, Lk), reversed key order
    padded_prefix: list[int] | None  # padded_prefix[c]: reversed columns < c padded in any row
    dropout_p: float
    seed: int
    block_q: int
    block_k: int
    compute_dtype: torch.dtype
    device: torch.device


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
    """(query block, key block) pairs: yields tile id, i0, i1, c0, c1, the causal threshold t and
    whether this is the query block's first key block.

    Causal: query i sees reversed column c iff i + c >= Lq - 1, so in a tile entry (r, s) is
    visible iff r + s >= t with t = Lq - 1 - i0 - c0 (everything visible when t <= 0).
    """
    n_kblocks = -(-plan.lk // plan.block_k) + 1
    for qi, i0 in enumerate(range(0, plan.lq, plan.block_q)):
        i1 = min(i0 + plan.block_q, plan.lq)
        start = max(0, plan.lq - i1) if plan.is_causal else 0
        for kj, c0 in enumerate(range(start, plan.lk, plan.block_k)):
            c1 = min(c0 + plan.block_k, plan.lk)
            t = plan.lq - 1 - i0 - c0 if plan.is_causal else 0
            yield qi * n_kblocks + kj, i0, i1, c0, c1, t, kj == 0


def _masked_entries(plan: _Plan, i0: int, i1: int, c0: int, c1: int, t: int) -> Tensor | None:
    """Bool (B or 1, 1, bq, bk), True where the key is hidden; None when the tile is all visible."""
    masked = None
    if t > 0:
        m = torch.arange(i1 - i0 + c1 - c0 - 1, device=plan.device)
        masked = hankel_view(m < t, i1 - i0, c1 - c0)[None, None]
    if plan.padded_prefix is not None and plan.padded_prefix[c1] > plan.padded_prefix[c0]:
        padded = plan.key_padding_mask[:, None, None, c0:c1]
        masked = padded if masked is None else masked | padded
    return masked


def _dropout_keep(plan: _Plan, tile_id: int, keep: Tensor) -> Tensor:
    """Fill `keep` with the tile's keep mask scaled by 1 / (1 - p); a tile id always gives the
    same mask."""
    generator = torch.Generator(device=keep.device)
    generator.manual_seed((plan.seed + 1_000_003 * tile_id) % (2**63))
    keep.bernoulli_(1.0 - plan.dropout_p, generator=generator)
    return keep.div_(1.0 - plan.dropout_p)


def _scores(plan, q_tile, k_blk, bias, i0, i1, c0, c1, masked, out: Tensor) -> Tensor:
    """s = scale q k^T + B for one tile, hidden keys at -inf (0 for relu2), written into `out`
    (B*H, bq, bk); returned as (B, H, bq, bk)."""
    s = torch.bmm(q_tile, k_blk.transpose(1, 2), out=out)
    s = s.view(plan.batch, plan.heads, i1 - i0, c1 - c0)
    if bias is not None:
        s.add_(bias.tile(i0, i1, c0, c1))
    if masked is not None:
        s.masked_fill_(masked, 0.0 if plan.normalization == "relu2" else float("-inf"))
    return s


def _key_counts(plan: _Plan, device) -> Tensor:
    """n_i, the number of keys query i sees, as (B or 1, 1, Lq, 1) for relu2."""
    lq, lk = plan.lq, plan.lk
    if plan.key_padding_mask is None:
        unpadded = torch.ones(1, lk, device=device)
    else:  # back to the original key order
        unpadded = (~plan.key_padding_mask).flip(-1).to(plan.compute_dtype)
    if plan.is_causal:
        seen = torch.cat([torch.zeros_like(unpadded[:, :1]), unpadded.cumsum(-1)], dim=-1)
        pos = (torch.arange(lq, device=device) + lk - lq + 1).clamp(0, lk)  # keys j <= pos(i)
        counts = seen[:, pos]
    else:
        counts = unpadded.sum(-1, keepdim=True).expand(-1, lq)
    return counts.to(plan.compute_dtype)[:, None, :, None]


def _single_block(plan: _Plan, i0: int, i1: int) -> bool:
    """Whether query block [i0, i1) meets all its keys in one tile. Softmax then runs as one
    fused `torch.softmax` instead of the online recurrence, in both passes."""
    start = max(0, plan.lq - i1) if plan.is_causal else 0
    return plan.lk - start <= plan.block_k


def _accumulate(target: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """target = a @ b on the first call, target += a @ b after (batched)."""
    if first:
        torch.bmm(a, b, out=target)
    else:
        target.baddbmm_(a, b)


def _forward(plan: _Plan, q_s, k_r, v_r, bias, gate):
    """Output (B*H, Lq, Dv) and the row statistic r (B, H, Lq, 1) used by the backward pass."""
    b, h, n = plan.batch, plan.heads, plan.batch * plan.heads
    dtype, device = plan.compute_dtype, q_s.device
    out = torch.zeros(n, plan.lq, v_r.shape[-1], dtype=dtype, device=device)
    norm = plan.normalization
    running = norm in ("softmax", "l2")
    row_max = torch.full((b, h, plan.lq, 1), float("-inf"), dtype=dtype, device=device)
    row_sum = torch.zeros(b, h, plan.lq, 1, dtype=dtype, device=device)
    work = _Workspace(plan)
    for tile_id, i0, i1, c0, c1, t, first in _tiles(plan):
        bq, bk = i1 - i0, c1 - c0
        if first:  # contiguous operands keep the batched matmuls on their fast path
            q_tile = q_s[:, i0:i1].contiguous()
            acc = work("acc", n, bq, v_r.shape[-1])
            fused_softmax = norm == "softmax" and _single_block(plan, i0, i1)
        masked = _masked_entries(plan, i0, i1, c0, c1, t)
        s = _scores(plan, q_tile, k_r[:, c0:c1], bias, i0, i1, c0, c1, masked, work("s", n, bq, bk))
        if fused_softmax:  # already normalised; fully masked rows come out nan, zeroed below
            p = torch.softmax(s, -1, out=s)
            row_sum[:, :, i0:i1] = 1.0
            if masked is not None and gate is None:
                p.masked_fill_(masked, 0.0)
        elif running:
            m_old = row_max[:, :, i0:i1]
            m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
            shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = s.sub_(shift).exp_()
            if not first:  # rescale what earlier key blocks accumulated
                alpha = torch.exp(m_old - shift)  # m_old <= shift, or both -inf -> 0
                row_sum[:, :, i0:i1] *= alpha if norm == "softmax" else alpha.square()
                acc.mul_(alpha.view(n, bq, 1))
            row_sum[:, :, i0:i1] += (p if norm == "softmax" else p.square()).sum(-1, keepdim=True)
            row_max[:, :, i0:i1] = m_new
        elif norm == "exp":
            p = s.exp_()
        else:  # relu2; divided by n_i at the end
            p = s.relu_().square_()
        if gate is not None:
            p.mul_(gate.tile(i0, i1, c0, c1))
            if masked is not None:  # a gate may hold inf/nan far away: hidden keys stay 0
                p.masked_fill_(masked, 0.0)
        if plan.dropout_p > 0.0:
            p.mul_(_dropout_keep(plan, tile_id, work("keep", b, h, bq, bk)))
        _accumulate(acc, p.view(n, bq, bk), v_r[:, c0:c1], first)
        if c1 == plan.lk:  # the query block's last key block
            out[:, i0:i1] = acc
    if norm == "softmax":
        out.div_(torch.where(row_sum > 0, row_sum, 1.0).view(n, plan.lq, 1))
        stat = torch.where(row_sum > 0, row_max + row_sum.log(), float("inf"))
    elif norm == "l2":
        out.div_(torch.where(row_sum > 0, row_sum.sqrt(), 1.0).view(n, plan.lq, 1))
        stat = torch.where(row_sum > 0, row_max + 0.5 * row_sum.log(), float("inf"))
    elif norm == "exp":
        stat = row_max.new_zeros(())
    else:
        stat = _key_counts(plan, device).clamp_min(1)
        out.div_(stat.expand(b, h, plan.lq, 1).reshape(n, plan.lq, 1))
    return out, stat


def _backward(plan: _Plan, q_s, k_r, v_r, bias, gate, out, stat, grad_out):
    """Gradients for q (unscaled by `scale`), reversed k and reversed v; terms accumulate theirs."""
    b, h, n = plan.batch, plan.heads, plan.batch * plan.heads
    norm = plan.normalization
    dq = torch.zeros_like(q_s)
    dk = torch.zeros_like(k_r)
    dv = torch.zeros_like(v_r)
    delta = None
    if norm in ("softmax", "l2"):
        delta = (grad_out * out).sum(-1).view(b, h, plan.lq, 1)
    work = _Workspace(plan)
    for tile_id, i0, i1, c0, c1, t, first in _tiles(plan):
        bq, bk = i1 - i0, c1 - c0
        if first:
            q_tile = q_s[:, i0:i1].contiguous()
            do = grad_out[:, i0:i1].contiguous()  # (N, bq, Dv)
            dq_tile = work("dq", n, bq, q_s.shape[-1])
            fused_softmax = norm == "softmax" and _single_block(plan, i0, i1)
        k_blk, v_blk = k_r[:, c0:c1], v_r[:, c0:c1]
        masked = _masked_entries(plan, i0, i1, c0, c1, t)
        s = _scores(plan, q_tile, k_blk, bias, i0, i1, c0, c1, masked, work("s", n, bq, bk))
        rows = slice(None), slice(None), slice(i0, i1)
        if fused_softmax:
            p = torch.softmax(s, -1, out=s)
            if masked is not None:
                p.masked_fill_(masked, 0.0)  # fully masked rows: nan -> 0
        elif norm == "relu2":
            relu = s.relu_()
            p = torch.mul(relu, relu, out=work("p", b, h, bq, bk)).div_(stat[rows])
        else:
            p = s.sub_(stat[rows]).exp_() if norm != "exp" else s.exp_()
        da = torch.bmm(do, v_blk.transpose(1, 2), out=work("da", n, bq, bk))
        da = da.view(b, h, bq, bk)
        keep = None
        if plan.dropout_p > 0.0:
            keep = _dropout_keep(plan, tile_id, work("keep", b, h, bq, bk))
            da.mul_(keep)
        a, dp = p, da
        if gate is not None:
            c = gate.tile(i0, i1, c0, c1)
            a = torch.mul(p, c, out=work("a", b, h, bq, bk))
            if gate.grad is not None:
                gate.add_grad(i0, i1, c0, c1, torch.mul(da, p, out=work("dc", b, h, bq, bk)))
            dp = da.mul_(c)
            if masked is not None:  # a gate may hold inf/nan far away: hidden keys stay 0
                a.masked_fill_(masked, 0.0)
                dp.masked_fill_(masked, 0.0)
        if keep is not None:
            a = torch.mul(a, keep, out=work("a", b, h, bq, bk))
        _accumulate_keys(dv, c0, c1, a.view(n, bq, bk).transpose(1, 2), do, work)
        if norm == "softmax":
            ds = dp.sub_(delta[rows]).mul_(p)
        elif norm == "l2":
            ds = dp.addcmul_(p, delta[rows], value=-1.0).mul_(p)
        elif norm == "exp":
            ds = dp.mul_(p)
        else:
            ds = dp.mul_(relu).mul_(2.0 / stat[rows])
        if bias is not None and bias.grad is not None:
            bias.add_grad(i0, i1, c0, c1, ds)
        ds = ds.view(n, bq, bk)
        _accumulate(dq_tile, ds, k_blk, first)
        _accumulate_keys(dk, c0, c1, ds.transpose(1, 2), q_tile, work)
        if c1 == plan.lk:
            dq[:, i0:i1] = dq_tile
    return dq, dk, dv


def _accumulate_keys(target: Tensor, c0: int, c1: int, a: Tensor, b: Tensor, work) -> None:
    """target[:, c0:c1] += a @ b; through a contiguous buffer unless the slice is all of it."""
    if c0 == 0 and c1 == target.shape[1]:
        target.baddbmm_(a, b)
    else:
        target[:, c0:c1] += torch.bmm(a, b, out=work("keys", *a.shape[:2], b.shape[-1]))


class FusedAttentionFunction(torch.autograd.Function):
    """Autograd wrapper; the differentiable inputs are q, k, v and the bias and gate tensors."""

    @staticmethod
    def forward(ctx, plan, bias_term, gate_term, q, k, v, *term_tensors):
        b, h, lq, d = q.shape
        lk, dv_dim = k.shape[-2], v.shape[-1]
        dtype = plan.compute_dtype
        # (B*H, L, D) in the compute dtype; keys and values reversed (column c = key Lk-1-c)
        q_s = (q.to(dtype) * plan.scale).reshape(b * h, lq, d)
        k_r = k.to(dtype).flip(-2).reshape(b * h, lk, d)
        v_r = v.to(dtype).flip(-2).reshape(b * h, lk, dv_dim)
        grads_needed = ctx.needs_input_grad[6:]
        n_bias = 0 if bias_term is None else len(_tensors(bias_term))
        bias = term_reader(bias_term, lq, lk, dtype, needs_grad=any(grads_needed[:n_bias]))
        gate = term_reader(gate_term, lq, lk, dtype, needs_grad=any(grads_needed[n_bias:]))
        with torch.no_grad():
            out, stat = _forward(plan, q_s, k_r, v_r, bias, gate)
        ctx.plan, ctx.bias_term, ctx.gate_term = plan, bias_term, gate_term
        ctx.input_dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(q_s, k_r, v_r, out, stat)
        return out.view(b, h, lq, dv_dim).to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        plan = ctx.plan
        q_s, k_r, v_r, out, stat = ctx.saved_tensors
        b, h, lq, lk = plan.batch, plan.heads, plan.lq, plan.lk
        dtype = plan.compute_dtype
        grads_needed = ctx.needs_input_grad[6:]
        n_bias = 0 if ctx.bias_term is None else len(_tensors(ctx.bias_term))
        bias = term_reader(ctx.bias_term, lq, lk, dtype, needs_grad=any(grads_needed[:n_bias]))
        gate = term_reader(ctx.gate_term, lq, lk, dtype, needs_grad=any(grads_needed[n_bias:]))
        grad_out = grad_out.to(dtype).reshape(b * h, lq, -1)
        dq, dk, dv = _backward(plan, q_s, k_r, v_r, bias, gate, out, stat, grad_out)
        q_dtype, k_dtype, v_dtype = ctx.input_dtypes
        dq = (dq * plan.scale).view(b, h, lq, -1).to(q_dtype)
        dk = dk.view(b, h, lk, -1).flip(-2).to(k_dtype)
        dv = dv.view(b, h, lk, -1).flip(-2).to(v_dtype)
        term_grads = []
        for term, reader in ((ctx.bias_term, bias), (ctx.gate_term, gate)):
            if term is not None:
                tensors = _tensors(term)
                grad = None if reader.grad is None else reader.grads().to(tensors[0].dtype)
                term_grads += [grad] + [None] * (len(tensors) - 1)
        return (None, None, None, dq, dk, dv, *term_grads)


def _tensors(term: PositionTerm) -> tuple[Tensor, ...]:
    """The tensors of a term, its differentiable one first."""
    if isinstance(term, Toeplitz):
        return (term.table,)
    if isinstance(term, Relation):
        return (term.table, term.index)
    return (term,)


def fused_unsupported(**_unused) -> str | None:
    """Why the fused kernel cannot run this call, or None when it can (it runs every call that
    `urpe.attention` validates)."""
    return None


def fused_defers(
    *,
    bias: PositionTerm | None = None,
    gate: PositionTerm | None = None,
    normalization: str = "softmax",
    **_unused,
) -> str | None:
    """Why "auto" should hand this call to SDPA instead: plain softmax without bias or gate,
    where PyTorch's own fused kernel is faster."""
    if gate is None and bias is None and normalization == "softmax":
        return "plain softmax attention: SDPA is faster"
    return None


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias: PositionTerm | None = None,
    gate: PositionTerm | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    normalization: str = "softmax",
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    seed: int | None = None,
) -> Tensor:
    """Fused URPE attention; arguments and result as in `urpe.attention`.

    Extra arguments: block_q, block_k are the tile sizes (queries x keys); seed fixes the dropout
    masks (default: drawn from torch's global generator, so `torch.manual_seed` reproduces them).
    """
    b, h, lq, d = q.shape
    lk = k.shape[-2]
    dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    mask_r = padded_prefix = None
    if key_padding_mask is not None:
        mask_r = key_padding_mask.flip(-1)
        # one host sync per call: which key blocks hold any padding at all
        padded_any = mask_r.any(0).to(torch.int64).cumsum(0).tolist()
        padded_prefix = [0, *padded_any]
        if padded_prefix[-1] == 0:
            mask_r = padded_prefix = None
    if dropout_p > 0.0 and seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    plan = _Plan(
        batch=b,
        heads=h,
        lq=lq,
        lk=lk,
        scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        normalization=normalization,
        is_causal=is_causal,
        key_padding_mask=mask_r,
        padded_prefix=padded_prefix,
        dropout_p=float(dropout_p),
        seed=0 if seed is None else int(seed),
        block_q=int(block_q),
        block_k=int(block_k),
        compute_dtype=dtype,
        device=q.device,
    )
    term_tensors = [
        *(_tensors(bias) if bias is not None else ()),
        *(_tensors(gate) if gate is not None else ()),
    ]
    return FusedAttentionFunction.apply(plan, bias, gate, q, k, v, *term_tensors)
