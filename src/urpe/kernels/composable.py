"""A kernel behind a pair of custom ops that composes with torch.func and torch.compile.

The blockwise and the Triton backends wrap their kernels in flash-attention's three
layers: raw ops on tensors and scalars, an `autograd.Function` around them, the public call.
`define_attention_ops(name, forward, backward, forward_fake)` builds the first two from a
kernel's two functions, on the argument layout of `layout` (`ForwardArgs`, `BackwardArgs`):

- the raw ops `urpe::{name}_forward` and `urpe::{name}_backward` (`torch.library.custom_op`
  with the layout's schemas), their fake implementations (the backward's is shared; the
  forward's statistic differs per kernel) and their vmap rules: vmap folds the vmapped dim into
  the batch dim (one launch), and loops over it where folding would be wrong (batched tables,
  per-example table gradients, dropout: the masks of a folded batch differ from those of its
  examples);
- the `autograd.Function` with `setup_context` whose backward calls the backward op.
  `torch.func.grad`, `vmap` and `functional_call` compose with it; a `register_autograd`
  formula on the op alone is not enough (torch.func refuses the autograd.Function it generates).

A kernel's backward returns None for a gradient it was not asked for; the op turns that into an
empty (0,) tensor and gives every gradient the strides its fake implementation promises.
Higher-order gradients are not implemented: differentiating the backward raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .host import plain_eager, records_grad
from .layout import (
    BACKWARD_SCHEMA,
    BUILT_IN_KINDS,
    FORWARD_SCHEMA,
    GRADIENT_INPUTS,
    N_TENSORS,
    TABLE_KINDS,
    BackwardArgs,
    ForwardArgs,
)

_FIELDS = ForwardArgs._fields
_AT = {name: i for i, name in enumerate(_FIELDS)}  # positions in the forward op's arguments


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
    return t if t is None or dim is None else t.select(dim, i)


def _loop(op, size: int, args: tuple, in_dims: tuple):
    """op once per vmapped example; outputs stacked at dim 0. (Scalars have in_dim None.)"""
    results = [
        op(*(_slice(t, d, i) for t, d in zip(args, in_dims, strict=True))) for i in range(size)
    ]
    return tuple(torch.stack(outputs) for outputs in zip(*results, strict=True))


def _must_loop(args: ForwardArgs, dims: ForwardArgs) -> bool:
    """Folding is wrong for per-example tables, for dropout (the masks of a folded batch
    differ from those of its examples) and for a kind registered outside urpe (its tensors
    need not have the batch first); loop then."""
    if args.dropout_p > 0.0 or dims.dropout_seed is not None:
        return True
    return any(
        args.kind(t) not in BUILT_IN_KINDS
        or (args.kind(t) in TABLE_KINDS and getattr(dims, t) is not None)
        for t in ("bias", "gate")
    )


def _folded(args: ForwardArgs, dims: ForwardArgs, size: int, batch: int, full: set[str]) -> list:
    """The forward arguments with the vmapped dim folded into the batch (tables stay as they
    are; `full`: the names that must get one row per example even where they broadcast)."""
    folded = list(args)
    for name in _FIELDS[:N_TENSORS]:
        if name in ("bias", "gate") and args.kind(name) in TABLE_KINDS:
            continue
        at = _AT[name]
        folded[at] = _fold(args[at], dims[at], size, batch, full=name in full)
    return folded


def _register_vmap_rules(forward_op, backward_op) -> None:
    @forward_op.register_vmap
    def _(info, in_dims, *flat):
        size, args, dims = info.batch_size, ForwardArgs(*flat), ForwardArgs(*in_dims)
        if _must_loop(args, dims):
            return _loop(forward_op, size, flat, in_dims), (0, 0)
        batch = _moved(args.q, dims.q).shape[-4]
        out, stat = forward_op(*_folded(args, dims, size, batch, {"q", "k", "v"}))
        return (out.view(size, batch, *out.shape[1:]), stat.view(size, batch, *stat.shape[1:])), (
            0,
            0,
        )

    @backward_op.register_vmap
    def _(info, in_dims, *flat):
        size = info.batch_size
        args, dims = BackwardArgs.from_flat(flat), BackwardArgs.from_flat(in_dims)
        fwd, fwd_dims = args.forward, dims.forward
        table_grads = any(
            fwd.kind(t) in TABLE_KINDS and needed
            for t, needed in zip(("bias", "gate"), args.needs[:2], strict=True)
        )
        if table_grads or _must_loop(fwd, fwd_dims):  # per-example table gradients: no folding
            return _loop(backward_op, size, flat, in_dims), (0,) * 6
        batch = _moved(fwd.q, fwd_dims.q).shape[-4]
        # a dense term whose gradient is wanted gets one gradient per example: fold it in full
        wanted = {t for t, w in zip(("bias", "gate", "attn_mask"), args.needs, strict=True) if w}
        folded_fwd = _folded(fwd, fwd_dims, size, batch, {"q", "k", "v", *wanted})
        head = [
            _fold(t, d, size, batch, full=True) for t, d in zip(args[:3], dims[:3], strict=True)
        ]
        grads = backward_op(*head, *folded_fwd, *args.needs)
        out, out_dims = [], []
        for name, g in zip(GRADIENT_INPUTS, grads, strict=True):
            if name in ("bias", "gate", "attn_mask") and g.numel() == 0:
                out.append(g)  # not asked for
                out_dims.append(None)
                continue
            g = g.view(size, batch, *g.shape[1:])
            if name in ("bias", "gate", "attn_mask"):  # back to the term's own leading size
                term, dim = getattr(fwd, name), getattr(fwd_dims, name)
                lead = term.shape[0] if dim is None else term.movedim(dim, 0).shape[1]
                if lead == 1 and batch != 1:
                    g = g.sum(1, keepdim=True)
            out.append(g)
            out_dims.append(0)
        return tuple(out), tuple(out_dims)


# ---------------------------------------------------------------------------------------------
# The ops and the autograd Function


def _backward_fake(*flat):
    args = BackwardArgs.from_flat(flat)
    fwd = args.forward
    terms = (fwd.bias, fwd.gate, fwd.attn_mask)
    extra = (
        torch.empty_like(t) if needed and t is not None else fwd.q.new_empty(0)
        for t, needed in zip(terms, args.needs, strict=True)
    )
    return (torch.empty_like(fwd.q), torch.empty_like(fwd.k), torch.empty_like(fwd.v), *extra)


def _as_op_outputs(grads, args: ForwardArgs) -> tuple[Tensor, ...]:
    """A kernel's gradients as the op returns them: None -> empty (0,), each strided like its
    input (what the fake implementation promises)."""
    return tuple(
        args.q.new_empty(0) if g is None else strided_like(g, getattr(args, name))
        for name, g in zip(GRADIENT_INPUTS, grads, strict=True)
    )


@dataclass(frozen=True)
class AttentionOps:
    """A kernel's raw ops, the autograd Function around them, and the direct route that plain
    eager calls take (the kernel's own functions; same results, without the ops' overhead)."""

    forward_op: Callable
    backward_op: Callable
    function: type[torch.autograd.Function]
    forward: Callable[[ForwardArgs], tuple[Tensor, Tensor]]
    eager_function: type[torch.autograd.Function]
    checked_function: type[torch.autograd.Function] | None = None

    def __call__(self, args: ForwardArgs) -> Tensor:
        """The differentiable output (B, H, Lq, Dv) for these arguments: the custom ops'
        Function where torch.compile or torch.func look (`host.plain_eager`), else the kernel's
        own functions (nothing needs the ops' registration; it saves their cost per call)."""
        if not plain_eager(args.q, args.k, args.v):
            return self.function.apply(*args)[0]
        if not records_grad(*args.tensors):
            return self.forward(args)[0]
        return self.eager_function.apply(*args)[0]

    def if_finite(self, args: ForwardArgs) -> Tensor | None:
        """A plain eager call with gradients whose q, k and v nobody checked (the kernel has a
        `checked_forward`): the differentiable output, or None where the kernel met NaN/inf
        (the caller then applies the non-finite rule; the discarded output frees its graph)."""
        out, _, finite = self.checked_function.apply(*args)
        return out if finite else None


def define_attention_ops(
    name: str,
    forward: Callable[[ForwardArgs], tuple[Tensor, Tensor]],
    backward: Callable[[BackwardArgs], tuple],
    forward_fake: Callable[[ForwardArgs], tuple[Tensor, Tensor]],
    checked_forward: Callable[[ForwardArgs], tuple[Tensor, Tensor, bool]] | None = None,
) -> AttentionOps:
    """Register `urpe::{name}_forward` / `_backward` around a kernel's two functions.

    forward(args) -> (out, row statistic); backward(args) -> (dq, dk, dv, d bias, d gate,
    d attn_mask) with None for a term gradient not asked for; forward_fake(args) -> empty
    tensors of the forward's output shapes and dtypes. checked_forward(args) -> (out, row
    statistic, True), or (anything, anything, False) where q, k or v held a NaN or inf the
    kernel read: the forward of `AttentionOps.if_finite` (plain eager calls only).
    """
    forward_op = torch.library.custom_op(
        f"urpe::{name}_forward",
        lambda *flat: forward(ForwardArgs(*flat)),
        mutates_args=(),
        schema=FORWARD_SCHEMA,
    )
    forward_op.register_fake(lambda *flat: forward_fake(ForwardArgs(*flat)))

    def run_backward(*flat):
        args = BackwardArgs.from_flat(flat)
        return _as_op_outputs(backward(args), args.forward)

    backward_op = torch.library.custom_op(
        f"urpe::{name}_backward", run_backward, mutates_args=(), schema=BACKWARD_SCHEMA
    )
    backward_op.register_fake(_backward_fake)
    _register_vmap_rules(forward_op, backward_op)
    function = _autograd_function(forward_op, backward_op, name)
    eager = _eager_function(lambda args: (*forward(args), True), backward, f"{name}_eager")
    checked = None
    if checked_forward is not None:
        checked = _eager_function(checked_forward, backward, f"{name}_eager_checked")
    return AttentionOps(forward_op, backward_op, function, forward, eager, checked)


def _with_explicit_parameters(call: Callable) -> Callable:
    """`lambda q, k, ..., block_k: call(q, k, ..., block_k)` over `ForwardArgs`' fields.

    torch.compile recognises an autograd.Function's setup_context form by the explicit
    parameters of its forward (with `*args` it traces the function as the old ctx form and
    fails), so the parameter list is generated from the layout rather than written again.
    """
    names = ", ".join(_FIELDS)
    namespace = {"call": call}
    exec(f"def forward({names}):\n    return call({names})\n", namespace)  # noqa: S102
    return namespace["forward"]


def _autograd_function(forward_op, backward_op, name: str) -> type[torch.autograd.Function]:
    """Differentiable in q, k, v, the bias and gate tensors (dense or table) and a float
    attn_mask; the forward's second output (the row statistic) is not differentiable."""
    # torch.compile traces forward and backward without a source for the closure, where it
    # cannot wrap a CustomOpDef; the OpOverload under torch.ops it can.
    forward_overload = forward_op._opoverload
    backward_overload = backward_op._opoverload

    class AttentionFunction(torch.autograd.Function):
        generate_vmap_rule = True

        forward = staticmethod(_with_explicit_parameters(forward_overload))

        @staticmethod
        def setup_context(ctx, inputs, output) -> None:
            out, stat = output
            ctx.mark_non_differentiable(stat)
            ctx.save_for_backward(out, stat, *inputs[:N_TENSORS])
            ctx.scalars = inputs[N_TENSORS:]

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out, _grad_stat):
            out, stat, *tensors = ctx.saved_tensors
            needs = ForwardArgs(*ctx.needs_input_grad)
            wanted = (needs.bias, needs.gate, needs.attn_mask)
            grads = backward_overload(
                grad_out.contiguous(), out, stat, *tensors, *ctx.scalars, *wanted
            )
            return _per_input(grads, needs)

    AttentionFunction.__name__ = AttentionFunction.__qualname__ = name
    return AttentionFunction


