"""One place to extend: a normalisation or a backend registered once is used everywhere.

A new normalisation (sigmoid attention, defined here in a dozen lines) runs on the reference and
on the blockwise kernel without touching either; a new backend is picked by "auto", by name, and
skipped where it says it cannot run.
"""

from __future__ import annotations

import pytest
import torch

from urpe import Positions, TransformerConfig, TransformerEncoder
from urpe.kernels import (
    AUTO_ORDER,
    BACKENDS,
    NORMALIZATIONS,
    Backend,
    Toeplitz,
    attention,
    register_backend,
    register_normalization,
    registered,
    select_backend,
)
from urpe.kernels.blockwise import blockwise_attention
from urpe.kernels.cpp import unavailable
from urpe.kernels.reference import reference_run

from .kernel_cases import sigmoid_normalization
from .tiny import tiny_config

# The first CPU backend "auto" gives a gate to: the C++ kernel where it is built, else blockwise.
GATED_ON_CPU = "cpp" if unavailable() is None else "blockwise"

F64 = dict(dtype=torch.float64)


SIGMOID = sigmoid_normalization()


@pytest.fixture
def sigmoid():
    with registered(register_normalization, SIGMOID):
        yield SIGMOID


@pytest.fixture
def extra_backend():
    calls = []

    def run(spec):
        calls.append(spec)
        return reference_run(spec)

    def unsupported(spec):
        return "no gates here" if spec.gate is not None else None

    with registered(register_backend, Backend("recording", run, unsupported, priority=1000)):
        yield calls


def test_a_registered_normalization_runs_on_every_kernel(sigmoid):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=gen, **F64) for _ in range(3))
    table = torch.randn(3, 5, generator=gen, **F64)
    padding = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    call = dict(
        bias=Toeplitz(table),
        gate=Toeplitz(table + 1),
        key_padding_mask=padding,
        is_causal=True,
        normalization="sigmoid",
    )
    by_hand = torch.sigmoid(q @ k.transpose(-1, -2) / 2 + Toeplitz(table).dense(7, 7))
    keep = torch.ones(7, 7).tril().bool() & ~padding[:, None, None, :]
    by_hand = (by_hand * Toeplitz(table + 1).dense(7, 7)).masked_fill(~keep, 0) @ v

    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    want = attention(*leaves[:3], **(call | dict(bias=Toeplitz(leaves[3]))), backend="reference")
    torch.testing.assert_close(want, by_hand)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    assert select_backend("auto", q, k, v, **call).name == "blockwise"
    for tiles in (dict(), dict(block_q=2, block_k=3)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
        got = blockwise_attention(*leaves[:3], **(call | dict(bias=Toeplitz(leaves[3]))), **tiles)
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
    assert select_backend("auto", q, k, v, gate=gate).name == GATED_ON_CPU
    with pytest.raises(ValueError, match="backend 'recording' cannot run this call: no gates"):
        attention(q, k, v, gate=gate, backend="recording")
    attention(q, k, v, backend="recording")
    assert len(extra_backend) == 2


def test_auto_order_follows_priority_and_skips_unranked_backends():
    """A backend joins "auto" at the place its priority gives, and one without a priority only
    runs by name: checked by which backend actually receives the call."""
    received = []

    def recording(name):
        def run(spec):
            received.append(name)
            return reference_run(spec)

        return run

    def only_with_bias(spec):
        return None if spec.bias is not None else "no bias"

    by_name = Backend("by-name", recording("by-name"), priority=None)
    above_all = Backend("above-all", recording("above-all"), only_with_bias, priority=50)
    with registered(register_backend, by_name), registered(register_backend, above_all):
        assert "by-name" not in AUTO_ORDER and AUTO_ORDER[0] == "above-all"
        q, k, v = (torch.randn(1, 2, 4, 3, **F64) for _ in range(3))
        attention(q, k, v, bias=torch.zeros(4, 4, **F64))  # above-all outranks every other
        attention(q, k, v, gate=torch.ones(4, 4, **F64))  # it declines: the next one takes it
        attention(q, k, v, backend="by-name")
        assert received == ["above-all", "by-name"]
        gated = select_backend("auto", q, k, v, gate=torch.ones(4, 4, **F64)).name
        assert gated == GATED_ON_CPU
    assert "above-all" not in AUTO_ORDER and "by-name" not in BACKENDS
    assert AUTO_ORDER[-1] == "reference"


def test_a_registered_normalization_builds_and_trains_a_model():
    """Registered once, a normalisation is a valid TransformerConfig choice: no other edit."""
    with registered(register_normalization, SIGMOID):
        _check_a_sigmoid_model()
    assert "sigmoid" not in NORMALIZATIONS
    with pytest.raises(ValueError, match="normalization must be one of"):
        TransformerConfig(vocab_size=7, normalization="sigmoid")


def _check_a_sigmoid_model():
    config = tiny_config(
        vocab_size=7,
        num_layers=2,
        dim=8,
        ffn_dim=None,
        max_len=6,
        position="rpe",
        gate="toeplitz",
        normalization="sigmoid",
    )
    model = TransformerEncoder(config).double()
    tokens = torch.randint(0, 7, (2, 6))
    out = model(tokens)
    out.square().sum().backward()
    assert out.shape == (2, 6, 8) and torch.isfinite(out).all()
    # The layers really ran sigmoid attention: compare one layer against the formula.
    mha = model.layers[0].mixer
    x = torch.randn(2, 6, 8, **F64)
    heads = [p(x).view(2, 6, 2, 4).transpose(1, 2) for p in (mha.q_proj, mha.k_proj, mha.v_proj)]
    positions = Positions.sequence(6)
    bias = mha.position.bias(heads[0], positions, 0.5).dense(6, 6)
    gate = mha.gate(positions).dense(6, 6)
    weights = torch.sigmoid(heads[0] @ heads[1].transpose(-1, -2) * 0.5 + bias) * gate
    want = mha.out_proj((weights @ heads[2]).transpose(1, 2).reshape(2, 6, 8))
    torch.testing.assert_close(mha(x), want)


def test_config_backends_come_from_the_registry(extra_backend):
    TransformerConfig(vocab_size=7, attention_backend="recording")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        TransformerConfig(vocab_size=7, attention_backend="no-such")
