"""The raw-op layout (`urpe.kernels.layout`) and `define_attention_ops` (`composable`).

A kernel that sits behind a pair of custom ops supplies only its forward, its backward and the
shapes of its forward's outputs; the ops, their schemas, fake implementations, vmap rules and the
autograd Function come from the shared layout. These tests build such a kernel from the reference
(materialising, differentiated by autograd inside the backward op) and check that it composes
with autograd, torch.func and torch.compile like the shipped ones, and that the shipped
blockwise ops pass torch.library's own checks for every kind of term.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from urpe.kernels import Relation, Toeplitz, attention, resolve
from urpe.kernels.blockwise import BLOCKWISE, blockwise_attention
from urpe.kernels.composable import define_attention_ops, strided_like
from urpe.kernels.dtypes import compute_dtype
from urpe.kernels.layout import BACKWARD_SCHEMA, FORWARD_SCHEMA, ForwardArgs, term_arguments
from urpe.kernels.reference import reference_run
from urpe.kernels.spec import AttentionSpec

F64 = dict(dtype=torch.float64)
B, H, LQ, LK, D = 2, 3, 5, 6, 4


def _spec_of(args: ForwardArgs) -> AttentionSpec:
    """The resolved call that raw arguments stand for (what a kernel reads them as)."""

    def term(tensor, index, kind):
        if kind == "toeplitz":
            return Toeplitz(tensor)
        if kind == "relation":
            return Relation(tensor, index)
        return tensor

    return AttentionSpec(
        q=args.q,
        k=args.k,
        v=args.v,
        bias=term(args.bias, args.bias_index, args.bias_kind),
        gate=term(args.gate, args.gate_index, args.gate_kind),
        attn_mask=args.attn_mask,
        key_padding_mask=args.key_padding_mask,
        is_causal=args.is_causal,
        normalization=args.normalization,
        scale=args.scale,
        dropout_p=args.dropout_p,
        dropout_seed=args.dropout_seed,
    )


def _toy_forward(args: ForwardArgs):
    out = reference_run(_spec_of(args)).to(compute_dtype(args.q.dtype))
    return out, out.new_zeros(*out.shape[:3], 1)


def _toy_backward(grads):
    """The reference's vector-Jacobian product (autograd is off inside a custom op's body;
    torch.func's own transform still differentiates there)."""
    args = grads.forward
    names = [n for n, w in zip(("bias", "gate", "attn_mask"), grads.needs, strict=True) if w]

    def forward(q, k, v, *terms):
        return _toy_forward(args._replace(q=q, k=k, v=v, **dict(zip(names, terms, strict=True))))[0]

    _, vjp = torch.func.vjp(forward, args.q, args.k, args.v, *(getattr(args, n) for n in names))
    found = dict(zip(("q", "k", "v", *names), vjp(grads.grad_out), strict=True))
    return tuple(found.get(n) for n in ("q", "k", "v", "bias", "gate", "attn_mask"))


def _toy_fake(args: ForwardArgs):
    b, h, lq, _ = args.q.shape
    dtype = compute_dtype(args.q.dtype)
    return args.q.new_empty(b, h, lq, args.v.shape[-1], dtype=dtype), args.q.new_empty(
        b, h, lq, 1, dtype=dtype
    )


TOY = define_attention_ops("test_toy_attention", _toy_forward, _toy_backward, _toy_fake)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, LQ, D, generator=gen, **F64)
    k = torch.randn(B, H, LK, D, generator=gen, **F64)
    v = torch.randn(B, H, LK, D, generator=gen, **F64)
    bias = torch.randn(H, 2 * 3 + 1, generator=gen, **F64)
    gate = 1 + 0.3 * torch.randn(1, H, LQ, LK, generator=gen, **F64)
    return q, k, v, bias, gate


def _args(q, k, v, bias, gate, **changes) -> ForwardArgs:
    spec = resolve(q, k, v, bias=Toeplitz(bias), gate=gate, is_causal=True)
    return ForwardArgs.from_spec(spec)._replace(**changes)


