"""Every call SDPA can express, on every backend that can run it, against SDPA itself.

F.scaled_dot_product_attention is an independent implementation of softmax attention, so these
tests pin down urpe's meaning of attn_mask (bool and float, broadcast), enable_gqa, leading batch
dims, scale and the causal alignment. Forward and every gradient, in float64.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from urpe.kernels import attention, native_backends, select_backend
from urpe.kernels.cpp import unavailable

# The backends built for the CPU (the GPU ones have their own tests: test_triton, test_flex).
CPU_BACKENDS = native_backends("cpu")

F64 = dict(dtype=torch.float64)


def _runs(name: str, q, k, v, **kwargs) -> bool:
    try:
        select_backend(name, q, k, v, **kwargs)
    except ValueError:
        return False
    return True


def _same_call(a: dict, b: dict) -> bool:
    def same(x, y):
        return x is y or (not isinstance(x, torch.Tensor) and x == y)

    return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)


def _compare(q, k, v, sdpa_kwargs: dict, urpe_kwargs: dict, extra: tuple = ()):
    """Output and gradients (q, k, v and the `extra` leaves) of SDPA and of every backend."""
    leaves = [q, k, v, *extra]
    want = F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
    weight = torch.randn(want.shape, **F64)
    want_grads = torch.autograd.grad((want * weight).sum(), leaves)
    ran = set()
    for name in CPU_BACKENDS:
        if name == "sdpa" and _same_call(urpe_kwargs, sdpa_kwargs):
            continue  # the sdpa backend would pass the very same call on: nothing to compare
        if not _runs(name, q, k, v, **urpe_kwargs):
            continue
        got = attention(q, k, v, **urpe_kwargs, backend=name)
        torch.testing.assert_close(
            got, want, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}"
        )
        grads = torch.autograd.grad((got * weight).sum(), leaves)
        for i, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            message = lambda m, n=name, i=i: f"{n}, grad {i}: {m}"  # noqa: E731
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=message)
        ran.add(name)
    # the reference and the tiled kernels (cpp where it is built) run every plain softmax call
    assert {"reference", "blockwise", *(["cpp"] if unavailable() is None else [])} <= ran, ran
    return ran


def _qkv(batch=(2,), h=3, hkv=None, lq=5, lk=7, d=4, dv=3):
    hkv = h if hkv is None else hkv
    q = torch.randn(*batch, h, lq, d, **F64, requires_grad=True)
    k = torch.randn(*batch, hkv, lk, d, **F64, requires_grad=True)
    v = torch.randn(*batch, hkv, lk, dv, **F64, requires_grad=True)
    return q, k, v


# (batch dims, attn_mask shape) pairs: every broadcast pattern SDPA accepts
MASK_SHAPES = [
    ((2,), (5, 7)),
    ((2,), (2, 3, 5, 7)),
    ((2,), (2, 1, 5, 7)),
    ((2,), (1, 3, 1, 7)),
    ((2,), (7,)),
    ((2,), (5, 1)),
    ((), (3, 5, 7)),
    ((2, 4), (4, 1, 5, 7)),
    ((2, 4), (2, 1, 1, 1, 7)),
]


def _for_sdpa(mask):
    # SDPA wants a mask of rank >= 2; the broadcast meaning of a (Lk,) mask is the same
    return mask.expand(5, 7) if mask.dim() == 1 else mask


@pytest.mark.parametrize("batch,shape", MASK_SHAPES, ids=str)
def test_bool_attn_mask(batch, shape):
    q, k, v = _qkv(batch)
    mask = torch.rand(shape) < 0.7
    if len(shape) >= 2 and shape[-2] == 5:
        mask[..., 1, :] = False  # a row with nothing visible: 0 in SDPA and in urpe
    _compare(q, k, v, dict(attn_mask=_for_sdpa(mask)), dict(attn_mask=mask))


@pytest.mark.parametrize("batch,shape", MASK_SHAPES, ids=str)
def test_float_attn_mask_gets_its_gradient(batch, shape):
    q, k, v = _qkv(batch)
    mask = torch.randn(shape, **F64)
    mask = mask.masked_fill(torch.rand(shape) < 0.2, float("-inf")).requires_grad_()
    _compare(q, k, v, dict(attn_mask=_for_sdpa(mask)), dict(attn_mask=mask), extra=(mask,))


@pytest.mark.parametrize("hkv", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_attention(hkv, masked):
    q, k, v = _qkv((2,), h=6, hkv=hkv)
    mask = torch.rand(2, 6, 5, 7) < 0.6 if masked else None
    kwargs = dict(attn_mask=mask, enable_gqa=True)
    _compare(q, k, v, kwargs, kwargs)


@pytest.mark.parametrize("batch", [(), (3,), (2, 2), (1, 2, 2)], ids=str)
def test_leading_batch_dims(batch):
    q, k, v = _qkv(batch, lq=4, lk=4)
    _compare(q, k, v, dict(is_causal=True, scale=0.3), dict(is_causal=True, scale=0.3))


@pytest.mark.parametrize("lq,lk", [(1, 1), (4, 4), (9, 9)])
def test_is_causal_when_the_alignments_agree(lq, lk):
    q, k, v = _qkv((2,), lq=lq, lk=lk)
    _compare(q, k, v, dict(is_causal=True), dict(is_causal=True))


@pytest.mark.parametrize("lq,lk", [(2, 7), (5, 7), (7, 3)])
def test_causal_alignment_when_lengths_differ(lq, lk):
    """urpe: query i sees keys j <= i + Lk - Lq (bottom-right); SDPA: j <= i (top-left).
    Each rule is tested against SDPA given the other's explicit mask."""
    q, k, v = _qkv((2,), lq=lq, lk=lk)
    bottom_right = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    top_left = torch.ones(lq, lk, dtype=torch.bool).tril()
    _compare(q, k, v, dict(attn_mask=bottom_right), dict(is_causal=True))
    _compare(q, k, v, dict(is_causal=True), dict(attn_mask=top_left))
    # the two rules really differ at these lengths: urpe's is_causal is not SDPA's
    with torch.no_grad():
        ours = attention(q, k, v, is_causal=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(ours, theirs)


def test_causal_with_attn_mask_and_padding_combine_as_and():
    q, k, v = _qkv((2,), lq=6, lk=6)
    mask = torch.rand(2, 3, 6, 6) < 0.7
    padding = torch.tensor([[False] * 5 + [True], [True] + [False] * 5])
    combined = mask & torch.ones(6, 6, dtype=torch.bool).tril() & ~padding[:, None, None, :]
    ran = _compare(
        q,
        k,
        v,
        dict(attn_mask=combined),
        dict(attn_mask=mask, is_causal=True, key_padding_mask=padding),
    )
    # the sdpa backend folds padding and the causal rule into one mask of its own: a real
    # comparison against SDPA given the combined mask, not SDPA against itself
    assert "sdpa" in ran


def test_bias_and_float_mask_add_up():
    q, k, v = _qkv((2,))
    bias = torch.randn(3, 5, 7, **F64, requires_grad=True)
    mask = torch.randn(2, 1, 5, 7, **F64, requires_grad=True)
    _compare(
        q, k, v, dict(attn_mask=bias + mask), dict(attn_mask=mask, bias=bias), extra=(bias, mask)
    )


def test_sdpa_positional_arguments():
    """urpe.attention takes SDPA's arguments in SDPA's order (scale and enable_gqa, keyword-only
    in SDPA, may also be given by position)."""
    q, k, v = _qkv((2,), h=4, hkv=2, lq=5, lk=5)
    mask = torch.rand(5, 5) < 0.8
    want = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.7, enable_gqa=True)
    torch.testing.assert_close(
        attention(q, k, v, mask, 0.0, False, scale=0.7, enable_gqa=True), want
    )
    torch.testing.assert_close(attention(q, k, v, mask, 0.0, False, 0.7, True), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_close_to_sdpa(dtype):
    q, k, v = (t.detach().to(dtype) for t in _qkv((2,), lq=9, lk=9))
    mask = torch.rand(9, 9) < 0.8
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, causal in itertools.product(CPU_BACKENDS, (False, True)):
        want = F.scaled_dot_product_attention(
            q.double(),
            k.double(),
            v.double(),
            attn_mask=mask & torch.ones(9, 9).tril().bool() if causal else mask,
        )
        got = attention(q, k, v, mask, is_causal=causal, backend=name)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
