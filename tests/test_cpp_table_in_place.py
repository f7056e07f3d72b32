"""A Toeplitz table handed to the C++ forward as it is (kind 5, `TABLE_IN_PLACE`): read in place
where no offset of the call is clamped, and column by clamped column where some are; the same
output as its rows (kind 2) either way, an even width refused, never taken by the backward; the
decoding path hands every table over so, at any number of keys."""

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


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "lq,lk,width",
    [
        (1, 40, 2 * 38 + 1),  # an offset the table clamps
        (1, 2, 2 * 15 + 1),  # the rows' padding past the table
        (1, 1, 1),  # one entry for every offset
        (1, 700, 9),  # most keys on the far edge, tiles of keys wholly clamped
        (3, 40, 5),
        (16, 50, 21),
        (40, 600, 65),  # a long forward: the op takes it too (urpe hands it rows)
    ],
)
def test_a_table_that_clamps_offsets_reads_its_edge_columns(lq, lk, width, causal):
    """Past the table's reach every offset reads its edge column, as the rows built from the
    clamped table hold it: the same output, to the bit."""
    from urpe.kernels.cpp.arguments import KIND_CODES, TABLE_IN_PLACE, toeplitz_rows

    gen, q, k, v = _inputs(lq, lk)
    for heads in (1, 4):
        bias = torch.randn(heads, width, generator=gen, **F64)
        gate = torch.rand(heads, width, generator=gen, **F64) + 0.5
        rows = [toeplitz_rows(t, lq, lk, torch.float64) for t in (bias, gate)]
        toeplitz = KIND_CODES["toeplitz"]
        want, finite = _forward(q, k, v, toeplitz, rows[0], toeplitz, rows[1], causal)
        assert finite
        got, finite = _forward(q, k, v, TABLE_IN_PLACE, bias, TABLE_IN_PLACE, gate, causal)
        assert finite
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_table_of_even_width_is_refused():
    from urpe.kernels.cpp.arguments import KIND_CODES, TABLE_IN_PLACE

    _, q, k, v = _inputs(1, 2)
    with pytest.raises(RuntimeError, match="kind 5.*odd width"):
        _forward(q, k, v, KIND_CODES["none"], None, TABLE_IN_PLACE, torch.ones(4, 40, **F64))


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
def test_decoding_steps_read_their_tables_in_place_and_equal_the_reference(width, monkeypatch):
    """A growing cache through `urpe.attention`: the op gets the table (kind 5) at every step,
    before and past the table's reach (no rows built per step); every step equals the
    reference."""
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
    assert kinds == [TABLE_IN_PLACE] * len(range(2, 61))


def test_a_kept_kind_takes_each_calls_own_tables_and_other_tables_make_their_own_kind(
    monkeypatch,
):
    """A kind of call fixes the op's arguments but its terms' tensors (`OpArguments`): calls of
    a kept kind with other tables of the same shape hand the op those tables (in place for a
    decoding step at any keys; as rows for a chunk of more than CLAMPED_ROWS queries past the
    table's reach), and a table of another width or dtype, or a bias beside the gate, is
    another kind with arguments of its own. Every call equals the reference."""
    from urpe.kernels.cpp.arguments import KIND_CODES, TABLE_IN_PLACE

    given = []  # (bias's kind, bias, gate's kind, gate) as the op took them

    def recording(name: str, route: str, function):
        if name != "forward_if_finite":
            return function

        def recorded(*arguments):
            given.append((arguments[3], arguments[4], arguments[6], arguments[7]))
            return function(*arguments)

        return recorded

    dispatch.CALLS.clear()
    wrap_cpp_calls(monkeypatch, recording)
    gen, q, cache, _ = _inputs(1, 70)
    rows = KIND_CODES["toeplitz"]

    def table(width, dtype=torch.float64):
        return torch.rand(4, width, generator=gen, dtype=dtype) + 0.5

    # (bias table, gate table, queries, keys, the op's (bias kind, gate kind)): K = 20 reaches
    # 21 keys, and 37 queries need K >= 36 + 16 for their rows' padding
    steps = [
        (None, table(41), 1, 10, (0, TABLE_IN_PLACE)),
        (None, table(41), 1, 21, (0, TABLE_IN_PLACE)),  # the kept kind, a new table
        (None, table(41), 1, 22, (0, TABLE_IN_PLACE)),  # past its reach: clamped in place
        (None, table(41), 1, 12, (0, TABLE_IN_PLACE)),
        (None, table(81), 1, 30, (0, TABLE_IN_PLACE)),  # another width: its own kind
        (None, table(13), 1, 30, (0, TABLE_IN_PLACE)),  # narrower than the padding
        (table(41), table(41), 1, 12, (TABLE_IN_PLACE, TABLE_IN_PLACE)),
        (table(13), table(41), 1, 12, (TABLE_IN_PLACE, TABLE_IN_PLACE)),
        (None, table(41), 1, 15, (0, TABLE_IN_PLACE)),  # the first kind again
        (None, table(121), 37, 50, (0, TABLE_IN_PLACE)),  # a chunk the table covers
        (None, table(121), 37, 62, (0, rows)),  # the same kind past its reach: rows
    ]
    with torch.no_grad():
        for bias, gate, lq, lk, _ in steps:
            k = cache[:1, :, :lk].contiguous()
            v = k.flip(-1).contiguous()
            terms = dict(gate=Toeplitz(gate), bias=None if bias is None else Toeplitz(bias))
            queries = cache[:1, :, :lq].repeat(1, 2, 1, 1)  # (1, 4, Lq, 8)
            out = attention(queries, k, v, **terms, is_causal=True, enable_gqa=True)
            want = attention(
                queries, k, v, **terms, is_causal=True, enable_gqa=True, backend="reference"
            )
            torch.testing.assert_close(out, want)
        # half-precision queries take a float32 table as it is and a float16 one converted
        # (computed in float32): the table's dtype is part of the kind
        half = dict(is_causal=True, enable_gqa=True)
        k = cache[:1, :, :12].half()
        for dtype in (torch.float32, torch.float16, torch.float32):
            gate = table(41, dtype)
            out = attention(q[:1].half(), k, k.flip(-1), gate=Toeplitz(gate), **half)
            want = attention(
                q[:1].half(), k, k.flip(-1), gate=Toeplitz(gate), **half, backend="reference"
            )
            torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
            steps.append((None, gate, 1, 12, (0, TABLE_IN_PLACE)))
    dispatch.CALLS.clear()
    assert [(b, g) for b, _, g, _ in given] == [codes for *_, codes in steps]
    for (bias, gate, *_), (bias_kind, op_bias, gate_kind, op_gate) in zip(
        steps, given, strict=True
    ):
        if gate_kind == TABLE_IN_PLACE:  # the call's own table, or its float32 copy
            assert (
                op_gate is gate
                if gate.dtype != torch.float16
                else torch.equal(op_gate, gate.float())
            )
        if bias_kind == TABLE_IN_PLACE:
            assert op_bias is bias
