"""The fused backend: the blockwise kernel behind a custom op, in flash-attention's three layers.

1. Raw ops on tensors and scalars, `urpe::fused_attention_forward` and `..._backward`, registered
   with `torch.library.custom_op`. Each has a fake (meta) implementation, so `torch.compile`
   traces through the call without a graph break, and a vmap rule that folds the vmapped dim into
   the batch dim (it loops over the vmapped dim where folding would be wrong: batched tables,
   per-example table gradients, dropout). The bodies run eagerly, so the kernel's host syncs
   (which key blocks hold padding, the dropout seed) are fine inside them.
2. `FusedAttention`, an `autograd.Function` with `setup_context` around the forward op, whose
   backward calls the backward op: `torch.func.grad`, `vmap` and `functional_call` compose with it.
   (A `register_autograd` formula on the op itself is not enough here: torch.func transforms
   refuse the autograd.Function it generates.)
3. `fused_run(spec)`, the backend, and `fused_attention(...)`, the public call with tile sizes.

Higher-order gradients are not implemented: differentiating the backward raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .blockwise import BLOCK_K, BLOCK_Q, _Call, blockwise_backward, blockwise_forward
from .execute import execute
from .reference import draw_seed
from .spec import AttentionSpec, resolve
from .tables import PositionTerm, Relation, Toeplitz

TABLE_KINDS = ("toeplitz", "relation")
_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


# ---------------------------------------------------------------------------------------------
# 1. Raw ops


@torch.library.custom_op("urpe::fused_attention_forward", mutates_args=())
def fused_forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    bias_index: Tensor | None,
    gate: Tensor | None,
    gate_index: Tensor | None,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    seed: Tensor | None,
    bias_kind: str,
    gate_kind: str,
    is_causal: bool,
    normalization: str,
    scale: float,
    dropout_p: float,
    block_q: int,
    block_k: int,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, Dv) in the compute dtype, row statistic (B, H, Lq, 1))."""
    call = _Call(q, k, v, bias, bias_index, bias_kind, gate, gate_index, gate_kind, attn_mask,
                 key_padding_mask, is_causal, normalization, scale, dropout_p, seed, block_q,
                 block_k)  # fmt: skip
    return blockwise_forward(call)


@fused_forward_op.register_fake
def _(q, k, v, bias, bias_index, gate, gate_index, attn_mask, key_padding_mask, seed, *scalars):
    b, h, lq, _ = q.shape
    dtype = _compute_dtype(q.dtype)
    return q.new_empty(b, h, lq, v.shape[-1], dtype=dtype), q.new_empty(b, h, lq, 1, dtype=dtype)


