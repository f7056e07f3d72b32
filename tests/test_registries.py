"""One place to extend: a normalisation or a backend registered once is used everywhere.

A new normalisation (sigmoid attention, defined here in a dozen lines) runs on the reference and
on the fused kernel without touching either; a new backend is picked by "auto", by name, and
skipped where it says it cannot run.
"""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import (
    AUTO_ORDER,
    BACKENDS,
    NORMALIZATIONS,
    Backend,
    Normalization,
    Toeplitz,
    attention,
    register_backend,
    register_normalization,
    select_backend,
)
from urpe.kernels.fused import fused_attention
from urpe.kernels.reference import reference_run

F64 = dict(dtype=torch.float64)


def _sigmoid_weights(scores, keep):
    a = torch.sigmoid(scores)
    return a if keep is None else a.masked_fill(~keep, 0.0)


def _sigmoid_tile(s, r):
    return s.sigmoid_(), None  # no row statistic: r is the zero `fixed_statistic`


def _sigmoid_grad(dp, a, aux, delta, r):
    return dp.mul_(a).mul_(1 - a)  # d sigmoid = a (1 - a)


SIGMOID = Normalization(
    name="sigmoid",
    formula="a_ij = sigmoid(s_ij)",
    weights=_sigmoid_weights,
    tile_weights=_sigmoid_tile,
    grad_logits=_sigmoid_grad,
    fixed_statistic=torch.zeros_like,
    hidden_logit=float("-inf"),  # sigmoid(-inf) = 0
)


@pytest.fixture
def sigmoid():
    register_normalization(SIGMOID)
    yield SIGMOID
    del NORMALIZATIONS["sigmoid"]


@pytest.fixture
def extra_backend():
    calls = []

    def run(spec):
        calls.append(spec)
        return reference_run(spec)

    def unsupported(spec):
        return "no gates here" if spec.gate is not None else None

    register_backend(Backend("recording", run, unsupported, priority=1000))
    yield calls
    del BACKENDS["recording"]
    register_backend(BACKENDS["reference"])  # rebuilds AUTO_ORDER without it


def test_a_registered_normalization_runs_on_every_kernel(sigmoid):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=gen, **F64) for _ in range(3))
    table = torch.randn(3, 5, generator=gen, **F64)
    padding = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    call = dict(bias=Toeplitz(table), gate=Toeplitz(table + 1), key_padding_mask=padding,
                is_causal=True, normalization="sigmoid")  # fmt: skip
    by_hand = torch.sigmoid(q @ k.transpose(-1, -2) / 2 + Toeplitz(table).dense(7, 7))
    keep = torch.ones(7, 7).tril().bool() & ~padding[:, None, None, :]
    by_hand = (by_hand * Toeplitz(table + 1).dense(7, 7)).masked_fill(~keep, 0) @ v

    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    want = attention(*leaves[:3], **(call | dict(bias=Toeplitz(leaves[3]))), backend="reference")
    torch.testing.assert_close(want, by_hand)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    assert select_backend("auto", q, k, v, **call).name == "fused"
    for tiles in (dict(), dict(block_q=2, block_k=3)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
        got = fused_attention(*leaves[:3], **(call | dict(bias=Toeplitz(leaves[3]))), **tiles)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got.square().sum(), leaves), want_grads, strict=True):
            torch.testing.assert_close(g, w)


def test_an_unknown_normalization_lists_the_registry(sigmoid):
    q = torch.randn(1, 1, 2, 2)
    with pytest.raises(ValueError, match="normalization must be one of.*'sigmoid'"):
        attention(q, q, q, normalization="sparsemax")


def test_a_registered_backend_is_used_by_auto_by_name_and_skipped_where_it_cannot(extra_backend):
    q, k, v = (torch.randn(1, 2, 4, 3, **F64) for _ in range(3))
    assert AUTO_ORDER[0] == "recording"
    out = attention(q, k, v)
    assert len(extra_backend) == 1 and out.shape == (1, 2, 4, 3)
    gate = torch.ones(1, 2, 4, 4, **F64)
    assert select_backend("auto", q, k, v, gate=gate).name == "fused"
    with pytest.raises(ValueError, match="backend 'recording' cannot run this call: no gates"):
        attention(q, k, v, gate=gate, backend="recording")
    attention(q, k, v, backend="recording")
    assert len(extra_backend) == 2


def test_auto_order_follows_priority():
    ranked = [BACKENDS[n].priority for n in AUTO_ORDER]
    assert ranked == sorted(ranked, reverse=True)
    assert AUTO_ORDER[-1] == "reference"  # it runs everything, so it is the last resort
    assert set(AUTO_ORDER) <= set(BACKENDS)
