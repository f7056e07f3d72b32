"""NaN and inf inside a bias, gate or float attn_mask: the C++ kernel gives what the reference
gives, forward and backward.

Such values are not rewritten by the non-finite rule (that is for q, k, v): they act through the
reference's arithmetic on the pairs where they sit (`urpe.kernels.nonfinite`). The kernel once
differed silently: relu2 turned a NaN logit into 0 (a finite row where the reference has NaN), a
softmax or l2 row with a NaN logit passed other gradients back than the reference's, and an inf
weight leaked NaN into the gradients of keys its row does not see.
"""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import NORMALIZATIONS, Relation, Toeplitz, attention
from urpe.kernels.cpp import cpp_attention, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

B, H, L, D = 2, 2, 6, 4
# (-inf acts as a hidden pair, or as inf does in a gate)
POISONS = {"nan": float("nan"), "inf": float("inf")}
# one tile (the default at L = 6: rows past the causal edge inside the tile), and 2 x 4 tiles
# (several tiles per row: the online statistic across tiles)
TILES = {"one tile": {}, "2 x 4 tiles": dict(block_q=2, block_k=4)}


def _term(where: str, poison: float, dtype: torch.dtype):
    """(argument for urpe.attention, the leaf tensor whose gradient is compared): one entry,
    seen by query 3 of batch 0, head 1, holds the poison."""
    gen = torch.Generator().manual_seed(1)
    role, kind = where.split()
    if kind == "dense":
        leaf = torch.randn(B, H, L, L, generator=gen, dtype=dtype)
        if role == "gate":
            leaf = leaf.abs()
        leaf[0, 1, 3, 2] = poison
        return leaf, leaf
    if kind == "toeplitz":  # offset -1: every query's previous key
        leaf = torch.rand(H, 2 * L - 1, generator=gen, dtype=dtype)
        leaf[1, L - 2] = poison
        return Toeplitz(leaf), leaf
    if kind == "relation":
        leaf = torch.rand(H, 3, generator=gen, dtype=dtype)
        leaf[1, 2] = poison
        index = torch.randint(0, 2, (B, L, L), generator=gen)
        index[0, 3, 2] = 2
        return Relation(leaf, index), leaf
    leaf = torch.randn(L, L, generator=gen, dtype=dtype)  # float attn_mask
    leaf[3, 2] = poison
    return leaf, leaf


def _rebuilt(argument, leaf: torch.Tensor):
    """The argument around a fresh leaf (each backend gets its own gradients)."""
    if isinstance(argument, Toeplitz):
        return Toeplitz(leaf)
    if isinstance(argument, Relation):
        return Relation(leaf, argument.index)
    return leaf


def _run(fn, q, k, v, argument, leaf, role, **call):
    """(out, [dq, dk, dv, d leaf]) or the exception raised."""
    q, k, v, leaf = (t.detach().clone().requires_grad_() for t in (q, k, v, leaf))
    try:
        out = fn(q, k, v, **{role: _rebuilt(argument, leaf)}, **call)
    except ValueError as error:  # exp overflow: an error on every backend
        return error
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return out, list(torch.autograd.grad((out * weight).sum(), [q, k, v, leaf]))


WHERE = ["bias dense", "bias toeplitz", "bias relation", "gate dense", "gate toeplitz", "mask -"]


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("norm", list(NORMALIZATIONS))
def test_nan_or_inf_in_a_term_gives_the_reference_result(norm, where, poison):
    """Causal: rows meet hidden pairs inside their tiles and past their ends."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for _ in range(3))
    argument, leaf = _term(where, POISONS[poison], torch.float64)
    role = "attn_mask" if where.startswith("mask") else where.split()[0]
    call = dict(normalization=norm, is_causal=True)
    want = _run(attention, q, k, v, argument, leaf, role, **call, backend="reference")
    # Known: with inf in a gate, softmax's and l2's delta_i = sum_e dO_ie O_ie meets inf - inf
    # where the reference's sum_j a_ij dP_ij is +-inf: the same gradient entries are non-finite,
    # some NaN here where the reference has +-inf.
    kind_may_differ = role == "gate" and poison != "nan" and norm in ("softmax", "l2")
    for tiles, sizes in TILES.items():
        got = _run(cpp_attention, q, k, v, argument, leaf, role, **call, **sizes)
        if isinstance(want, Exception):
            assert type(got) is type(want), (tiles, got)
            continue
        torch.testing.assert_close(
            got[0], want[0], equal_nan=True, msg=lambda m, t=tiles: f"{t}: {m}"
        )
        for name, g, w in zip(("dq", "dk", "dv", "d term"), got[1], want[1], strict=True):
            label = f"{tiles}, {name}"
            if kind_may_differ:
                finite = torch.isfinite(w)
                assert torch.equal(torch.isfinite(g), finite), label
                g, w = g[finite], w[finite]
            torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, x=label: f"{x}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("role", ["bias", "attn_mask"])
def test_relu2_row_with_a_nan_logit_is_nan_in_every_dtype(dtype, role):
    """Issue 39, item 22: relu2 gave a finite row (relu(NaN) taken as 0)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(dtype) for _ in range(3))
    term = torch.zeros(L, L, dtype=dtype)
    term[3, 2] = float("nan")
    results = {}
    for backend in ("reference", "cpp"):
        out = attention(q, k, v, **{role: term}, normalization="relu2", backend=backend)
        results[backend] = torch.isnan(out).all(-1)  # (B, H, L): NaN rows
    expected = torch.zeros(B, H, L, dtype=torch.bool)
    expected[:, :, 3] = True
    assert torch.equal(results["reference"], expected)
    assert torch.equal(results["cpp"], expected)