@torch.library.custom_op("urpe::fused_attention_backward", mutates_args=())
def fused_backward_op(
    grad_out: Tensor,
    out: Tensor,
    stat: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    bias_index: Tensor | None,
    gate: Tensor | None,
    gate_index: Tensor | None,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    seed: Tensor | None,
    bias_kind: str,
    gate_kind: str,
    is_causal: bool,
    normalization: str,
    scale: float,
    dropout_p: float,
    block_q: int,
    block_k: int,
    needs_bias: bool,
    needs_gate: bool,
    needs_mask: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d bias, d gate, d float attn_mask); a gradient not asked for is empty (0,)."""
    call = _Call(q, k, v, bias, bias_index, bias_kind, gate, gate_index, gate_kind, attn_mask,
                 key_padding_mask, is_causal, normalization, scale, dropout_p, seed, block_q,
                 block_k)  # fmt: skip
    needs = (needs_bias, needs_gate, needs_mask)
    grads = blockwise_backward(call, grad_out, out, stat, needs)
    inputs = (q, k, v, bias, gate, attn_mask)
    return tuple(
        q.new_empty(0) if g is None else _strided_like(g, t)
        for g, t in zip(grads, inputs, strict=True)
    )


def _strided_like(grad: Tensor, like: Tensor) -> Tensor:
    """grad with the strides `empty_like(like)` has, as the fake implementation promises them
    (compiled graphs view the gradients under those strides)."""
    if grad.stride() == torch.empty_like(like, device="meta").stride():
        return grad
    return torch.empty_like(like).copy_(grad)


@fused_backward_op.register_fake
def _(grad_out, out, stat, q, k, v, bias, bias_index, gate, gate_index, attn_mask,
      key_padding_mask, seed, *scalars):  # fmt: skip
    needs = scalars[-3:]
    terms = (bias, gate, attn_mask)
    extra = (
        torch.empty_like(t) if w else q.new_empty(0) for t, w in zip(terms, needs, strict=True)
    )
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *extra)


# vmap rules ---------------------------------------------------------------------------------

# positions of the tensor arguments whose dim 0 is the batch (B, or 1 to broadcast)
_FWD_BATCHED = {"q": 0, "k": 1, "v": 2, "bias": 3, "bias_index": 4, "gate": 5, "gate_index": 6,
                "attn_mask": 7, "key_padding_mask": 8}  # fmt: skip


def _moved(t: Tensor | None, dim: int | None) -> Tensor | None:
    return t if t is None or dim is None else t.movedim(dim, 0)


def _fold(t: Tensor | None, dim: int | None, size: int, batch: int, full: bool) -> Tensor | None:
    """Merge the vmapped dim (size `size`, at `dim`) into dim 0 (B or 1) -> (size * B, ...).

    An unbatched tensor with B rows is repeated; one with 1 row keeps broadcasting unless `full`.
    """
    if t is None:
        return None
    if dim is None:
        if t.shape[0] == 1 and not full:
            return t
        t = t.expand(size, *t.shape)
    else:
        t = t.movedim(dim, 0)
    if t.shape[1] != batch:  # 1 -> B
        t = t.expand(size, batch, *t.shape[2:])
    return t.reshape(size * batch, *t.shape[2:])


def _slice(t, dim, i):
    # (zip(tensors, in_dims) stops at the tensors: in_dims also covers the scalars)
    return t if t is None or dim is None else t.select(dim, i)


def _must_loop(in_dims, kinds: tuple[str, str], at: tuple[int, int, int], dropout_p) -> bool:
    """Folding is wrong for per-example tables and for dropout (the masks of a folded batch
    differ from those of its examples); loop then. at: positions of bias, gate and seed."""
    bias_at, gate_at, seed_at = at
    if dropout_p > 0.0 or in_dims[seed_at] is not None:
        return True
    return (kinds[0] in TABLE_KINDS and in_dims[bias_at] is not None) or (
        kinds[1] in TABLE_KINDS and in_dims[gate_at] is not None
    )


@fused_forward_op.register_vmap
def _(info, in_dims, *args):
    size = info.batch_size
    tensors, scalars = args[:10], args[10:]
    bias_kind, gate_kind, dropout_p = scalars[0], scalars[1], scalars[5]
    if _must_loop(in_dims, (bias_kind, gate_kind), (3, 5, 9), dropout_p):
        results = [
            fused_forward_op(
                *(_slice(t, d, i) for t, d in zip(tensors, in_dims, strict=False)), *scalars
            )
            for i in range(size)
        ]
        return (torch.stack([r[0] for r in results]), torch.stack([r[1] for r in results])), (0, 0)
    batch = _moved(args[0], in_dims[0]).shape[-4]
    folded = list(tensors)
    for name, pos in _FWD_BATCHED.items():
        table = name in ("bias", "gate") and (bias_kind if name == "bias" else gate_kind) in (
            TABLE_KINDS
        )
        if not table:
            folded[pos] = _fold(tensors[pos], in_dims[pos], size, batch, full=pos < 3)
    out, stat = fused_forward_op(*folded, *scalars)
    return (out.view(size, batch, *out.shape[1:]), stat.view(size, batch, *stat.shape[1:])), (0, 0)


@fused_backward_op.register_vmap
def _(info, in_dims, *args):
    size = info.batch_size
    tensors, scalars = args[:13], args[13:]
    bias_kind, gate_kind, dropout_p = scalars[0], scalars[1], scalars[5]
    needs = scalars[-3:]
    table_grads = (bias_kind in TABLE_KINDS and needs[0]) or (gate_kind in TABLE_KINDS and needs[1])
    # argument positions: grad_out 0, out 1, stat 2, then the forward's tensors shifted by 3
    if table_grads or _must_loop(in_dims, (bias_kind, gate_kind), (6, 8, 12), dropout_p):
        results = [
            fused_backward_op(
                *(_slice(t, d, i) for t, d in zip(tensors, in_dims, strict=False)), *scalars
            )
            for i in range(size)
        ]
        return tuple(torch.stack(g) for g in zip(*results, strict=True)), (0,) * 6
    batch = _moved(args[3], in_dims[3]).shape[-4]
    folded = list(tensors)
    for pos in range(12):
        name = ("grad_out", "out", "stat", *_FWD_BATCHED)[pos]
        kind = {"bias": bias_kind, "gate": gate_kind}.get(name)
        if kind in TABLE_KINDS:
            continue
        # a dense term whose gradient is wanted gets one gradient per example: fold it in full
        wants_grad = (
            (name == "bias" and needs[0])
            or (name == "gate" and needs[1])
            or (name == "attn_mask" and needs[2])
        )
        folded[pos] = _fold(tensors[pos], in_dims[pos], size, batch, full=pos < 6 or wants_grad)
    grads = fused_backward_op(*folded, *scalars)
    out, dims = [], []
    for i, g in enumerate(grads):
        if i >= 3 and g.numel() == 0 and not needs[i - 3]:
            out.append(g)
            dims.append(None)
            continue
        g = g.view(size, batch, *g.shape[1:])
        if i >= 3:  # back to the term's own leading size (1 if it broadcast over the batch)
            term, dim = tensors[(6, 8, 10)[i - 3]], in_dims[(6, 8, 10)[i - 3]]
            lead = term.shape[0] if dim is None else term.movedim(dim, 0).shape[1]
            if lead == 1 and batch != 1:
                g = g.sum(1, keepdim=True)
        out.append(g)
        dims.append(0)
    return tuple(out), tuple(dims)


# ---------------------------------------------------------------------------------------------
# 2. Autograd


class FusedAttention(torch.autograd.Function):
    """Differentiable in q, k, v, the bias and gate tensors (dense or table) and a float mask."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, bias, bias_index, gate, gate_index, attn_mask, key_padding_mask, seed,
                bias_kind, gate_kind, is_causal, normalization, scale, dropout_p, block_q,
                block_k):  # fmt: skip
        # explicit parameters (no *args): torch.compile recognises the setup_context form by them
        return fused_forward_op(q, k, v, bias, bias_index, gate, gate_index, attn_mask,
                                key_padding_mask, seed, bias_kind, gate_kind, is_causal,
                                normalization, scale, dropout_p, block_q, block_k)  # fmt: skip

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        out, stat = output
        ctx.mark_non_differentiable(stat)
        ctx.save_for_backward(out, stat, *inputs[:10])
        ctx.scalars = inputs[10:]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_stat):
        out, stat, q, k, v, bias, bias_index, gate, gate_index, attn_mask, padding, seed = (
            ctx.saved_tensors
        )
        needs = ctx.needs_input_grad
        grads = fused_backward_op(
            grad_out.contiguous(), out, stat, q, k, v, bias, bias_index, gate, gate_index,
            attn_mask, padding, seed, *ctx.scalars, needs[3], needs[5], needs[7],
        )  # fmt: skip
        dq, dk, dv, dbias, dgate, dmask = grads
        return (
            dq, dk, dv,
            dbias if needs[3] else None, None,
            dgate if needs[5] else None, None,
            dmask if needs[7] else None, None, None,
            *(None for _ in ctx.scalars),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 3. The backend and the public call


def _term_arguments(term: PositionTerm | None) -> tuple[Tensor | None, Tensor | None, str]:
    if term is None:
        return None, None, "none"
    if isinstance(term, Toeplitz):
        return term.table, None, "toeplitz"
    if isinstance(term, Relation):
        return term.table, term.index, "relation"
    return term, None, "dense"


def fused_run(spec: AttentionSpec, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> Tensor:
    """The fused backend: (B, H, Lq, Dv) in q's dtype."""
    bias, bias_index, bias_kind = _term_arguments(spec.bias)
    gate, gate_index, gate_kind = _term_arguments(spec.gate)
    seed = spec.dropout_seed
    if spec.dropout_p > 0.0 and seed is None:
        seed = draw_seed(spec.q.device)  # a tensor: no .item() on the traced side
    out, _ = FusedAttention.apply(
        spec.q, spec.k, spec.v, bias, bias_index, gate, gate_index, spec.attn_mask,
        spec.key_padding_mask, seed, bias_kind, gate_kind, spec.is_causal, spec.normalization,
        spec.scale, spec.dropout_p, int(block_q), int(block_k),
    )  # fmt: skip
    return out.to(spec.q.dtype)


def fused_unsupported(spec: AttentionSpec) -> str | None:
    """The fused kernel runs every call that `urpe.attention` accepts."""
    return None


def fused_defers(spec: AttentionSpec) -> str | None:
    """Why "auto" should hand this call to a later backend: plain softmax without bias or gate,
    where PyTorch's own fused SDPA kernel is faster."""
    if spec.gate is None and spec.bias is None and spec.normalization == "softmax":
        return "plain softmax attention: SDPA is faster"
    return None


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    seed: int | Tensor | None = None,
    **kwargs,
) -> Tensor:
    """`urpe.attention(q, k, v, **kwargs, backend="fused")` with chosen tile sizes.

    block_q, block_k: tile size (queries x keys). seed: the dropout seed (`dropout_seed`); by
    default one is drawn from torch's generator, so `torch.manual_seed` reproduces the masks.
    """
    if seed is not None:
        kwargs["dropout_seed"] = seed
    if int(block_q) < 1 or int(block_k) < 1:
        raise ValueError(f"block_q and block_k must be >= 1, got {block_q}, {block_k}")
    spec = resolve(q, k, v, **kwargs)
    return execute(lambda s: fused_run(s, block_q, block_k), spec)
