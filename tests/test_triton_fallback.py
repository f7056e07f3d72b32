"""What the Triton backend does when it cannot run, and its deterministic mode, under the
interpreter: a kernel that fails to compile or launch (simulated), a Triton that cannot be
imported, and table gradients under `torch.use_deterministic_algorithms(True)`."""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch

from urpe.kernels import (
    Relation,
    Toeplitz,
    attention,
    backends,
    reference_attention,
    register_backend,
    registered,
)
from urpe.kernels.triton import launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_first(monkeypatch):
    """ "auto" takes the Triton kernel first (on the CPU it normally defers to the blockwise one),
    and forgets earlier failures and warnings."""
    backend = dataclasses.replace(backends.BACKENDS["triton"], defers=None)
    monkeypatch.setattr(backends, "BROKEN", backends.WatchedDict())
    monkeypatch.setattr(backends, "_WARNED", set())
    with registered(register_backend, backend):
        yield


def _call(**extra):
    gen = torch.Generator().manual_seed(0)
    f = dict(dtype=torch.float64)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen, **f).to(DEVICE) for _ in "qkv")
    gate = Toeplitz(torch.rand(2, 9, generator=gen, **f).to(DEVICE))
    return (q, k, v), dict(gate=gate, **extra)


class _Broken:
    """A kernel whose compilation fails, as on a GPU it cannot be built for."""

    calls = 0

    def __getitem__(self, grid):
        def launch_it(*args, **kwargs):
            _Broken.calls += 1
            raise RuntimeError("PTX .version 8.4 does not support .target sm_61")

        return launch_it


def test_auto_falls_back_with_one_warning_when_the_kernel_cannot_compile(triton_first, monkeypatch):
    qkv, call = _call()
    assert backends.choose_backend("auto", backends.resolve(*qkv, **call)).name == "triton"
    monkeypatch.setitem(launch.KERNELS, "forward", _Broken())
    _Broken.calls = 0
    with pytest.warns(RuntimeWarning, match=r"backend 'triton' cannot run .*sm_61"):
        out = attention(*qkv, **call)
    torch.testing.assert_close(out, reference_attention(*qkv, **call))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call neither warns nor retries the kernel
        again = attention(*qkv, **call)
    assert _Broken.calls == 1
    torch.testing.assert_close(again, out)
    assert backends.choose_backend("auto", backends.resolve(*qkv, **call)).name != "triton"


def test_naming_the_backend_raises_one_clear_error(triton_first, monkeypatch):
    qkv, call = _call()
    monkeypatch.setitem(launch.KERNELS, "forward", _Broken())
    with pytest.raises(backends.BackendFailure, match="could not be compiled or launched here"):
        attention(*qkv, **call, backend="triton")


def test_a_triton_that_cannot_be_imported_is_a_backend_failure(triton_first, monkeypatch):
    qkv, call = _call()
    monkeypatch.setitem(sys.modules, "urpe.kernels.triton.ops", None)  # import raises
    with pytest.warns(RuntimeWarning, match="Triton cannot be imported"):
        out = attention(*qkv, **call)
    torch.testing.assert_close(out, reference_attention(*qkv, **call))


@pytest.mark.parametrize("kind", ["toeplitz", "relation"])
def test_deterministic_mode_reduces_table_gradients_without_atomics(kind, monkeypatch):
    """The dQ kernel writes a dense gradient (kind DENSE, no atomics) that torch reduces in a
    fixed order; the gradients equal the reference's and two runs agree bitwise."""
    from urpe.kernels.triton import kernels as K
    from urpe.kernels.triton import ops, triton_attention

    gen = torch.Generator().manual_seed(1)
    f = dict(dtype=torch.float64)
    q, k, v = (torch.randn(2, 2, 19, 16, generator=gen, **f) for _ in "qkv")
    if kind == "toeplitz":
        bias = Toeplitz(torch.randn(2, 7, generator=gen, **f).requires_grad_())
    else:
        index = torch.randint(0, 5, (1, 19, 19), generator=gen)
        bias = Relation(torch.randn(1, 5, generator=gen, **f).requires_grad_(), index)
    seen = []
    plain = ops.backward_launches
    monkeypatch.setattr(ops, "backward_launches", lambda g: seen.append(plain(g)) or seen[-1])

    def grads(fn):
        bias.table.grad = None
        fn(q, k, v, bias=bias, is_causal=True).square().sum().backward()
        return bias.table.grad.clone()

    expected = grads(reference_attention)
    torch.use_deterministic_algorithms(True)
    try:
        first, second = grads(triton_attention), grads(triton_attention)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen[0][1].meta["B_GRAD"] == K.DENSE.value
    torch.testing.assert_close(first, expected)
    assert torch.equal(first, second)
    grads(triton_attention)  # outside the mode: the table's own (atomic) path
    own = K.TOEPLITZ.value if kind == "toeplitz" else K.RELATION.value
    assert seen[-1][1].meta["B_GRAD"] == own