def test_the_schemas_follow_the_layout_in_order():
    names = [part.split()[-1] for part in FORWARD_SCHEMA.split(")")[0][1:].split(", ")]
    assert names == list(ForwardArgs._fields)
    assert FORWARD_SCHEMA.startswith("(Tensor q, Tensor k, Tensor v, Tensor? bias,")
    assert "bool needs_bias, bool needs_gate, bool needs_mask)" in BACKWARD_SCHEMA
    assert "Tensor grad_out, Tensor out, Tensor stat, Tensor q" in BACKWARD_SCHEMA


@pytest.mark.parametrize(
    ("term", "kind"),
    [
        (None, "none"),
        (Toeplitz(torch.zeros(2, 5)), "toeplitz"),
        (Relation(torch.zeros(2, 4), torch.zeros(3, 3, dtype=torch.long)), "relation"),
        (torch.zeros(1, 2, 3, 3), "dense"),
    ],
)
def test_terms_become_tensor_index_and_kind(term, kind):
    tensor, index, got = term_arguments(term)
    assert got == kind
    if kind == "relation":
        assert index is term.index and tensor is term.table
    elif kind == "toeplitz":
        assert tensor is term.table and index is None
    else:
        assert tensor is term and index is None


def test_a_kernel_on_the_layout_gives_the_reference_and_its_gradients():
    q, k, v, bias, gate = (t.requires_grad_() for t in _inputs())
    got = TOY(_args(q, k, v, bias, gate))
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, bias, gate))
    want = attention(q, k, v, bias=Toeplitz(bias), gate=gate, is_causal=True, backend="reference")
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v, bias, gate))
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_a_kernel_on_the_layout_composes_with_func_and_compile():
    q, k, v, bias, gate = _inputs()

    def loss(q, bias):
        return TOY(_args(q, k, v, bias, gate)).square().sum()

    eager = torch.func.grad(loss, argnums=(0, 1))(q, bias)
    compiled = torch.compile(loss, fullgraph=True)
    leaves = [q.clone().requires_grad_(), bias.clone().requires_grad_()]
    traced = torch.autograd.grad(compiled(*leaves), leaves)
    for e, t in zip(eager, traced, strict=True):
        torch.testing.assert_close(e, t)
    # vmap over a leading dim folds into the batch: it equals a loop over the examples
    stacked = torch.stack([q, q.flip(-1)])
    mapped = torch.vmap(lambda x: TOY(_args(x, k, v, bias, gate)))(stacked)
    looped = torch.stack([TOY(_args(x, k, v, bias, gate)) for x in stacked])
    torch.testing.assert_close(mapped, looped)


@pytest.mark.parametrize("bias_kind", ["none", "toeplitz", "relation", "dense"])
def test_the_blockwise_ops_pass_torch_library_checks(bias_kind):
    q, k, v, table, gate = _inputs()
    bias = {
        "none": None,
        "toeplitz": Toeplitz(table),
        "relation": Relation(table, torch.randint(0, 7, (B, LQ, LK))),
        "dense": torch.randn(B, 1, LQ, LK, **F64),
    }[bias_kind]
    mask = torch.rand(LQ, LK) < 0.8
    spec = resolve(q, k, v, attn_mask=mask, bias=bias, gate=gate, is_causal=True)
    args = ForwardArgs.from_spec(spec, 2, 4)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(BLOCKWISE.forward_op, tuple(args), test_utils=checks)
    out, stat = BLOCKWISE.forward_op(*args)
    grad_out = torch.randn(out.shape, **F64)
    backward = (grad_out, out, stat, *args, bias is not None, True, False)
    torch.library.opcheck(BLOCKWISE.backward_op, backward, test_utils=checks)


