"""What makes a kernel behind a pair of custom ops compose with torch.func and torch.compile.

The fused (blockwise) and the Triton backends wrap their kernels in flash-attention's three
layers: raw ops on tensors and scalars, an `autograd.Function` around them, the public call. Both
pairs of raw ops share one signature, so the two middle pieces live here once:

    forward_op(q, k, v, bias, bias_index, gate, gate_index, attn_mask, key_padding_mask, seed,
               bias_kind, gate_kind, is_causal, normalization, scale, dropout_p, block_a, block_b)
        -> (out (B, H, Lq, Dv), row statistic (B, H, Lq, ...))
    backward_op(grad_out, out, stat, <the forward's ten tensors>, <its eight scalars>,
                needs_bias, needs_gate, needs_mask)
        -> (dq, dk, dv, d bias, d gate, d attn_mask); a gradient not asked for is empty (0,)

Every tensor argument except a table (bias or gate of kind "toeplitz" or "relation") and the
seed has the batch as dim 0, B or 1 (broadcast). Kinds are "none", "dense", "toeplitz" and
"relation"; the seed is None or an int64 scalar tensor (a tensor: no host sync where it is made).

- `register_vmap_rules(forward_op, backward_op)`: vmap folds the vmapped dim into the batch dim
  (one launch), and loops over it where folding would be wrong: batched tables, per-example table
  gradients, and dropout (the masks of a folded batch differ from those of its examples).
- `attention_function(forward_op, backward_op, name)`: the `autograd.Function` with
  `setup_context` whose backward calls the backward op. `torch.func.grad`, `vmap` and
  `functional_call` compose with it; a `register_autograd` formula on the op alone is not enough
  (torch.func refuses the autograd.Function that it generates).

Higher-order gradients are not implemented: differentiating the backward raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .tables import PositionTerm, Relation, Toeplitz

TABLE_KINDS = ("toeplitz", "relation")
# positions of the tensor arguments of the forward op whose dim 0 is the batch (B, or 1)
FORWARD_TENSORS = ("q", "k", "v", "bias", "bias_index", "gate", "gate_index", "attn_mask",
                   "key_padding_mask")  # fmt: skip
_SEED = 9  # the forward op's seed position; its ten tensors come first, then eight scalars
_N_TENSORS, _N_SCALARS = 10, 8


def term_arguments(term: PositionTerm | None) -> tuple[Tensor | None, Tensor | None, str]:
    """A bias or gate as the raw ops' (tensor, index, kind)."""
    if term is None:
        return None, None, "none"
    if isinstance(term, Toeplitz):
        return term.table, None, "toeplitz"
    if isinstance(term, Relation):
        return term.table, term.index, "relation"
    return term, None, "dense"


def strided_like(grad: Tensor, like: Tensor) -> Tensor:
    """grad with the strides `empty_like(like)` has, which is what a fake implementation that
    returns `empty_like` promises (compiled graphs view the gradients under those strides)."""
    if grad.stride() == torch.empty_like(like, device="meta").stride():
        return grad
    return torch.empty_like(like).copy_(grad)


# ---------------------------------------------------------------------------------------------
# vmap rules


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


def _loop(op, size: int, tensors, in_dims, scalars):
    """op once per vmapped example; outputs stacked at dim 0."""
    results = [
        op(*(_slice(t, d, i) for t, d in zip(tensors, in_dims, strict=False)), *scalars)
        for i in range(size)
    ]
    return tuple(torch.stack(outputs) for outputs in zip(*results, strict=True))


