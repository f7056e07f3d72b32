"""NaN and inf in q, k, v on the C++ kernel's calls with gradients.

In plain eager mode such a call asks nobody up front whether q, k and v are finite: its forward
(`urpe_cpp::forward_checked_with_stat`) finds NaN/inf in the rows its computed tiles read and
hands back no result where it met one; the non-finite rule (`urpe.kernels.nonfinite`) then runs.
These tests hold the output and every gradient (q, k, v, the bias's and the gate's tables) to
the reference's in float64, with NaN and inf in hidden and visible rows of packed calls with a
padded tail, under every normalisation, and check that a NaN in the skipped tail costs no pass
over q, k and v."""

from __future__ import annotations

import itertools

import pytest
import torch

from urpe.kernels import attention
from urpe.kernels.cpp import cpp_attention, unavailable
from urpe.kernels.nonfinite import FINITE_CHECKS

from .test_cpp_padded_nonfinite import CASES, case_of, poisoned
from .test_cpp_padded_tiles import SHAPES

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")


def _leaves(qkv, call) -> list[torch.Tensor]:
    """q, k, v as fresh leaves, then the terms' tensors that want a gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    for name in ("bias", "gate"):
        term = call.get(name)
        table = getattr(term, "table", None)
        if table is not None and table.requires_grad:
            leaves.append(table)
    return leaves


def _output_and_grads(backend_call, qkv, call):
    """(output, gradients of q, k, v and the terms' tables) for a fixed dO."""
    leaves = _leaves(qkv, call)
    out = backend_call(*leaves[:3], **call)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return out.detach(), grads


def assert_gradients_match_reference(qkv, call, block_q=0, block_k=0):
    want, want_grads = _output_and_grads(
        lambda *t, **c: attention(*t, **c, backend="reference"), qkv, call
    )
    got, got_grads = _output_and_grads(
        lambda *t, **c: cpp_attention(*t, **c, block_q=block_q, block_k=block_k), qkv, call
    )
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8, equal_nan=True)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.isfinite().all()  # (NaN rows pass no gradient back)
            torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-7)
    return got


@pytest.mark.parametrize(("norm", "tail", "place", "shape", "causal", "tiles"), CASES)
def test_gradients_with_nonfinite_numbers_follow_the_rule(norm, tail, place, shape, causal, tiles):
    qkv, call = case_of(norm, tail, place, shape, causal)
    out = assert_gradients_match_reference(qkv, call, *tiles)
    if place.startswith("real"):  # (the rule's NaN reaches some output: the test can fail)
        assert out.isnan().any()


@pytest.mark.parametrize("place", ["real_key", "padded_value", "real_query"])
def test_gradients_with_dropout_and_nonfinite_numbers(place):
    qkv, call = poisoned(SHAPES[2], "padding_document", "relation_gate", True, place)
    call.update(dropout_p=0.25, dropout_seed=3)
    assert_gradients_match_reference(qkv, call)


@pytest.mark.parametrize("tail", ["padding", "padding_document", "distinct_ids+padding"])
def test_a_gradient_call_with_a_nan_in_the_skipped_tail_asks_nobody(tail, monkeypatch):
    """Neither the finite call nor one with a NaN in a padded key that no tile reads asks
    whether q, k and v are finite (no pass over them before the kernel)."""
    asked = []
    check = FINITE_CHECKS["cpu"]
    monkeypatch.setitem(FINITE_CHECKS, "cpu", lambda tensors: asked.append(1) or check(tensors))
    qkv, call = poisoned(SHAPES[0], tail, "toeplitz+toeplitz_gate", False, "padded_key")
    assert_gradients_match_reference(qkv, call, 4, 8)
    asked.clear()
    tiles = lambda *t, **c: cpp_attention(*t, **c, block_q=4, block_k=8)  # noqa: E731
    out, _ = _output_and_grads(tiles, qkv, call)
    assert asked == []
    assert out.isfinite().all()
    # a NaN the tiles read: the kernel hands back no result, and the rule asks
    qkv, call = poisoned(SHAPES[0], tail, "toeplitz+toeplitz_gate", False, "real_key")
    _output_and_grads(tiles, qkv, call)
    assert asked != []


def test_an_inf_bias_is_not_taken_for_a_nonfinite_input():
    """A logit made inf by the bias (not q, k or v) is the arithmetic's, not the rule's: the
    kernel's flag sends the call to the rule, which finds q, k, v finite and runs it as is."""
    qkv, call = poisoned(SHAPES[0], "padding", "dense_gate", False, "padded_key")
    qkv = tuple(t.nan_to_num(0.0) for t in qkv)
    b, h, lq, _ = qkv[0].shape
    bias = torch.zeros(b, h, lq, qkv[1].shape[2], dtype=torch.float64)
    bias[0, 0, 0, 3] = float("inf")
    call["bias"] = bias.requires_grad_()
    want = attention(*qkv, **call, backend="reference")
    got = cpp_attention(*qkv, **call)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8, equal_nan=True)
    assert got[0, 0, 0].isnan().all()


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_key_block_checked_once_still_finds_every_nan(name, grad):
    """The forward checks each key block's rows once per kv head, where a tile covers the whole
    block; a tile that starts at a document's first key mid-block checks only its own rows.
    Here query block 2 (rows 64-95, document B from key 61) reads keys 61-63 of key block 7
    before query block 1 (one thread, the last query block first) reads all of it: a NaN in
    keys 56-60 is still found, hidden by key padding (no output NaN) or visible."""
    torch.manual_seed(0)
    lq = lk = 96
    q, k, v = (torch.randn(1, 2, lq, 4, dtype=torch.float64) for _ in range(3))
    documents = (torch.arange(lk) >= 61).long()[None]  # (1, Lk): A = [0, 61), B = [61, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for at, padded in itertools.product(range(52, 68), (True, False)):
            qkv = {"q": q, "k": k.clone(), "v": v.clone()}
            qkv[name][0, 1, at, 2] = float("nan")
            call = dict(document_ids=documents)
            if padded:
                call["key_padding_mask"] = (torch.arange(lk) == at)[None]
            want = attention(*qkv.values(), **call, backend="reference")
            with torch.set_grad_enabled(grad):
                leaves = [t.clone().requires_grad_(grad) for t in qkv.values()]
                got = cpp_attention(*leaves, **call, block_q=32, block_k=8)
            assert torch.equal(got.isnan(), want.isnan()), (at, padded)
            assert want.isnan().any() != padded
            torch.testing.assert_close(got.detach(), want, equal_nan=True)
    finally:
        torch.set_num_threads(threads)
