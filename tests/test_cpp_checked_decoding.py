"""Decoding-sized calls whose q, k and v the C++ kernel checks by the logits and outputs it
computes instead of up front (`urpe_cpp::forward_if_finite`, one query row per head): whatever
NaN/inf the inputs hold and wherever (seen, hidden, under a zero weight), the answer is the
non-finite rule's, on the op and through `urpe.attention`."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import Toeplitz, attention, dispatch
from urpe.kernels.cpp import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

BAD = (float("nan"), float("inf"), -float("inf"))


def _op_call(q, k, v, gate=None, float_mask=None, key_padding=None, causal=True):
    """forward_if_finite's (out, finite) for these tensors, softmax, a Toeplitz gate as rows."""
    from urpe.kernels.cpp.arguments import (
        FORWARD_TILES,
        KIND_CODES,
        NORMALIZATION_CODES,
        toeplitz_rows,
    )

    gate_kind = KIND_CODES["none" if gate is None else "toeplitz"]
    rows = None if gate is None else toeplitz_rows(gate, q.shape[2], k.shape[2], q.dtype)
    return torch.ops.urpe_cpp.forward_if_finite(
        q, k, v, KIND_CODES["none"], None, None, gate_kind, rows, None, float_mask, None,
        key_padding, causal, NORMALIZATION_CODES["softmax"], q.shape[-1] ** -0.5, *FORWARD_TILES,
    )  # fmt: skip


def _inputs(lq, lk, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, d, generator=gen, dtype=dtype) for n in (lq, lk, lk))
    return gen, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lq,lk,d", [(1, 1, 8), (1, 13, 8), (1, 600, 8), (2, 40, 16), (4, 600, 8)])
def test_every_non_finite_placement_gives_the_rules_answer(dtype, lq, lk, d):
    """Random NaN/inf entries in q, k or v, seen or hidden by padding, behind a zero gate entry
    or a float mask that drives a weight to exactly 0: whenever the op answers, its answer is
    the reference's (NaN rows included); finite inputs are always answered."""
    answered = 0
    for seed in range(40):
        gen, q, k, v = _inputs(lq, lk, d, dtype, seed)
        table = torch.rand(3, 2 * lk - 1, generator=gen, dtype=dtype) + 0.5
        table[:, torch.randint(0, 2 * lk - 1, (3,), generator=gen)] = 0.0  # zero weights
        pad = torch.rand(2, lk, generator=gen) < 0.3
        mask = torch.zeros(2, 1, lq, lk, dtype=dtype)
        mask[..., torch.randint(0, lk, (2,), generator=gen)] = -1e4  # exp underflows to 0
        out, finite = _op_call(q, k, v, table, mask, pad)
        assert finite
        for _ in range(1 + seed % 3):
            target = (q, k, v)[int(torch.randint(0, 3, (1,), generator=gen))]
            index = tuple(int(torch.randint(0, n, (1,), generator=gen)) for n in target.shape)
            target[index] = BAD[seed % 3]
        out, finite = _op_call(q, k, v, table, mask, pad)
        want = attention(
            q, k, v, gate=Toeplitz(table), attn_mask=mask, key_padding_mask=pad, is_causal=True,
            backend="reference",
        )  # fmt: skip
        if finite:
            answered += 1
            torch.testing.assert_close(out, want, equal_nan=True)
        else:  # refused: something non-finite was there
            assert not all(t.isfinite().all() for t in (q, k, v))
    assert answered < 40  # most placements reach a computed pair and are refused


@pytest.mark.parametrize(
    "where",
    ["value under a zero gate", "value under an underflowing weight", "key, zero query entry"],
)
def test_a_non_finite_entry_a_query_sees_is_never_missed(where):
    """The cases where arithmetic could hide a NaN/inf: 0 * inf in the weights times values,
    and a key's inf times a query's 0. The row that sees it is NaN, as the rule says."""
    _, q, k, v = _inputs(1, 24, 8, torch.float64, 0)
    table = torch.ones(3, 47, dtype=torch.float64)
    mask = torch.zeros(2, 1, 1, 24, dtype=torch.float64)
    if where == "value under a zero gate":
        table[:, 23 - 5] = 0.0  # offset j - i = -5: key 18 of the last query
        v[1, 2, 18, 3] = float("inf")
    elif where == "value under an underflowing weight":
        mask[1, 0, 0, 7] = -1e5
        v[1, 2, 7, 0] = float("nan")
    else:
        q[1, 2, 0, 4] = 0.0
        k[1, 2, 11, 4] = float("inf")
    out, finite = _op_call(q, k, v, table, mask)
    assert not finite
    with torch.no_grad():
        dispatch.CALLS.clear()
        for _ in range(2):  # the second call takes the remembered one-call path
            got = attention(q, k, v, gate=Toeplitz(table), attn_mask=mask, is_causal=True)
    assert got[1, 2].isnan().all() and got[0].isfinite().all() and got[1, :2].isfinite().all()
