"""A Toeplitz table handed to the C++ forward as it is (kind 5, `TABLE_IN_PLACE`), read in place
where no offset of the call is clamped: the same output as its rows (kind 2), refused where it
would not be, and never taken by the backward; the decoding path uses it for wide tables."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import Toeplitz, attention, dispatch
from urpe.kernels.cpp import unavailable

from .cpp_calls import wrap_cpp_calls

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

F64 = dict(dtype=torch.float64)


def _forward(q, k, v, bias_kind, bias, gate_kind, gate, causal=True):
    from urpe.kernels.cpp.arguments import FORWARD_TILES, NORMALIZATION_CODES

    return torch.ops.urpe_cpp.forward_if_finite(
        q, k, v, bias_kind, bias, None, gate_kind, gate, None, None, None, None, causal,
        NORMALIZATION_CODES["softmax"], q.shape[-1] ** -0.5, *FORWARD_TILES,
    )  # fmt: skip


def _inputs(lq, lk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, lq, 8, generator=gen, **F64)
    k, v = (torch.randn(2, 2, lk, 8, generator=gen, **F64) for _ in range(2))
    return gen, q, k, v


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 2), (1, 33), (3, 40), (16, 16), (16, 50)])
def test_a_table_read_in_place_gives_what_its_rows_give(lq, lk, heads):
    from urpe.kernels.cpp.arguments import KIND_CODES, LANES, TABLE_IN_PLACE, toeplitz_rows

    gen, q, k, v = _inputs(lq, lk)
    reach = max(lk - 1, lq - 1 + LANES)
    for width in (2 * reach + 1, 2 * reach + 7):  # the narrowest it takes, and a wider one
        bias = torch.randn(heads, width, generator=gen, **F64)
        gate = torch.rand(heads, width, generator=gen, **F64) + 0.5
        rows = [toeplitz_rows(t, lq, lk, torch.float64) for t in (bias, gate)]
        toeplitz = KIND_CODES["toeplitz"]
        want, finite = _forward(q, k, v, toeplitz, rows[0], toeplitz, rows[1])
        assert finite
        got, finite = _forward(q, k, v, TABLE_IN_PLACE, bias, TABLE_IN_PLACE, gate)
        assert finite
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "lq,lk,width,why",
    [
        (1, 40, 2 * 38 + 1, "an offset the table clamps"),
        (1, 2, 2 * 15 + 1, "the rows' padding past the table"),
        (1, 2, 2 * 20, "an even width"),
    ],
)
def test_a_table_that_does_not_cover_the_call_is_refused(lq, lk, width, why):
    from urpe.kernels.cpp.arguments import KIND_CODES, TABLE_IN_PLACE

    _, q, k, v = _inputs(lq, lk)
    table = torch.ones(4, width, **F64)
    with pytest.raises(RuntimeError, match="kind 5"):
        _forward(q, k, v, KIND_CODES["none"], None, TABLE_IN_PLACE, table)


def test_the_backward_refuses_a_table_in_place():
    from urpe.kernels.cpp.arguments import (
        BACKWARD_TILES,
        KIND_CODES,
        NORMALIZATION_CODES,
        TABLE_IN_PLACE,
    )

    _, q, k, v = _inputs(1, 4)
    out = torch.zeros(2, 4, 1, 8, **F64)
    with pytest.raises(RuntimeError, match="not tables"):
        torch.ops.urpe_cpp.backward(
            out, torch.zeros(2, 4, 1, **F64), out, q, k, v, KIND_CODES["none"], None, None,
            TABLE_IN_PLACE, torch.ones(4, 41, **F64), None, None, None, None, None, None, True,
            NORMALIZATION_CODES["softmax"], 0.3, 0.0, 0, None, *BACKWARD_TILES, False, True,
            False, 4,
        )  # fmt: skip


@pytest.mark.parametrize("width", [9, 2 * 40 + 1, 511])
def test_decoding_steps_read_wide_tables_in_place_and_equal_the_reference(width, monkeypatch):
    """A growing cache through `urpe.attention`: while the table covers every offset the op
    gets the table (kind 5), past that its rows; every step equals the reference."""
    from urpe.kernels.cpp.arguments import TABLE_IN_PLACE

    kinds = []

    def recording(name: str, route: str, function):
        if name != "forward_if_finite":
            return function

        def recorded(*arguments):
            kinds.append(arguments[6])  # the gate's kind
            return function(*arguments)

        return recorded

    dispatch.CALLS.clear()
    wrap_cpp_calls(monkeypatch, recording)
    gen, q, cache, _ = _inputs(1, 60)
    q = q[:1]
    gate = Toeplitz(torch.rand(4, width, generator=gen, **F64) + 0.5)
    with torch.no_grad():
        for lk in range(2, 61):
            k = cache[:1, :, :lk].contiguous()
            v = k.flip(-1).contiguous()
            out = attention(q, k, v, gate=gate, enable_gqa=True)
            want = attention(q, k, v, gate=gate, enable_gqa=True, backend="reference")
            torch.testing.assert_close(out, want)
    dispatch.CALLS.clear()
    reach = (width - 1) // 2
    in_place = [lk for lk, kind in zip(range(2, 61), kinds, strict=True) if kind == TABLE_IN_PLACE]
    assert in_place == [lk for lk in range(2, 61) if max(lk - 1, 16) <= reach]
