"""NaN and inf in packed rows with a padded tail, on the C++ kernel's call without gradient.

That call finds non-finite numbers in the rows of q, k and v that the tiles it computes read,
never in those of the tiles it skips (a padded tail is not read at all): these tests hold it to
the non-finite rule of `urpe.kernels.nonfinite` as the reference applies it (float64), with NaN
and inf in hidden and in visible queries, keys and values, under every normalisation, and check
that a NaN in the skipped tail costs no pass over q, k and v."""

from __future__ import annotations

import itertools

import pytest
import torch

from urpe.kernels import NORMALIZATIONS, Toeplitz, attention
from urpe.kernels.cpp import cpp_attention, unavailable
from urpe.kernels.nonfinite import FINITE_CHECKS

from .test_cpp_padded_tiles import SHAPES, TILES, tail_case

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

# where the non-finite number sits: (tensor, position given (Lq, Lk), value). In every shape of
# SHAPES the last key is padded in each row, and the key at the first query's position is real
# and seen by that query.
PLACES = {
    "padded_key": ("k", lambda lq, lk: lk - 1, float("nan")),
    "padded_value": ("v", lambda lq, lk: lk - 1, float("inf")),
    "padded_query": ("q", lambda lq, lk: lq - 1, float("nan")),
    "real_key": ("k", lambda lq, lk: lk - lq, float("-inf")),
    "real_value": ("v", lambda lq, lk: lk - lq, float("nan")),
    "real_query": ("q", lambda lq, lk: 0, float("inf")),
}
TAILS = ("padding", "padding_document", "distinct_ids", "distinct_ids+padding")


def poisoned(shape, tail, terms, causal, place):
    (q, k, v), _, call = tail_case(shape, tail, terms, causal)
    qkv = {"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone()}
    name, position, value = PLACES[place]
    lq, lk = q.shape[2], k.shape[2]
    qkv[name][0, 0, position(lq, lk), 1] = value  # one entry of one row of batch row 0, head 0
    return (qkv["q"], qkv["k"], qkv["v"]), call


def assert_matches_reference(qkv, call, block_q=0, block_k=0):
    with torch.no_grad():
        want = attention(*qkv, **call, backend="reference")
        got = cpp_attention(*qkv, **call, block_q=block_q, block_k=block_k)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8, equal_nan=True)
    return got


CASES = [
    (norm, tail, place, SHAPES[n % 2], n % 2 == 1, TILES[n % len(TILES)])
    for n, (norm, tail, place) in enumerate(itertools.product(NORMALIZATIONS, TAILS, PLACES))
]


def case_of(norm, tail, place, shape, causal):
    """A CASES entry's q, k, v and call (Toeplitz bias and gate, the normalisation set)."""
    qkv, call = poisoned(shape, tail, "toeplitz+toeplitz_gate", causal, place)
    call.update(normalization=norm, scale=0.1 if norm == "exp" else None)
    return qkv, call


@pytest.mark.parametrize(("norm", "tail", "place", "shape", "causal", "tiles"), CASES)
def test_nonfinite_numbers_in_a_padded_row_follow_the_rule(norm, tail, place, shape, causal, tiles):
    qkv, call = case_of(norm, tail, place, shape, causal)
    out = assert_matches_reference(qkv, call, *tiles)
    if place.startswith("real"):  # (the rule's NaN reaches some output: the test can fail)
        assert out.isnan().any()


@pytest.mark.parametrize("tail", ["padding_document", "distinct_ids+padding"])
def test_a_nan_value_behind_a_zero_weight_still_poisons_the_row(tail):
    """The rule makes a row NaN where it sees a NaN value, also where the gate gives that key a
    weight of exactly 0: the kernel checks the value rows themselves (a product may skip a 0)."""
    qkv, call = poisoned(SHAPES[0], tail, "dense_gate", False, "real_value")
    gate = call["gate"].detach().clone()
    gate[..., 0] = 0.0  # every query's weight on key 0 (whose value holds the NaN)
    call["gate"] = gate
    out = assert_matches_reference(qkv, call, 4, 8)
    assert out[0, 0, :9].isnan().all()  # the first document's queries see key 0


@pytest.mark.parametrize("place", ["real_key", "padded_value"])
def test_dropout_and_nonfinite_numbers(place):
    qkv, call = poisoned(SHAPES[2], "padding_document", "relation_gate", True, place)
    call.update(dropout_p=0.25, dropout_seed=3)
    assert_matches_reference(qkv, call)


@pytest.mark.parametrize("tail", ["padding", "padding_document", "distinct_ids+padding"])
def test_a_nan_in_the_skipped_tail_costs_no_pass_over_q_k_v(tail, monkeypatch):
    """The call that needs no gradient answers without asking whether q, k and v are finite:
    a NaN in a padded key that no tile reads leaves it on its fast route."""
    asked = []
    check = FINITE_CHECKS["cpu"]
    monkeypatch.setitem(FINITE_CHECKS, "cpu", lambda tensors: asked.append(1) or check(tensors))
    qkv, call = poisoned(SHAPES[0], tail, "toeplitz+toeplitz_gate", False, "padded_key")
    assert_matches_reference(qkv, call, 4, 8)
    # (the reference asks once itself; the kernel's call not at all)
    with torch.no_grad():
        asked.clear()
        cpp_attention(*qkv, **call, block_q=4, block_k=8)
    assert asked == []


@pytest.mark.parametrize("place", ["padded_key", "real_value"])
def test_bfloat16_operands_with_a_padded_tail(place):
    qkv, call = poisoned(SHAPES[0], "padding_document", "toeplitz+toeplitz_gate", False, place)
    qkv = tuple(t.to(torch.bfloat16) for t in qkv)
    call = {
        name: term.to(torch.float32) if isinstance(term, torch.Tensor) and term.is_floating_point()
        else term
        for name, term in call.items()
    }  # fmt: skip
    with torch.no_grad():
        want = attention(*qkv, **call, backend="reference")
        got = cpp_attention(*qkv, **call, block_q=4, block_k=8)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, equal_nan=True)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("norm", NORMALIZATIONS)
def test_float32_rows_of_one_key_check_their_value_rows(norm, value):
    """float32 rows that meet one key in their first tile (a padded token with its own id) are
    written in one pass past the caches that also checks them (short_runs.h, `stream_scaled`):
    a NaN or inf in such a key's value row still reaches the rule, and the other rows match."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 80, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    v[0, 1, 70, 3] = value  # the value row of padded token 70, seen by query 70 alone
    positions = torch.arange(80)
    # 16 real tokens: the tail's query groups hold padded tokens only (all short rows)
    ids = torch.where(positions < 16, positions // 8, 1000 + positions)[None]  # (1, 80)
    table = torch.rand(2, 9, generator=gen, dtype=torch.float64) + 0.5

    def call(dtype):
        scale = 0.1 if norm == "exp" else None
        gate = Toeplitz(table.to(dtype))
        return dict(document_ids=ids, gate=gate, normalization=norm, scale=scale)

    with torch.no_grad():
        want = attention(q, k, v, **call(torch.float64), backend="reference")
        got = cpp_attention(q.float(), k.float(), v.float(), **call(torch.float32))
    assert want.isnan().any()  # (the rule's NaN reaches other rows: the test can fail)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-4, equal_nan=True)
