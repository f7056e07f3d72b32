"""No silent failure: hostile inputs behave the same on every backend and normalisation.

Each case runs through the registries (every backend that accepts the call, every
normalisation), forward and backward, and is compared with the reference or with a statement of
the documented rule (see `urpe.kernels.nonfinite`).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from urpe.kernels import (
    NORMALIZATIONS,
    Relation,
    Toeplitz,
    attention,
    native_backends,
    select_backend,
)
from urpe.kernels.blockwise import blockwise_attention
from urpe.kernels.cpp import cpp_attention

# The backends built for the CPU (the GPU ones have their own tests: test_triton, test_flex).
CPU_BACKENDS = native_backends("cpu")

F64 = dict(dtype=torch.float64)
B, H, L, D = 2, 2, 6, 4
TILES = dict(block_q=2, block_k=4)  # several tiles per row for the tiled kernels


def _accepting(q, k, v, **call) -> list[str]:
    names = []
    for name in CPU_BACKENDS:
        try:
            select_backend(name, q, k, v, **call)
        except ValueError:
            continue
        names.append(name)
    return names


# The tiled kernels again with small tiles, so that every row spans several key blocks.
TILED = {"blockwise": blockwise_attention, "cpp": cpp_attention}


def _runners(q, k, v, **call):
    """(label, fn) for every backend that runs the call, and the tiled kernels with small
    tiles."""
    for name in _accepting(q, k, v, **call):
        yield name, lambda *a, name=name, **c: attention(*a, **c, backend=name)
        if name in TILED:
            yield f"{name}-tiled", lambda *a, name=name, **c: TILED[name](*a, **c, **TILES)


def _qkv(lq=L, lk=L, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=gen, **F64)
    k = torch.randn(B, H, lk, D, generator=gen, **F64)
    v = torch.randn(B, H, lk, D, generator=gen, **F64)
    return q, k, v


def _with_grads(fn, q, k, v, leaves=(), **call):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **call)
    weight = torch.linspace(-1, 1, out.numel(), **F64).view_as(out)
    grads = torch.autograd.grad(
        (out.nan_to_num() * weight).sum(), [q, k, v, *leaves], allow_unused=True
    )
    return out, grads


NORMS = list(NORMALIZATIONS)


def _normalization_call(norm: str) -> dict:
    # exp has no denominator: small logits keep it far from overflow
    return dict(normalization=norm, scale=0.1 if norm == "exp" else None)


# ---------------------------------------------------------------------------------------------
# Rows with nothing visible


def _empty_row_cases():
    """(name, call, row): the call leaves query row (batch 0, head 0, query 2) with no key."""
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[0] = True  # every key of batch row 0 (every head, every query)
    mask = torch.ones(L, L, dtype=torch.bool)
    mask[2] = False
    dense = torch.zeros(B, H, L, L, **F64)
    dense[0, 0, 2] = float("-inf")
    float_mask = torch.zeros(L, L, **F64)
    float_mask[2] = float("-inf")
    table = torch.zeros(H, 3, **F64)
    table[0, 2] = float("-inf")
    index = torch.zeros(B, L, L, dtype=torch.long)
    index[0, 2] = 2  # (head 0 reads table[0, 2] = -inf along that row)
    return [
        ("padding", dict(key_padding_mask=padding)),
        ("causal, more queries than keys", dict(is_causal=True)),  # Lq = L + 3 below
        ("bool attn_mask", dict(attn_mask=mask)),
        ("-inf dense bias", dict(bias=dense)),
        ("-inf float attn_mask", dict(attn_mask=float_mask)),
        ("-inf relation bias", dict(bias=Relation(table, index))),
    ]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("case", range(6))
def test_a_row_with_nothing_visible_is_zero_with_zero_gradients(norm, case):
    label, call = _empty_row_cases()[case]
    lq = L + 3 if "causal" in label else L
    q, k, v = _qkv(lq=lq)
    row = (0, 0, 2)  # (causal: query 2 of L + 3 sits at position -1 and sees nothing)
    call = call | _normalization_call(norm)
    want, want_grads = _with_grads(attention, q, k, v, **call, backend="reference")
    for name, fn in _runners(q, k, v, **call):
        out, grads = _with_grads(fn, q, k, v, **call)
        assert torch.equal(out[row], torch.zeros_like(out[row])), (name, label)
        assert all(torch.isfinite(g).all() for g in grads if g is not None), (name, label)
        assert torch.equal(grads[0][row], torch.zeros_like(grads[0][row])), (name, label)
        torch.testing.assert_close(out, want, msg=lambda m, n=name: f"{n}, {label}: {m}")
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, msg=lambda m, n=name: f"{n}, {label}: {m}")


# ---------------------------------------------------------------------------------------------
# Non-finite numbers in q, k, v


HIDING = {
    # how a key is hidden -> (call, (batch, query rows, key) hidden pairs' key index)
    "padding": dict(key_padding_mask=torch.tensor([[False] * (L - 1) + [True]] * B)),
    "causal": dict(is_causal=True),
    "bool attn_mask": dict(attn_mask=torch.ones(L, L, dtype=torch.bool).tril()),
}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("hiding", list(HIDING))
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
def test_non_finite_in_a_hidden_key_or_value_never_reaches_a_visible_output(norm, hiding, poison):
    """The last key is hidden from every query (padding) or from all but the last query (causal,
    lower-triangular mask). NaN/inf in its key and value leaves every other output row, and every
    gradient, exactly as with a finite key there; the last query (which sees it) is NaN."""
    call = HIDING[hiding] | _normalization_call(norm)
    q, k, v = _qkv()
    want, want_grads = _with_grads(attention, q, k, v, **call, backend="reference")
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, -1, 1] = float(poison)
    v_bad[:, :, -1, 2] = float(poison)
    sees_it = torch.zeros(B, H, L, dtype=torch.bool)
    if hiding != "padding":
        sees_it[:, :, -1] = True
    for name, fn in _runners(q, k, v, **call):
        out, grads = _with_grads(fn, q, k_bad, v_bad, **call)
        nan_rows = torch.isnan(out).all(-1)
        assert torch.equal(nan_rows, sees_it), name
        assert torch.isfinite(out[~sees_it]).all(), name
        torch.testing.assert_close(out[~sees_it], want[~sees_it], msg=lambda m, n=name: f"{n}: {m}")
        for g in grads:
            assert torch.isfinite(g).all(), name
        if hiding == "padding":  # nothing sees it: gradients are exactly the finite ones
            for g, w in zip(grads, want_grads, strict=True):
                torch.testing.assert_close(g[..., :-1, :], w[..., :-1, :])


@pytest.mark.parametrize("norm", NORMS)
def test_nan_query_gives_the_same_result_on_every_backend(norm):
    """A NaN query row: its output row is NaN if it sees any key and 0 if it sees none; every
    other row and every gradient is finite and as without the NaN."""
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1] = True  # batch row 1 sees nothing
    call = dict(key_padding_mask=padding) | _normalization_call(norm)
    q, k, v = _qkv()
    q_bad = q.clone()
    q_bad[0, 1, 3, 0] = float("nan")
    q_bad[1, 0, 2, 1] = float("nan")
    want, _ = _with_grads(attention, q, k, v, **call, backend="reference")
    for name, fn in _runners(q, k, v, **call):
        out, grads = _with_grads(fn, q_bad, k, v, **call)
        assert torch.isnan(out[0, 1, 3]).all(), name
        assert torch.equal(out[1], torch.zeros_like(out[1])), name
        rest = torch.ones(B, H, L, dtype=torch.bool)
        rest[0, 1, 3] = False
        torch.testing.assert_close(out[rest], want[rest], msg=lambda m, n=name: f"{n}: {m}")
        assert all(torch.isfinite(g).all() for g in grads), name


def test_non_finite_visible_value_makes_exactly_the_rows_that_see_it_nan():
    q, k, v = _qkv()
    v_bad = v.clone()
    v_bad[0, 1, 2, 0] = float("inf")  # key 2: seen by causal queries 2..L-1 of (0, 1)
    results = {}
    for name, fn in _runners(q, k, v, is_causal=True):
        out, _ = _with_grads(fn, q, k, v_bad, is_causal=True)
        expected = torch.zeros(B, H, L, dtype=torch.bool)
        expected[0, 1, 2:] = True
        assert torch.equal(torch.isnan(out).all(-1), expected), name
        assert torch.isfinite(out[~expected]).all(), name
        results[name] = out
    for out in results.values():
        torch.testing.assert_close(out, results["reference"], equal_nan=True)


# ---------------------------------------------------------------------------------------------
# Relation indices


@pytest.mark.parametrize("role", ["bias", "gate"])
@pytest.mark.parametrize("bad", [-1, 5, 2**40])
def test_relation_index_out_of_range_names_the_argument(role, bad):
    q, k, v = _qkv()
    index = torch.randint(0, 5, (B, L, L))
    index[1, 2, 3] = bad
    term = Relation(torch.ones(H, 5, **F64), index)
    tried = 0
    for name in CPU_BACKENDS:
        good = Relation(term.table, torch.zeros_like(index))
        if name not in _accepting(q, k, v, **{role: good}):
            continue
        with pytest.raises(ValueError, match=f"{role} index must lie in \\[0, 5\\).*got {bad}"):
            attention(q, k, v, **{role: term}, backend=name)
        tried += 1
    assert tried >= 2


def test_relation_index_of_any_integer_dtype_and_shared_over_the_batch():
    q, k, v = _qkv()
    index = torch.randint(0, 4, (L, L))
    table = torch.randn(H, 4, **F64)
    want = attention(q, k, v, bias=table[:, index.long()], backend="reference")
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        for name in _accepting(q, k, v, bias=Relation(table, index)):
            got = attention(q, k, v, bias=Relation(table, index.to(dtype)), backend=name)
            torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# Empty tensors


EMPTY_SHAPES = {
    "B=0": ((0,), H, L, L),
    "Lq=0": ((B,), H, 0, L),
    "Lk=0": ((B,), H, L, 0),
    "H=0": ((B,), 0, L, L),
    "leading 0": ((2, 0), H, L, L),
}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("shape", list(EMPTY_SHAPES))
def test_empty_tensors_forward_and_backward(norm, shape):
    batch, h, lq, lk = EMPTY_SHAPES[shape]
    q = torch.randn(*batch, h, lq, D, **F64, requires_grad=True)
    k = torch.randn(*batch, h, lk, D, **F64, requires_grad=True)
    v = torch.randn(*batch, h, lk, 3, **F64, requires_grad=True)
    bias_table = torch.randn(max(h, 1), 5, **F64, requires_grad=True)
    gate_table = torch.randn(max(h, 1), 5, **F64, requires_grad=True)
    terms = dict(bias=Toeplitz(bias_table), gate=Toeplitz(gate_table)) if h else {}
    call = terms | dict(normalization=norm, is_causal=True)
    names = _accepting(q, k, v, **call) or _accepting(q, k, v, **(call | dict(gate=None)))
    for name in names:
        use = call if name in _accepting(q, k, v, **call) else call | dict(gate=None)
        out = attention(q, k, v, **use, backend=name, dropout_p=0.1)
        assert out.shape == (*batch, h, lq, 3) and torch.equal(out, torch.zeros_like(out))
        leaves = [q, k, v] + ([bias_table] + ([gate_table] if use.get("gate") else []) if h else [])
        grads = torch.autograd.grad(out.sum(), leaves)
        for g, leaf in zip(grads, leaves, strict=True):
            assert g.shape == leaf.shape and torch.equal(g, torch.zeros_like(g)), name


@pytest.mark.parametrize("norm", NORMS)
def test_dropout_of_one_drops_every_weight_as_sdpa_does(norm):
    """dropout_p = 1: zeros, and zero gradients for every input (SDPA and nn.Dropout(1.0) give
    zeros too), on every backend that takes the call; NaN in a term stays out."""
    q = torch.randn(B, H, L, D, **F64, requires_grad=True)
    k = torch.randn(B, H, L, D, **F64, requires_grad=True)
    v = torch.randn(B, H, L, 3, **F64, requires_grad=True)
    gate_table = torch.randn(H, 5, **F64).index_fill(1, torch.tensor([0]), math.nan)
    gate_table.requires_grad_(True)
    call = dict(gate=Toeplitz(gate_table), normalization=norm, is_causal=True)
    names = _accepting(q, k, v, **call)
    assert "reference" in names
    for name in names:
        out = attention(q, k, v, **call, dropout_p=1.0, backend=name)
        assert torch.equal(out, torch.zeros(B, H, L, 3, **F64)), name
        leaves = [q, k, v, gate_table]
        for g in torch.autograd.grad(out.sum(), leaves):
            assert torch.equal(g, torch.zeros_like(g)), name
    if norm == "softmax":
        plain = (q.detach(), k.detach(), v.detach())
        torch.testing.assert_close(
            attention(*plain, dropout_p=1.0, is_causal=True),
            F.scaled_dot_product_attention(*plain, dropout_p=1.0, is_causal=True),
        )


def test_blockwise_backward_with_an_empty_batch():
    """The first edition crashed here."""
    q, k, v = (torch.randn(0, 2, 5, 4, requires_grad=True) for _ in range(3))
    table = torch.randn(2, 9, requires_grad=True)
    out = blockwise_attention(q, k, v, bias=Toeplitz(table), gate=Toeplitz(table))
    out.sum().backward()
    assert torch.equal(table.grad, torch.zeros_like(table))


# ---------------------------------------------------------------------------------------------
# exp overflow


OVERFLOWING = [
    (torch.float32, 89.0),
    (torch.float64, 710.0),
    (torch.float16, 12.0),
    (torch.bfloat16, 90.0),
]


@pytest.mark.parametrize("dtype,logit", OVERFLOWING)
def test_exp_overflow_is_an_error_on_every_backend(dtype, logit):
    q = torch.zeros(1, 1, 3, 1, dtype=dtype)
    q[0, 0, 1] = 1.0
    k = torch.full((1, 1, 4, 1), logit, dtype=dtype)
    v = torch.ones(1, 1, 4, 2, dtype=dtype)
    names = _accepting(q, k, v, normalization="exp")
    assert names
    for name in names:
        with pytest.raises(ValueError, match="normalization='exp' overflowed"):
            attention(q, k, v, normalization="exp", scale=1.0, backend=name)
        # just below the limit (one key) is fine and exact
        ok = attention(
            q, k[:, :, :1] - 2.0, v[:, :, :1], normalization="exp", scale=1.0, backend=name
        )
        want = torch.tensor(logit - 2.0, dtype=torch.float64).exp()
        torch.testing.assert_close(ok[0, 0, 1].double(), want.expand(2), rtol=1e-2, atol=0)


def test_exp_overflow_is_an_error_under_vmap():
    q, k, v = _qkv()
    for name in _accepting(q, k, v, normalization="exp"):

        def run(q, name=name):
            return attention(q, k * 400, v, normalization="exp", backend=name)

        with pytest.raises(ValueError, match="overflowed"):
            torch.func.vmap(run)(q[None])


# ---------------------------------------------------------------------------------------------
# Backends agree


@pytest.mark.parametrize("norm,causal", list(itertools.product(NORMS, [False, True])))
def test_backends_agree_with_dropout_seed(norm, causal):
    """With an explicit dropout_seed the reference and every backend that accepts the seed agree
    with their own repeat; the blockwise kernel's mask is its own (tile-seeded), so it is compared
    with the reference through the mask it used (v = identity recovers the weights)."""
    q, k, _ = _qkv()
    eye = torch.eye(L, **F64).expand(B, H, L, L)
    call = dict(is_causal=causal, dropout_p=0.3, dropout_seed=11) | _normalization_call(norm)
    plain = attention(q, k, eye, **(call | dict(dropout_p=0.0)), backend="reference")
    for name in _accepting(q, k, eye, **call):
        weights = attention(q, k, eye, **call, backend=name)
        assert torch.equal(weights, attention(q, k, eye, **call, backend=name)), name
        kept = weights != 0
        torch.testing.assert_close(weights, plain * kept / 0.7)