def register_vmap_rules(forward_op, backward_op) -> None:
    """vmap rules for a pair of raw ops with the signature in the module docstring."""

    @forward_op.register_vmap
    def _(info, in_dims, *args):
        size = info.batch_size
        tensors, scalars = args[:_N_TENSORS], args[_N_TENSORS:]
        bias_kind, gate_kind, dropout_p = scalars[0], scalars[1], scalars[5]
        if _must_loop(in_dims, (bias_kind, gate_kind), (3, 5, _SEED), dropout_p):
            return _loop(forward_op, size, tensors, in_dims, scalars), (0, 0)
        batch = _moved(args[0], in_dims[0]).shape[-4]
        folded = list(tensors)
        for pos, name in enumerate(FORWARD_TENSORS):
            kind = {"bias": bias_kind, "gate": gate_kind}.get(name)
            if kind not in TABLE_KINDS:
                folded[pos] = _fold(tensors[pos], in_dims[pos], size, batch, full=pos < 3)
        out, stat = forward_op(*folded, *scalars)
        return (
            out.view(size, batch, *out.shape[1:]),
            stat.view(size, batch, *stat.shape[1:]),
        ), (0, 0)

    @backward_op.register_vmap
    def _(info, in_dims, *args):
        size = info.batch_size
        n = _N_TENSORS + 3  # grad_out, out, stat, then the forward's tensors shifted by 3
        tensors, scalars = args[:n], args[n:]
        bias_kind, gate_kind, dropout_p = scalars[0], scalars[1], scalars[5]
        needs = scalars[_N_SCALARS:]
        table_grads = (bias_kind in TABLE_KINDS and needs[0]) or (
            gate_kind in TABLE_KINDS and needs[1]
        )
        loop = table_grads or _must_loop(
            in_dims, (bias_kind, gate_kind), (6, 8, _SEED + 3), dropout_p
        )
        if loop:  # per-example table gradients cannot be folded into one launch
            return _loop(backward_op, size, tensors, in_dims, scalars), (0,) * 6
        batch = _moved(args[3], in_dims[3]).shape[-4]
        folded = list(tensors)
        for pos, name in enumerate(("grad_out", "out", "stat", *FORWARD_TENSORS)):
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
        grads = backward_op(*folded, *scalars)
        out, dims = [], []
        for i, g in enumerate(grads):
            if i >= 3 and g.numel() == 0 and not needs[i - 3]:
                out.append(g)
                dims.append(None)
                continue
            g = g.view(size, batch, *g.shape[1:])
            if i >= 3:  # back to the term's own leading size (1 if it broadcast over the batch)
                at = (6, 8, 10)[i - 3]
                term, dim = tensors[at], in_dims[at]
                lead = term.shape[0] if dim is None else term.movedim(dim, 0).shape[1]
                if lead == 1 and batch != 1:
                    g = g.sum(1, keepdim=True)
            out.append(g)
            dims.append(0)
        return tuple(out), tuple(dims)


# ---------------------------------------------------------------------------------------------
# Autograd


def _overload(op) -> torch._ops.OpOverload:
    """The default OpOverload of a `torch.library.custom_op` ("namespace::name")."""
    return op._opoverload


def attention_function(forward_op, backward_op, name: str) -> type[torch.autograd.Function]:
    """The autograd.Function around a pair of raw ops (signature in the module docstring).

    Differentiable in q, k, v, the bias and gate tensors (dense or table) and a float attn_mask;
    the forward's second output (the row statistic) is not differentiable.
    """

    # torch.compile traces forward and backward without a source for the closure, where it
    # cannot wrap a CustomOpDef; the OpOverload under torch.ops it can.
    forward_overload = _overload(forward_op)
    backward_overload = _overload(backward_op)

    class AttentionFunction(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(q, k, v, bias, bias_index, gate, gate_index, attn_mask, key_padding_mask,
                    seed, bias_kind, gate_kind, is_causal, normalization, scale, dropout_p,
                    block_a, block_b):  # fmt: skip
            # explicit parameters (no *args): torch.compile recognises the setup_context form
            # by them
            return forward_overload(q, k, v, bias, bias_index, gate, gate_index, attn_mask,
                                    key_padding_mask, seed, bias_kind, gate_kind, is_causal,
                                    normalization, scale, dropout_p, block_a,
                                    block_b)  # fmt: skip

        @staticmethod
        def setup_context(ctx, inputs, output) -> None:
            out, stat = output
            ctx.mark_non_differentiable(stat)
            ctx.save_for_backward(out, stat, *inputs[:_N_TENSORS])
            ctx.scalars = inputs[_N_TENSORS:]

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out, _grad_stat):
            out, stat, q, k, v, bias, bias_index, gate, gate_index, attn_mask, padding, seed = (
                ctx.saved_tensors
            )
            needs = ctx.needs_input_grad
            grads = backward_overload(
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

    AttentionFunction.__name__ = AttentionFunction.__qualname__ = name
    return AttentionFunction
