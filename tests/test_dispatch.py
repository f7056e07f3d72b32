"""`urpe.kernels.dispatch` and `spec`: how a call is resolved and which kernel runs it.

The rules themselves, with backends of the test's own that record what they receive: auto
tries backends by descending priority, skips those that cannot run a call or defer it, a named
backend that cannot run a call raises its reason, and every backend receives one resolved
`AttentionSpec` (leading batch dims flattened, terms brought to 4-D, the defaults filled in).
"""

from __future__ import annotations

import math

import pytest
import torch

from urpe.kernels import (
    AUTO_ORDER,
    BACKENDS,
    Backend,
    Relation,
    Toeplitz,
    attention,
    choose_backend,
    native_backends,
    register_backend,
    registered,
    resolve,
)
from urpe.kernels.capabilities import Capabilities
from urpe.kernels.reference import reference_run


@pytest.fixture
def recorder():
    """Two backends of the test's own; they record the spec they run and defer to the
    reference for the numbers. Removed afterwards."""
    seen: list = []

    def run(spec):
        seen.append(spec)
        return BACKENDS["reference"].run(spec)

    high = Backend(
        "test-high",
        run,
        lambda s: None if s.normalization == "l2" else "only l2",
        priority=1000,
    )
    deferring = Backend(
        "test-defers",
        run,
        lambda s: None,
        priority=999,
        defers=lambda s: "passes causal calls on" if s.is_causal else None,
    )
    with registered(register_backend, high), registered(register_backend, deferring):
        yield seen


def _qkv(*batch, h=2, lq=3, lk=4, d=8):
    return (
        torch.randn(*batch, h, lq, d),
        torch.randn(*batch, h, lk, d),
        torch.randn(*batch, h, lk, d),
    )


def test_auto_takes_the_highest_priority_backend_that_accepts_and_does_not_defer(recorder):
    q, k, v = _qkv(2)
    assert choose_backend("auto", resolve(q, k, v, normalization="l2")).name == "test-high"
    assert choose_backend("auto", resolve(q, k, v)).name == "test-defers"  # test-high refuses
    causal = resolve(q, k, v, is_causal=True)  # refused by one, deferred by the other
    assert choose_backend("auto", causal).name not in ("test-high", "test-defers")
    assert AUTO_ORDER[:2] == ["test-high", "test-defers"]


def test_a_named_backend_raises_its_own_reason_and_unknown_names_are_listed(recorder):
    q, k, v = _qkv(2)
    with pytest.raises(ValueError, match="backend 'test-high' cannot run this call: only l2"):
        attention(q, k, v, backend="test-high")
    with pytest.raises(ValueError, match="'reference'"):
        attention(q, k, v, backend="no-such-kernel")
    with pytest.raises(TypeError, match="backend must be a string"):
        attention(q, k, v, backend=3)
    # a named backend runs even where auto would have passed the call on
    attention(q, k, v, is_causal=True, backend="test-defers")
    assert recorder[-1].is_causal


def test_the_backend_receives_one_resolved_spec(recorder):
    q, k, v = _qkv(3, 2)  # leading dims (3, 2) -> B = 6
    table = torch.randn(2, 5)
    index = torch.randint(0, 4, (3, 4))
    mask = torch.rand(3, 4) < 0.7
    out = attention(
        q,
        k,
        v,
        attn_mask=mask,
        bias=Toeplitz(table),
        gate=Relation(torch.rand(1, 4), index),
        normalization="l2",
        backend="test-high",
    )
    spec = recorder[-1]
    assert out.shape == (3, 2, 2, 3, 8)
    assert spec.q.shape == (6, 2, 3, 8) and spec.batch_shape == (3, 2)
    assert spec.attn_mask.shape == (1, 1, 3, 4)  # broadcast over the batch: not expanded
    assert spec.gate.index.shape == (1, 3, 4) and spec.gate.index.dtype == torch.int64
    assert spec.bias.table is table  # a Toeplitz table travels as it is
    assert math.isclose(spec.scale, 8**-0.5) and spec.groups == 1
    assert spec.lq == 3 and spec.lk == 4 and spec.value_dim == 8 and not spec.is_empty


def test_grouped_queries_and_empty_calls_in_the_spec():
    q, k, v = torch.randn(1, 6, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 7)
    spec = resolve(q, k, v, enable_gqa=True)
    assert (spec.heads, spec.kv_heads, spec.groups, spec.value_dim) == (6, 2, 3, 7)
    assert resolve(q[:, :, :0], k, v, enable_gqa=True).is_empty
    assert resolve(q, k[:, :, :0], v[:, :, :0], enable_gqa=True).is_empty
    seed = resolve(q, k, v, enable_gqa=True, dropout_p=0.1, dropout_seed=2**70).dropout_seed
    assert seed.dtype == torch.int64 and seed.dim() == 0 and 0 <= int(seed) < 2**62


def test_native_backends_leave_out_the_gpu_built_ones():
    cpu = native_backends("cpu")
    assert {"reference", "sdpa", "blockwise"} <= set(cpu)
    assert "triton" not in cpu and "flex" not in cpu
    assert {"triton", "flex"} <= set(native_backends("cuda"))


def test_native_backends_leave_out_one_that_cannot_run_here():
    """A backend whose kernel could not be built (`available` gives the reason) is not among
    the native ones, so the tests and the benchmark that sweep them do not run it."""

    def not_here() -> str:
        return "its compiler is missing"

    cpu_only = Capabilities("a test kernel", devices=("cpu",))
    unbuilt = Backend("unbuilt", reference_run, capabilities=cpu_only, available=not_here)
    built = Backend("built", reference_run, capabilities=cpu_only, available=lambda: None)
    with registered(register_backend, unbuilt), registered(register_backend, built):
        cpu = native_backends("cpu")
        assert "built" in cpu and "unbuilt" not in cpu
    assert "built" not in BACKENDS and "unbuilt" not in BACKENDS
