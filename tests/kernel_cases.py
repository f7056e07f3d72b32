"""Attention calls shared by the backends' tests (test_backend_conformance and the per-backend
files): every bias/gate form, masks, odd and unequal lengths, grouped queries, in float64, and how
outputs and gradients are compared with the reference."""

from __future__ import annotations

import torch

from urpe.kernels import NORMALIZATIONS as REGISTERED
from urpe.kernels import Normalization, Relation, Toeplitz, reference_attention

SMALL_TILES = dict(block_q=8, block_k=16)  # every case spans several query and key blocks
NORMALIZATIONS = tuple(REGISTERED)  # read from the registry: a new entry is tested here too
MASKS = ("none", "causal", "padding", "causal+padding")
# (B, H, Hkv, Lq, Lk, D, Dv): odd lengths, Lq < Lk (queries are the last Lq positions) and
# Lq > Lk (then causal queries before Lq - Lk see no key), grouped queries, 1 and many heads
SHAPES = ((2, 2, 1, 13, 13, 16, 19), (1, 4, 2, 9, 21, 32, 35), (3, 3, 3, 30, 18, 64, 67))
# (bias, gate) kinds
TERMS = (
    (None, None),
    ("toeplitz", "toeplitz"),
    ("relation", "dense_broadcast"),
    ("dense", "relation_shared"),
    ("toeplitz_shared", None),
)


def term(kind, b, h, lq, lk, gen):
    """A bias or gate of the given kind and the tensors whose gradients are compared."""
    f64 = dict(dtype=torch.float64)
    if kind is None:
        return None, []
    if kind == "toeplitz":  # K = 5 < L: offsets beyond K are clipped
        table = torch.randn(h, 11, generator=gen, **f64).mul(0.5).add(1).requires_grad_()
        return Toeplitz(table), [table]
    if kind == "toeplitz_shared":  # one row for all heads, K larger than L
        table = torch.randn(1, 2 * 40 + 1, generator=gen, **f64).mul(0.5).requires_grad_()
        return Toeplitz(table), [table]
    if kind in ("relation", "relation_shared"):
        heads, rb = (h, b) if kind == "relation" else (1, 1)
        table = torch.randn(heads, 7, generator=gen, **f64).mul(0.5).add(0.5).requires_grad_()
        index = torch.randint(0, 7, (rb, lq, lk), generator=gen)
        return Relation(table, index), [table]
    if kind == "dense":
        dense = torch.randn(b, h, lq, lk, generator=gen, **f64).mul(0.5).requires_grad_()
        return dense, [dense]
    if kind == "dense_broadcast":  # (H, Lq, 1): broadcast over batch and keys
        dense = torch.randn(h, lq, 1, generator=gen, **f64).mul(0.5).add(1).requires_grad_()
        return dense, [dense]
    raise ValueError(kind)


def case(shape, mask, bias_kind, gate_kind, seed=0):
    """shape: (B, H, Hkv, Lq, Lk, D, Dv), or (B, H, Lq, Lk, D) for Hkv = H and Dv = D + 3.
    Grouped queries add enable_gqa=True to the call."""
    if len(shape) == 5:
        b, h, lq, lk, d = shape
        shape = (b, h, h, lq, lk, d, d + 3)
    b, h, hkv, lq, lk, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(b, hkv, lk, dv, generator=gen, dtype=torch.float64).requires_grad_()
    bias, bias_tensors = term(bias_kind, b, h, lq, lk, gen)
    gate, gate_tensors = term(gate_kind, b, h, lq, lk, gen)
    padding = None
    if "padding" in mask:
        padding = torch.rand(b, lk, generator=gen) < 0.3
        padding[0] = True  # a fully padded batch row
    call = dict(bias=bias, gate=gate, key_padding_mask=padding, is_causal="causal" in mask)
    if hkv != h:
        call["enable_gqa"] = True
    return (q, k, v), [q, k, v, *bias_tensors, *gate_tensors], call


def outputs_and_grads(fn, qkv, params, call):
    out = fn(*qkv, **call)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * weight).sum(), params)
    return out, grads


def assert_close(got, want, atol=1e-10, rtol=1e-8):
    out, grads = got
    ref_out, ref_grads = want
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    names = ["q", "k", "v", "bias/gate tables"] + ["gate"] * 4
    for name, g, r in zip(names, grads, ref_grads, strict=False):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def check_against_reference(kernel, shape, mask, terms, normalization, **tiles) -> None:
    """kernel(q, k, v, **call, **tiles) against the reference: output and every gradient."""
    qkv, params, call = case(shape, mask, *terms)
    call["normalization"] = normalization
    if normalization == "exp":
        call["scale"] = 0.05  # exp has no denominator: keep the logits small
    want = outputs_and_grads(reference_attention, qkv, params, call)
    got = outputs_and_grads(lambda *a, **c: kernel(*a, **c, **tiles), qkv, params, call)
    assert_close(got, want)


def _sigmoid_weights(scores, keep):
    a = torch.sigmoid(scores)
    return a if keep is None else a.masked_fill(~keep, 0.0)


def _sigmoid_tile(s, r):
    return s.sigmoid_(), None  # no row statistic: r is the zero `fixed_statistic`


def _sigmoid_grad(dp, a, aux, delta, r):
    return dp.mul_(a).mul_(1 - a)  # d sigmoid = a (1 - a)


def sigmoid_normalization(name: str = "sigmoid") -> Normalization:
    """Sigmoid attention, a_ij = sigmoid(s_ij), as a registry entry named `name`."""
    return Normalization(
        name=name,
        formula="a_ij = sigmoid(s_ij)",
        weights=_sigmoid_weights,
        tile_weights=_sigmoid_tile,
        grad_logits=_sigmoid_grad,
        fixed_statistic=torch.zeros_like,
        hidden_logit=float("-inf"),  # sigmoid(-inf) = 0
    )