def test_the_old_argument_names_still_work_with_a_warning():
    q, k, v, bias, gate = _inputs()
    call = dict(gate=gate, dropout_p=0.4, block_q=2, block_k=3)
    new = blockwise_attention(q, k, v, **call, dropout_seed=11)
    with pytest.warns(DeprecationWarning, match="dropout_seed"):
        old = blockwise_attention(q, k, v, **call, seed=11)
    torch.testing.assert_close(old, new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blockwise_attention(q, k, v, **call, dropout_seed=11)  # the new name warns nothing


# ---------------------------------------------------------------------------------- vmap rules
def test_vmap_over_per_example_tables_loops_and_equals_a_loop():
    """A batched Toeplitz table cannot be folded into the batch dim (one table per example):
    the rule loops, forward and gradients."""
    q, k, v, bias, gate = _inputs()
    tables = torch.stack([bias, 2 * bias, -bias])  # (3, H, 7)

    def out(table):
        return TOY(_args(q, k, v, table, gate))

    mapped = torch.vmap(out)(tables)
    torch.testing.assert_close(mapped, torch.stack([out(t) for t in tables]))
    per_example = torch.vmap(torch.func.grad(lambda t: out(t).square().sum()))(tables)
    for table, got in zip(tables, per_example, strict=True):
        want = torch.func.grad(lambda t: out(t).square().sum())(table)
        torch.testing.assert_close(got, want)


def test_vmap_with_dropout_gives_each_example_its_own_masks():
    """Folding would draw the masks of a bigger batch; the loop gives each example the masks it
    gets alone (a fixed seed makes that comparable)."""
    q, k, v, bias, gate = _inputs()
    seed = torch.tensor(5, dtype=torch.int64)

    def out(x):
        return BLOCKWISE(_args(x, k, v, bias, gate, dropout_p=0.5, dropout_seed=seed))

    stacked = torch.stack([q, q + 1])
    torch.testing.assert_close(torch.vmap(out)(stacked), torch.stack([out(x) for x in stacked]))


def test_vmap_of_a_broadcast_dense_gate_gradient_sums_back_to_its_shape():
    q, k, v, bias, gate = _inputs()  # gate (1, H, Lq, Lk) broadcasts over the batch

    def loss(x, g):
        return TOY(_args(x, k, v, bias, g)).square().sum()

    stacked = torch.stack([q, 0.5 * q])
    grads = torch.vmap(torch.func.grad(loss, argnums=1), in_dims=(0, None))(stacked, gate)
    assert grads.shape == (2, *gate.shape)
    for x, got in zip(stacked, grads, strict=True):
        torch.testing.assert_close(got, torch.func.grad(loss, argnums=1)(x, gate))


# ------------------------------------------------------------------------- ops and autograd
def test_gradients_not_asked_for_come_back_empty():
    q, k, v, bias, gate = _inputs()
    args = _args(q, k, v, bias, gate)
    out, stat = BLOCKWISE.forward_op(*args)
    grads = BLOCKWISE.backward_op(torch.ones_like(out), out, stat, *args, False, True, False)
    assert grads[3].numel() == 0 and grads[5].numel() == 0  # bias, attn_mask: not wanted
    assert grads[4].shape == gate.shape and grads[0].shape == q.shape
    # only the leaves that need a gradient are asked for
    leaf = gate.clone().requires_grad_()
    (g,) = torch.autograd.grad(BLOCKWISE(_args(q, k, v, bias, leaf)).sum(), leaf)
    torch.testing.assert_close(g, grads[4].to(g.dtype), rtol=1e-6, atol=1e-9)


def test_gradients_get_the_strides_the_fake_promises():
    like = torch.empty(2, 3, 4)
    contiguous = torch.randn(2, 3, 4)
    assert strided_like(contiguous, like) is contiguous
    transposed = torch.randn(4, 3, 2).transpose(0, 2)  # same shape, other strides
    fixed = strided_like(transposed, like)
    assert fixed.stride() == like.stride() and torch.equal(fixed, transposed)


def test_higher_order_gradients_raise():
    """Not implemented: a second derivative is an error, never a silent zero."""
    q, k, v, bias, gate = (t.requires_grad_() for t in _inputs())
    (gq,) = torch.autograd.grad(TOY(_args(q, k, v, bias, gate)).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice|does not require grad"):
        torch.autograd.grad(gq.sum(), q)
