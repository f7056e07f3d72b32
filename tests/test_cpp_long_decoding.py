"""Decoding calls against long caches on the C++ kernel (one query row per head, Lk in the
thousands, D = 64): the products run as loops over the whole cache, float32, float64 and
bfloat16, which find NaN/inf in what they compute instead of a pass over the cache first.
Answers are compared with the reference in float64, NaN placements with the non-finite rule."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import Toeplitz, attention
from urpe.kernels.cpp import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

BAD = (float("nan"), float("inf"), -float("inf"))
TOLERANCE = {
    torch.float64: dict(atol=1e-10, rtol=1e-8),
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),  # weights rounded to bfloat16, as SDPA's
}


def _op_call(q, k, v, table=None, key_padding=None):
    """forward_if_finite's (out, finite): softmax, causal, a Toeplitz gate as rows."""
    from urpe.kernels.cpp.arguments import (
        FORWARD_TILES,
        KIND_CODES,
        NORMALIZATION_CODES,
        toeplitz_rows,
    )

    gate_kind = KIND_CODES["none" if table is None else "toeplitz"]
    dtype = torch.float32 if q.dtype == torch.bfloat16 else q.dtype
    rows = None if table is None else toeplitz_rows(table, q.shape[2], k.shape[2], dtype)
    return torch.ops.urpe_cpp.forward_if_finite(
        q, k, v, KIND_CODES["none"], None, None, gate_kind, rows, None, None, None,
        key_padding, True, NORMALIZATION_CODES["softmax"], q.shape[-1] ** -0.5, *FORWARD_TILES,
    )  # fmt: skip


def _case(lk, dtype, seed=0, heads=3, dim=64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, n, dim, generator=gen).to(dtype) for n in (1, lk, lk))
    table = torch.rand(heads, 2 * lk - 1, generator=gen, dtype=torch.float64) + 0.5
    pad = torch.rand(2, lk, generator=gen) < 0.2
    return gen, (q, k, v), table, pad


def _compute(dtype):
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _reference(q, k, v, table, pad):
    """The reference in float64 on the same (rounded) inputs."""
    wide = [t.to(torch.float64) for t in (q, k, v)]
    gate = None if table is None else Toeplitz(table)
    return attention(*wide, gate=gate, key_padding_mask=pad, is_causal=True, backend="reference")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("lk", [700, 3000])
def test_long_cache_answers_are_the_reference_s(dtype, gated, lk):
    _, (q, k, v), table, pad = _case(lk, dtype)
    table = table if gated else None
    want = _reference(q, k, v, table, pad)
    out, finite = _op_call(q, k, v, table if table is None else table.to(_compute(dtype)), pad)
    assert finite  # answered by the products themselves, with no pass over the cache first
    torch.testing.assert_close(out.to(torch.float64), want, **TOLERANCE[dtype])
    with torch.no_grad():  # the same through urpe.attention
        gate = None if table is None else Toeplitz(table.to(_compute(dtype)))
        got = attention(q, k, v, gate=gate, key_padding_mask=pad, is_causal=True, backend="cpp")
    assert got.dtype == dtype
    torch.testing.assert_close(got.to(torch.float64), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_entries_in_a_long_cache_follow_the_rule(dtype):
    """NaN/inf in q, k or v, in keys seen or padded: the op answers the rule's answer or refuses
    (then only where something is non-finite), and urpe.attention gives the rule's answer."""
    answered = refused = 0
    for seed in range(12):
        gen, (q, k, v), table, pad = _case(2500, dtype, seed)
        for _ in range(1 + seed % 3):
            target = (q, k, v)[int(torch.randint(0, 3, (1,), generator=gen))]
            index = tuple(int(torch.randint(0, n, (1,), generator=gen)) for n in target.shape)
            target[index] = BAD[seed % 3]
        want = _reference(q, k, v, table, pad)
        out, finite = _op_call(q, k, v, table.to(torch.float32), pad)
        if finite:
            answered += 1
            torch.testing.assert_close(out.to(torch.float64), want, equal_nan=True,
                                       **TOLERANCE[dtype])  # fmt: skip
        else:
            refused += 1
            assert not all(t.isfinite().all() for t in (q, k, v))
        with torch.no_grad():
            got = attention(q, k, v, gate=Toeplitz(table.to(torch.float32)), key_padding_mask=pad,
                            is_causal=True, backend="cpp")  # fmt: skip
        torch.testing.assert_close(got.to(torch.float64), want, equal_nan=True, **TOLERANCE[dtype])
    assert refused > 0  # a seen NaN/inf is found in the logits or outputs


def test_a_nan_in_a_far_value_row_is_found():
    """One NaN in the value row of the first of 4,000 cached keys (read last by nothing else):
    the output row of that head is NaN, every other row finite."""
    _, (q, k, v), table, _ = _case(4000, torch.float32, heads=2)
    v[1, 0, 0, 17] = float("nan")
    out, finite = _op_call(q, k, v, table.to(torch.float32))
    assert not finite
    with torch.no_grad():
        got = attention(q, k, v, gate=Toeplitz(table.to(torch.float32)), is_causal=True)
    assert got[1, 0].isnan().all() and got[0].isfinite().all() and got[1, 1].isfinite().all()


@pytest.mark.parametrize("dim,vdim", [(13, 29), (72, 136), (3, 70)])
@pytest.mark.parametrize("lk", [5, 301])
def test_head_widths_off_the_register_blocks(dim, vdim, lk):
    """Widths that are no multiple of the one-row products' register blocks (8 entries of q.k,
    64 and 8 output columns) and caches of keys that are no multiple of 8: the reference's
    answer, gated or not; a NaN in the last entry of a key row or of a value row is found."""
    gen = torch.Generator().manual_seed(lk + dim)
    q, k = (torch.randn(1, 2, n, dim, generator=gen) for n in (1, lk))
    v = torch.randn(1, 2, lk, vdim, generator=gen)
    table = torch.rand(2, 2 * lk - 1, generator=gen, dtype=torch.float64) + 0.5
    for gated in (False, True):
        gate = Toeplitz(table.to(torch.float32)) if gated else None
        want = _reference(q, k, v, table if gated else None, None)
        with torch.no_grad():
            got = attention(q, k, v, gate=gate, is_causal=True, backend="cpp")
        torch.testing.assert_close(got.to(torch.float64), want, **TOLERANCE[torch.float32])
    for target in (k, v):
        target[0, 1, lk - 1, -1] = float("nan")
        out, finite = _op_call(q, k, v)
        assert not finite
        target[0, 1, lk - 1, -1] = 0.0
