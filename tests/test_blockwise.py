"""What is particular to the blockwise kernel, against the reference in float64 (the shared grid
of cases is in test_backend_conformance.py): tile sizes, its own dropout masks, padding, infinite
gates at hidden keys, half precision, the anti-diagonal sums and when "auto" picks it.

Small tiles (8 queries x 16 keys) make every case span several query and key blocks, so the online
rescaling, causal block skipping and per-tile gradient reduction are all exercised at small L.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from urpe.kernels import Toeplitz, attention, reference_attention, select_backend
from urpe.kernels.backends import BROKEN
from urpe.kernels.blockwise import blockwise_attention
from urpe.kernels.blockwise.tiles import antidiagonal_sums

from .kernel_cases import (
    SMALL_TILES,
    assert_close,
    case,
    outputs_and_grads,
)

TILES = SMALL_TILES


def test_dropout_is_the_reference_with_one_shared_mask():
    """Recover the blockwise kernel's dropped weights with v = identity, then check that output and
    gradients are those of the reference weights with that keep mask, and the drop rate is p."""
    p = 0.25
    qkv, params, call = case((2, 2, 24, 40, 16), "causal", "toeplitz", "toeplitz")
    q, k, v = qkv
    eye = torch.eye(40, dtype=torch.float64).expand(2, 2, 40, 40)
    with torch.no_grad():
        dropped = blockwise_attention(q, k, eye, **call, dropout_p=p, dropout_seed=3, **TILES)
        weights = reference_attention(q, k, eye, **call)
    kept = dropped != 0
    torch.testing.assert_close(dropped, weights * kept / (1 - p))
    visible = weights != 0
    rate = 1 - kept[visible].double().mean().item()
    assert abs(rate - p) < 0.05, rate

    def reference_with_mask(q, k, v, **c):
        w = reference_attention(q, k, eye, **c)
        return (w * kept / (1 - p)) @ v

    def blockwise_seeded(q, k, v, **c):
        return blockwise_attention(q, k, v, **c, dropout_p=p, dropout_seed=3, **TILES)

    assert_close(
        outputs_and_grads(blockwise_seeded, qkv, params, call),
        outputs_and_grads(reference_with_mask, qkv, params, call),
    )
    # a different seed draws a different mask; the default seed follows torch.manual_seed
    with torch.no_grad():
        other = blockwise_attention(q, k, v, **call, dropout_p=p, dropout_seed=4, **TILES)
        torch.manual_seed(0)
        first = blockwise_attention(q, k, v, **call, dropout_p=p, **TILES)
        torch.manual_seed(0)
        again = blockwise_attention(q, k, v, **call, dropout_p=p, **TILES)
    assert not torch.equal(other, blockwise_seeded(q, k, v, **call))
    assert torch.equal(first, again)


def test_poison_padded_rows_are_zero_and_padded_keys_are_ignored():
    qkv, params, call = case((2, 3, 10, 10, 16), "padding", "toeplitz", "toeplitz")
    q, k, v = qkv
    padding = call["key_padding_mask"]
    out = blockwise_attention(q, k, v, **call, **TILES)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # batch row 0: every key padded
    grads = torch.autograd.grad(out.sum(), params)
    assert all(torch.isfinite(g).all() for g in grads)
    # garbage in padded keys and values changes nothing
    poison = padding[:, None, :, None]
    k2 = k.detach().masked_fill(poison, 1e4)
    v2 = v.detach().masked_fill(poison, -3e3)
    torch.testing.assert_close(blockwise_attention(q, k2, v2, **call, **TILES), out)


def test_infinite_gate_far_away_stays_out_of_masked_keys():
    """Causally hidden keys have weight exactly 0 whatever the gate holds there, so the blockwise
    result equals the reference run with any finite value in those places."""
    qkv, params, call = case((1, 2, 12, 12, 16), "causal", None, None)
    table = torch.ones(2, 2 * 11 + 1, dtype=torch.float64)
    table[:, 11 + 1 :] = float("inf")  # offsets j - i > 0: exactly the causally hidden keys
    finite = table.nan_to_num(posinf=5.0).requires_grad_()
    table.requires_grad_()
    got = outputs_and_grads(
        lambda *a, **c: blockwise_attention(*a, **c, **TILES),
        qkv,
        [*params, table],
        call | dict(gate=Toeplitz(table)),
    )
    want = outputs_and_grads(
        reference_attention, qkv, [*params, finite], call | dict(gate=Toeplitz(finite))
    )
    assert_close(got, want)


def test_antidiagonal_sums():
    gen = torch.Generator().manual_seed(0)
    for rows, cols in itertools.product((1, 3, 8), (1, 5, 8, 20)):
        x = torch.randn(2, rows, cols, generator=gen, dtype=torch.float64)
        want = torch.zeros(2, rows + cols - 1, dtype=torch.float64)
        for r, s in itertools.product(range(rows), range(cols)):
            want[:, r + s] += x[:, r, s]
        scratch = {}
        torch.testing.assert_close(antidiagonal_sums(x, scratch), want)
        torch.testing.assert_close(antidiagonal_sums(x, scratch), want)  # reused scratch


def test_auto_picks_blockwise_without_the_cpp_kernel_and_sdpa_for_plain_softmax(monkeypatch):
    monkeypatch.setitem(BROKEN, ("cpp", "cpu"), "not built here")  # as where it cannot be built
    q = torch.randn(1, 2, 8, 16)
    table = Toeplitz(torch.ones(2, 5))
    assert select_backend("auto", q=q, k=q, v=q, **_call(gate=table)).name == "blockwise"
    assert select_backend("auto", q=q, k=q, v=q, **_call(bias=table)).name == "blockwise"
    assert select_backend("auto", q=q, k=q, v=q, **_call(normalization="l2")).name == "blockwise"
    assert select_backend("auto", q=q, k=q, v=q, **_call()).name == "sdpa"
    assert select_backend("blockwise", q=q, k=q, v=q, **_call()).name == "blockwise"
    out = attention(q, q, q, gate=table, bias=table)
    torch.testing.assert_close(out, reference_attention(q, q, q, gate=table, bias=table))


def _call(**overrides):
    call = dict(
        bias=None,
        gate=None,
        key_padding_mask=None,
        is_causal=False,
        normalization="softmax",
        scale=None,
        dropout_p=0.0,
    )
    return call | overrides


@pytest.mark.slow
@pytest.mark.parametrize("normalization", ("softmax", "l2"))
def test_default_tiles_at_lengths_beyond_one_key_block(normalization):
    # Lk > BLOCK_K: several key blocks and several query blocks at the tile sizes users get.
    qkv, params, call = case((1, 2, 300, 2100, 32), "causal+padding", "toeplitz", "toeplitz")
    call["normalization"] = normalization
    want = outputs_and_grads(reference_attention, qkv, params, call)
    got = outputs_and_grads(blockwise_attention, qkv, params, call)
    assert_close(got, want)
