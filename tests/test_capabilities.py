"""Capability tables: one per backend, read by dispatch and by the backend's own entry point.

A compiled kernel implements the normalisations it was written for, as objects: one registered
again under the same name with other formulas is refused by every compiled backend (by name or
through its own function), and "auto" runs it on a backend that reads the registry's formulas.
"""

from __future__ import annotations

import pytest
import torch

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
from urpe.kernels.capabilities import Capabilities
from urpe.kernels.cpp import cpp_attention
from urpe.kernels.flex import flex_urpe_attention
from urpe.kernels.reference import reference_run
from urpe.kernels.spec import resolve
from urpe.kernels.triton import triton_attention

from .kernel_cases import sigmoid_normalization

F64 = dict(dtype=torch.float64)
COMPILED = ("cpp", "triton", "flex", "sdpa")
ENTRY_POINTS = {"cpp": cpp_attention, "triton": triton_attention, "flex": flex_urpe_attention}


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=gen, **F64) for _ in range(3))
    table = torch.randn(3, 5, generator=gen, **F64)
    return q, k, v, table


def _sigmoid_by_hand(q, k, v, bias=None, gate=None):
    s = q @ k.transpose(-1, -2) / 2  # scale 1 / sqrt(4)
    if bias is not None:
        s = s + bias.dense(7, 7)
    a = torch.sigmoid(s)
    if gate is not None:
        a = a * gate.dense(7, 7)
    return a @ v


def test_softmax_registered_again_with_other_formulas_is_refused_by_every_compiled_backend():
    q, k, v, table = _inputs()
    terms = dict(bias=Toeplitz(table), gate=Toeplitz(table + 1))
    original = NORMALIZATIONS["softmax"]
    with registered(register_normalization, sigmoid_normalization("softmax")):
        for name in COMPILED:
            call = dict(gate=None) if name == "sdpa" else terms
            refused = f"backend '{name}' cannot run this call: normalization 'softmax' was"
            with pytest.raises(ValueError, match=refused + " registered again"):
                attention(q, k, v, **call, backend=name)
        for entry_point in ENTRY_POINTS.values():  # the same table behind each function
            with pytest.raises(ValueError, match="registered again with other formulas"):
                entry_point(q, k, v, **terms)
        # "auto" runs both calls where the registry's formulas are read: sigmoid attention
        for call in (terms, {}):
            assert select_backend("auto", q, k, v, **call).name in ("blockwise", "reference")
            torch.testing.assert_close(
                attention(q, k, v, **call), _sigmoid_by_hand(q, k, v, **call)
            )
    assert NORMALIZATIONS["softmax"] is original
    # the built-in softmax again: SDPA, or the C++ kernel for a few queries (decoding)
    assert select_backend("auto", q, k, v).name in ("sdpa", "cpp")
    out = attention(q, k, v, **terms, backend="cpp")
    torch.testing.assert_close(out, attention(q, k, v, **terms, backend="reference"))


def test_every_backend_declares_its_table_and_dispatch_reads_it():
    q, k, v, table = _inputs()
    gated = dict(gate=Toeplitz(table))
    for name in ("reference", "sdpa", "blockwise", "cpp", "triton", "flex"):
        assert isinstance(BACKENDS[name].capabilities, Capabilities), name
    assert "SDPA takes no gate" in BACKENDS["sdpa"].refusal(resolve(q, k, v, **gated))
    with pytest.raises(ValueError, match="FlexAttention has no dropout"):
        attention(q, k, v, dropout_p=0.1, backend="flex")
    with pytest.raises(ValueError, match="normalization 'relu2' has no form in FlexAttention"):
        attention(q, k, v, normalization="relu2", backend="flex")


def test_a_table_refuses_for_a_registered_backend_whatever_its_own_check_says():
    """A backend's own `unsupported` need not repeat its table: dispatch applies the table."""
    only_dense = Capabilities("the dense-only kernel", bias=("dense",), gate=())
    backend = Backend("dense-only", reference_run, priority=10_000, capabilities=only_dense)
    q, k, v, table = _inputs()
    with registered(register_backend, backend):
        assert AUTO_ORDER[0] == "dense-only"
        assert select_backend("auto", q, k, v, bias=torch.zeros(7, 7, **F64)).name == "dense-only"
        assert select_backend("auto", q, k, v, bias=Toeplitz(table)).name != "dense-only"
        with pytest.raises(ValueError, match="takes a bias as dense, not toeplitz"):
            attention(q, k, v, bias=Toeplitz(table), backend="dense-only")
        with pytest.raises(ValueError, match="the dense-only kernel takes no gate"):
            attention(q, k, v, gate=torch.ones(7, 7, **F64), backend="dense-only")
    assert "dense-only" not in BACKENDS and "dense-only" not in AUTO_ORDER


def test_registered_restores_the_registries_also_when_the_block_raises():
    before = (dict(BACKENDS), list(AUTO_ORDER), dict(NORMALIZATIONS))
    short_lived = Backend("short-lived", reference_run, priority=1e6)
    with pytest.raises(RuntimeError, match="inside"):
        with (
            registered(register_backend, short_lived) as backend,
            registered(register_normalization, sigmoid_normalization("softmax")),
        ):
            assert AUTO_ORDER[0] == "short-lived" and backend is short_lived
            register_backend(Backend("also-undone", reference_run))  # inside the block: undone
            raise RuntimeError("inside")
    assert dict(BACKENDS) == before[0] and list(AUTO_ORDER) == before[1]
    assert all(NORMALIZATIONS[n] is entry for n, entry in before[2].items())
    assert list(NORMALIZATIONS) == list(before[2])