def _eager_function(forward: Callable, backward: Callable, name: str):
    """The autograd Function of plain eager calls: the kernel's two functions, called directly
    (the custom ops' Function is what torch.func and torch.compile see instead). forward(args)
    -> (out, stat, finite); the Function returns the same (finite a plain bool)."""

    class EagerAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *flat):
            out, stat, finite = forward(ForwardArgs(*flat))
            ctx.mark_non_differentiable(stat)
            ctx.save_for_backward(out, stat, *flat[:N_TENSORS])
            ctx.scalars = flat[N_TENSORS:]
            return out, stat, finite

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out, _grad_stat, _finite):
            out, stat, *tensors = ctx.saved_tensors
            needs = ForwardArgs(*ctx.needs_input_grad)
            call = ForwardArgs(*tensors, *ctx.scalars)
            # grad_out as it comes (a kernel that needs it contiguous makes it so): the C++
            # kernel reads the transposed view a (B, L, H, Dv) reshape gives back in place
            grads = backward(
                BackwardArgs(grad_out, out, stat, call, needs.bias, needs.gate, needs.attn_mask)
            )
            return _per_input(grads, needs)

    EagerAttentionFunction.__name__ = EagerAttentionFunction.__qualname__ = name
    return EagerAttentionFunction


def _per_input(grads: tuple, needs: ForwardArgs) -> tuple:
    """The backward's gradients in the forward's argument order, None where none is wanted."""
    per_input = dict(zip(GRADIENT_INPUTS, grads, strict=True))
    return tuple(
        per_input[name] if name in per_input and getattr(needs, name) else None for name in _FIELDS
    )
