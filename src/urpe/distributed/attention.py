"""Ring attention: `context_parallel_attention`, URPE attention over a sequence split across
processes.

Each rank holds a shard of q, k, v (`layout`). Forward, the keys (with their padding, documents
and decay sums) go around the ring: at step s rank r holds rank (r - s)'s, runs the kernel on
each of its query chunks against each of those key chunks (`call.RingCall.pairs`), merges the
chunk results into its rows (`merge`), and passes the keys on while it computes (`ring`). After N
steps every query has met every key it may see; no rank ever holds more than two shards of keys.

Backward, the keys go around again. Each kernel call gets the pair's incoming gradient and the
merged out and statistic of the whole rows, so the gradients of one pair are exactly that
pair's share of the one-process gradients: dq accumulates where the queries live, and the keys'
dk, dv (and a decay's d c) accumulate in a buffer that travels with the keys and ends, after N
steps, at their owner. Table gradients (Toeplitz bias, gate) stay where they are computed: each
rank returns its part, and their sum over the group is the one-process gradient (module doc of
`urpe.distributed`: how DDP and FSDP reduce them).

A `Decay`'s c = cumsum(log_forget) runs over the global positions: each chunk adds the totals
of the chunks before it (an all-gather of one number per chunk and row), and its gradient,
d log_forget_s = sum over t >= s of d c_t, adds those of the chunks after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels import Decay
from ..kernels.dtypes import compute_dtype
from .call import RingCall, chunk_terms, plan_call
from .merge import RowMerge

KEYS, KEY_GRADIENTS = 0, 1  # the two streams of transfers (`ring`)


def _chunk_totals(x: Tensor, call: RingCall) -> tuple[list[Tensor], Tensor]:
    """Per chunk of this shard its slice of x (..., L), and the totals of every global chunk
    (chunks, ...), gathered from every rank."""
    parts = [x[..., s.rows] for s in call.segments]
    mine = torch.stack([p.sum(-1) for p in parts])  # (chunks held, ...)
    gathered = [torch.empty_like(mine) for _ in range(call.size)]
    dist.all_gather(gathered, mine.contiguous(), group=call.group)
    totals = torch.empty(call.split.chunks, *mine.shape[1:], dtype=x.dtype, device=x.device)
    for owner, sums in enumerate(gathered):
        for index, chunk in enumerate(call.split.chunks_of(owner)):
            totals[chunk] = sums[index]
    return parts, totals


def global_cumsum(x: Tensor, call: RingCall) -> Tensor:
    """cumsum along the global sequence of a shard x (..., L): this shard's part."""
    parts, totals = _chunk_totals(x, call)
    before = totals.cumsum(0) - totals  # (chunks, ...): the sum of the chunks before each
    out = torch.empty_like(x)
    for segment, part in zip(call.segments, parts, strict=True):
        chunk = segment.start // segment.length
        out[..., segment.rows] = part.cumsum(-1) + before[chunk][..., None]
    return out


def global_reverse_cumsum(x: Tensor, call: RingCall) -> Tensor:
    """out_s = sum over global t >= s of x_t, for a shard x (..., L): this shard's part."""
    parts, totals = _chunk_totals(x, call)
    after = totals.flip(0).cumsum(0).flip(0) - totals  # the sum of the chunks after each
    out = torch.empty_like(x)
    for segment, part in zip(call.segments, parts, strict=True):
        chunk = segment.start // segment.length
        out[..., segment.rows] = part.flip(-1).cumsum(-1).flip(-1) + after[chunk][..., None]
    return out


def _decay_cumulative(call: RingCall, log_forget: Tensor | None) -> Tensor | None:
    if not isinstance(call.spec.bias, Decay):
        return None
    return global_cumsum(log_forget.to(compute_dtype(log_forget.dtype)), call)


def ring_forward(call: RingCall, q: Tensor, k: Tensor, v: Tensor, terms, decay) -> tuple:
    """(out (B, H, L, Dv), r (B, H, L, 1)) of this rank's queries, in the compute dtype."""
    bias, gate = terms
    shape = (*q.shape[:3], v.shape[-1])
    merge = RowMerge(call.spec.normalization, shape, compute_dtype(q.dtype), q.device)
    keys = call.key_side(k, v, decay)
    for step in range(call.size):
        last = step == call.size - 1
        transfer = None if last else call.ring.pass_on(keys.tensors(), KEYS)
        for pair in call.pairs(call.owner_of(step), keys):
            args = call.arguments(pair, q, keys, bias, gate)
            out, stat = call.kernel.forward(args)
            counts = call.counts(args) if call.spec.normalization == "relu2" else None
            merge.add(pair.query.rows, out, stat, counts)
        if transfer is not None:
            keys = keys.replaced(transfer.wait())
    return merge.result()


