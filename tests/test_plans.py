"""Remembered calls (`urpe.kernels.plans`): the same results and the same refusals as the full
path, and forgotten whenever what they decided on changes."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import (
    BACKENDS,
    NORMALIZATIONS,
    Backend,
    Relation,
    Toeplitz,
    attention,
    dispatch,
    plans,
    register_backend,
    register_normalization,
    registered,
)
from urpe.kernels.dispatch import BackendFailure
from urpe.kernels.spec import resolve

F64 = dict(dtype=torch.float64)


def _qkv(b=2, h=2, lq=5, lk=7, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen, **F64) for n in (lq, lk, lk))


@pytest.fixture
def resolves(monkeypatch):
    """Counts the calls that took the full path (resolve), from an empty plan cache."""
    plans.forget()
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return resolve(*args, **kwargs)

    monkeypatch.setattr(dispatch, "resolve", counted)
    yield count
    plans.forget()


def test_a_repeated_call_is_resolved_once_and_gives_the_full_paths_result(resolves):
    q, k, v = _qkv()
    gate = Toeplitz(torch.randn(2, 9, **F64))
    mask = torch.rand(5, 7) > 0.3
    call = dict(gate=gate, attn_mask=mask, is_causal=True)
    first = attention(q, k, v, **call)
    assert resolves[0] == 1
    for seed in (1, 2):  # other tensors of the same signature: no checks, no choice again
        q2, k2, v2 = _qkv(seed=seed)
        table = torch.randn(2, 9, **F64)
        out = attention(q2, k2, v2, **{**call, "gate": Toeplitz(table)})
        expected = attention(q2, k2, v2, **{**call, "gate": Toeplitz(table)}, backend="reference")
        torch.testing.assert_close(out, expected)
    assert resolves[0] == 2  # the explicit reference call is a signature of its own
    torch.testing.assert_close(first, attention(q, k, v, **call, backend="reference"))


def test_leading_batch_dims_and_dense_terms_on_a_remembered_plan(resolves):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 2, 4, 4, generator=gen, **F64) for _ in range(3))
    bias = torch.randn(3, 1, 4, 4, **F64)  # broadcast over the first batch dim and the heads
    for _ in range(2):
        out = attention(q, k, v, bias=bias, key_padding_mask=torch.zeros(3, 4, dtype=torch.bool))
    assert resolves[0] == 1
    expected = attention(q, k, v, bias=bias, backend="reference")
    torch.testing.assert_close(out, expected)
    assert out.shape == (2, 3, 2, 4, 4)


# Pairs of calls that differ in one respect: the first is valid and remembered, the second must
# still be refused with the full path's own error.
def _pairs():
    gate = Toeplitz(torch.randn(2, 9, **F64))
    ones = torch.ones(5, 7, dtype=torch.bool)
    return [
        (dict(attn_mask=ones), dict(attn_mask=torch.ones(5, 6, dtype=torch.bool))),
        (dict(attn_mask=ones), dict(attn_mask=torch.ones(5, 7, dtype=torch.int64))),
        (
            dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)),
            dict(key_padding_mask=torch.zeros(3, 7, dtype=torch.bool)),
        ),
        (dict(gate=gate), dict(gate=Toeplitz(torch.randn(3, 9, **F64)))),
        (dict(gate=gate), dict(gate=Toeplitz(torch.randn(2, 9)))),
        (dict(gate=gate, scale=1.0), dict(gate=gate, scale=True)),
        (dict(gate=gate, is_causal=False), dict(gate=gate, is_causal=0)),
        (dict(gate=gate, dropout_p=0.0), dict(gate=gate, dropout_p=1.0)),
        (dict(gate=gate, dropout_p=0.0), dict(gate=gate, dropout_p=False)),
        (dict(gate=gate), dict(gate=gate, normalization="nope")),
        (dict(gate=gate, scale=1.0), dict(gate=gate, scale=float("inf"))),
        (dict(gate=gate), dict(gate=gate, backend="nope")),
        (
            dict(gate=Relation(torch.randn(2, 3, **F64), torch.full((5, 7), 2))),
            dict(gate=Relation(torch.randn(2, 3, **F64), torch.full((5, 7), 3))),
        ),
        (dict(bias=torch.randn(2, 5, 7, **F64)), dict(bias=torch.randn(2, 5, 6, **F64))),
        (dict(bias=torch.randn(2, 5, 7, **F64)), dict(bias=torch.ones(2, 5, 7, dtype=torch.int64))),
    ]


@pytest.mark.parametrize("index", range(len(_pairs())))
def test_what_the_full_path_refuses_is_refused_after_a_similar_call_was_remembered(index):
    q, k, v = _qkv()
    valid, refused = _pairs()[index]
    plans.forget()
    with pytest.raises((TypeError, ValueError)) as fresh:
        attention(q, k, v, **refused)
    attention(q, k, v, **valid)
    attention(q, k, v, **valid)
    with pytest.raises(type(fresh.value)) as warm:
        attention(q, k, v, **refused)
    assert str(warm.value) == str(fresh.value)
    plans.forget()


def test_registering_a_backend_or_a_normalization_forgets_every_plan():
    q, k, v = _qkv()
    attention(q, k, v, gate=Toeplitz(torch.randn(2, 9, **F64)))
    assert plans._PLANS
    with registered(register_backend, BACKENDS["reference"]):
        assert not plans._PLANS
    attention(q, k, v, normalization="l2")
    with registered(register_normalization, NORMALIZATIONS["l2"]):
        assert not plans._PLANS


def test_a_backend_replaced_by_hand_is_not_run_from_an_old_plan():
    q, k, v = _qkv()
    plans.forget()
    attention(q, k, v, backend="blockwise")
    ran = []

    def spy(spec):
        ran.append(spec)
        return BACKENDS["reference"].run(spec)

    with registered(register_backend, Backend("blockwise", spy)):
        attention(q, k, v, backend="blockwise")
    assert len(ran) == 1
    plans.forget()


def test_a_backend_that_fails_on_a_remembered_call_hands_it_to_the_next(monkeypatch):
    q, k, v = _qkv()
    calls = []

    def flaky(spec):
        calls.append(spec)
        if len(calls) > 1:
            raise BackendFailure("stopped working")
        return BACKENDS["reference"].run(spec)

    plans.forget()
    monkeypatch.setattr(dispatch, "BROKEN", {})
    with registered(register_backend, Backend("flaky-test", flaky, priority=10_000)):
        gate = Toeplitz(torch.randn(2, 9, **F64))
        attention(q, k, v, gate=gate)  # runs on flaky-test and is remembered
        with pytest.warns(RuntimeWarning, match="flaky-test"):
            out = attention(q, k, v, gate=gate)  # the plan's backend fails: the next one runs
        torch.testing.assert_close(out, attention(q, k, v, gate=gate, backend="reference"))
        assert ("flaky-test", "cpu") in dispatch.BROKEN


# A growing KV cache: one query against 2..40 keys, as decoding steps make them. Each entry
# builds the call's keyword arguments for Lk keys (masks and terms whose last dim is Lk).
def _decoding_calls():
    narrow = Toeplitz(torch.randn(2, 9, **F64))  # offsets beyond +-4 read the table's edges
    return {
        "toeplitz gate": lambda lk: dict(gate=narrow),
        "toeplitz bias and gate, causal": lambda lk: dict(bias=narrow, gate=narrow, is_causal=True),
        "float mask and padding": lambda lk: dict(
            gate=narrow,
            attn_mask=torch.linspace(-1, 1, lk, **F64).reshape(1, 1, 1, lk),
            key_padding_mask=torch.arange(lk).expand(2, lk) == 1,
        ),
        "dense bias": lambda lk: dict(bias=torch.linspace(-2, 2, 2 * lk, **F64).reshape(2, 1, lk)),
        "decay": lambda lk: dict(
            bias=urpe_decay(-torch.linspace(0.1, 0.5, 2 * lk, **F64).reshape(1, 2, lk))
        ),
        "l2, bool mask": lambda lk: dict(
            gate=narrow, normalization="l2", attn_mask=torch.ones(1, lk, dtype=torch.bool)
        ),
    }


def urpe_decay(log_forget):
    from urpe.kernels import Decay

    return Decay(log_forget)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", list(_decoding_calls()))
def test_decoding_steps_with_a_growing_cache_are_resolved_once(resolves, case, grad):
    """A plan made at one Lk serves the next steps (its kin signature leaves Lk out), and each
    step's result is the full path's."""
    arguments = _decoding_calls()[case]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 1, 4, generator=gen, **F64, requires_grad=grad)
    cache = torch.randn(2, 2, 40, 4, generator=gen, **F64)
    with torch.set_grad_enabled(grad):
        for lk in range(2, 41):
            k, v = cache[:, :, :lk].contiguous(), cache[:, :, :lk].flip(-1).contiguous()
            out = attention(q, k, v, **arguments(lk))
            expected = attention(q, k, v, **arguments(lk), backend="reference")
            torch.testing.assert_close(out, expected)
            if grad:
                (got,) = torch.autograd.grad(out.sum(), q)
                (want,) = torch.autograd.grad(expected.sum(), q)
                torch.testing.assert_close(got, want)
    assert resolves[0] == 2  # the first step's call and its reference, nothing after


# Calls valid at 7 keys, then the same arguments at 8 keys, which the full path refuses: a kin
# plan must not let them through.
def _kin_refusals():
    def keys(lk):
        return torch.zeros(2, 2, lk, 4, **F64)

    return [
        (dict(attn_mask=torch.ones(1, 7, dtype=torch.bool)), {}),
        (dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)), {}),
        (dict(bias=torch.zeros(2, 1, 7, **F64)), {}),
        (dict(bias=urpe_decay(torch.zeros(2, 2, 7, **F64))), {}),
        ({}, dict(v=keys(9))),  # keys and values of different lengths
    ]


@pytest.mark.parametrize("index", range(len(_kin_refusals())))
def test_a_call_at_another_length_is_refused_as_the_full_path_refuses_it(index):
    arguments, replaced = _kin_refusals()[index]
    q = torch.zeros(2, 2, 1, 4, **F64)
    at_7 = dict(k=torch.zeros(2, 2, 7, 4, **F64), v=torch.zeros(2, 2, 7, 4, **F64))
    at_8 = dict(k=torch.zeros(2, 2, 8, 4, **F64), v=torch.zeros(2, 2, 8, 4, **F64))
    at_8.update(replaced)
    plans.forget()
    with pytest.raises((TypeError, ValueError)) as fresh:
        attention(q, **at_8, **arguments)
    for _ in range(2):
        attention(q, **at_7, **arguments)
    with pytest.raises(type(fresh.value)) as warm:
        attention(q, **at_8, **arguments)
    assert str(warm.value) == str(fresh.value)
    plans.forget()


def test_a_backend_that_may_decide_by_the_keys_length_is_asked_at_every_length(monkeypatch):
    """A registered backend says nothing about Lk (keys_length_free defaults to False): "auto"
    asks it again at each new Lk, so a backend that defers long calls is left at the length
    where it defers, and a later short call comes back to it."""
    ran = []

    def short_only(spec):
        ran.append(spec.lk)
        return BACKENDS["reference"].run(spec)

    picky = Backend(
        "short-only-test",
        short_only,
        priority=10_000,
        defers=lambda spec: "long" if spec.lk > 10 else None,
    )
    q = torch.randn(1, 2, 1, 4, **F64)
    plans.forget()
    with registered(register_backend, picky):
        for lk in (5, 6, 11, 12, 7):
            attention(q, torch.randn(1, 2, lk, 4, **F64), torch.randn(1, 2, lk, 4, **F64))
    assert ran == [5, 6, 7]
    plans.forget()