def ring_backward(call: RingCall, grad_out, q, k, v, out, stat, terms, decay, needs) -> tuple:
    """(dq, dk, dv, the keys' d c or None) of this rank's shards, in the compute dtype; the
    terms accumulate their own gradients."""
    bias, gate = terms
    dtype = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    keys = call.key_side(k, v, decay)
    incoming = None
    for step in range(call.size):
        last = step == call.size - 1
        transfer = None if last else call.ring.pass_on(keys.tensors(), KEYS)
        grads = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (keys.k, keys.v)]
        if decay is not None and needs[0]:
            grads.append(torch.zeros_like(keys.decay))
        for pair in call.pairs(call.owner_of(step), keys):
            args = call.arguments(pair, q, keys, bias, gate)
            backward = call.backward_arguments(pair, args, grad_out, out, stat, needs)
            dq_c, dk_c, dv_c, dbias, dgate, _ = call.kernel.backward(backward)
            rows, cols = pair.query.rows, pair.key.rows
            dq[:, :, rows] += dq_c
            grads[0][:, :, cols] += dk_c
            grads[1][:, :, cols] += dv_c
            if dbias is not None:
                bias.add_grad(pair, dbias, grads[2] if len(grads) > 2 else None)
            if dgate is not None:
                gate.add_grad(pair, dgate, None)
        if incoming is not None:  # what earlier ranks added for these keys
            for mine, theirs in zip(grads, incoming.wait(), strict=True):
                mine += theirs
        incoming = call.ring.pass_on(grads, KEY_GRADIENTS)  # on towards the keys' owner
        if transfer is not None:
            keys = keys.replaced(transfer.wait())
    own = incoming.wait()  # this rank's keys' gradients, back from the last rank that used them
    return dq, own[0], own[1], own[2] if len(own) > 2 else None


class RingAttention(torch.autograd.Function):
    """Differentiable in q, k, v and the bias's and gate's tensors (a Toeplitz table, a Decay's
    log_forget, a dense term); `call` describes the rest."""

    @staticmethod
    def forward(ctx, call: RingCall, q, k, v, bias, gate):
        decay = _decay_cumulative(call, bias)
        terms = chunk_terms(call, decay, (False, False))
        out, stat = ring_forward(call, q, k, v, terms, decay)
        ctx.call, ctx.decay = call, decay
        ctx.save_for_backward(q, k, v, out, stat)
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        call = ctx.call
        q, k, v, out, stat = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[4:6])
        terms = chunk_terms(call, ctx.decay, needs)
        dq, dk, dv, dc_keys = ring_backward(
            call, grad_out, q, k, v, out, stat, terms, ctx.decay, needs
        )
        grads = []
        for term, tensor in zip(terms, (call.spec.bias, call.spec.gate), strict=True):
            grad = None if term is None else term.grad
            if grad is not None and isinstance(tensor, Decay):  # d c -> d log_forget
                grad = global_reverse_cumsum(grad + dc_keys, call).to(tensor.log_forget.dtype)
            grads.append(grad)
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *grads


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    backend: str = "auto",
    **kwargs,
) -> Tensor:
    """`urpe.attention` over a sequence split across the processes of `group` (ring attention).

    q (..., H, L/N, D), k, v (..., Hkv, L/N, D|Dv): this rank's shard of the global sequence
    (dim -2) in `layout` ("zigzag" or "contiguous", `urpe.distributed.shard`). kwargs are
    `urpe.attention`'s, over the global sequence: a `Toeplitz` bias or gate (offsets of global
    positions), a `Decay(log_forget)` with log_forget sharded like the sequence, document_ids
    and key_padding_mask sharded likewise, `is_causal`, `enable_gqa`, `scale`, every
    normalisation (softmax, exp, l2, relu2), dropout (with `dropout_seed`, or one drawn on
    rank 0 for all). A dense term that broadcasts over the keys (..., H|1, L/N|1, 1) is read
    per query; a dense (L, L) term, a Relation and attn_mask cannot be split and are refused.

    Returns this rank's shard (..., H, L/N, Dv) of exactly what one process computes on the
    global tensors. Gradients reach q, k, v, log_forget and the tables; a table's gradient is
    this rank's part (their sum over the group is the one-process gradient).

    backend: the kernel of the chunks, "auto" (the C++ kernel on CPUs, else "blockwise"),
    "cpp" or "blockwise". A collective: every rank of the group calls it with its shard.
    """
    call = plan_call(q, k, v, group, layout, backend, kwargs)
    spec = call.spec
    bias = None if spec.bias is None else spec.bias.raw()[0]
    gate = None if spec.gate is None else spec.gate.raw()[0]
    out = RingAttention.apply(call, spec.q, spec.k, spec.v, bias, gate)
    return out.reshape(*spec.batch_shape, *out.shape[1:])
