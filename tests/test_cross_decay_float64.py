"""A `CrossDecay` whose sums are float64 in a float32 call (a KV cache keeps them in double):
every backend that takes a cross decay reads each sum rounded to float32 before it subtracts,
as the reference does. The outputs equal, bit for bit, those of the sums converted first (what
a cache handed over before); the C++ kernel's forward reads them where they lie, without a
copy; gradients reach the float64 sums as the reference's do."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import BACKENDS, CrossDecay, attention, dense_term
from urpe.kernels.cpp import unavailable

B, H, LQ, LK, D = 2, 3, 4, 37, 8


def _backends() -> list[str]:
    """The backends that take a cross decay and run on the CPU here."""
    names = []
    for name, backend in BACKENDS.items():
        table = backend.capabilities
        if not table.takes("bias", "cross_decay") or table.devices not in (None, ("cpu",)):
            continue
        if name == "cpp" and unavailable() is not None:
            continue
        names.append(name)
    return names


def _call(lq: int = LQ, seed: int = 0):
    """float32 q, k, v and float64 sums (B, H, Lq + Lk) of ~-300 (float32's step there is
    3e-5), with keys whose sums round to their query's but differ in double: rounding first
    or subtracting first tells apart there."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (lq, LK, LK))
    log_forget = torch.nn.functional.logsigmoid(torch.randn(B, H, 600, generator=g))
    c = log_forget.to(torch.float64).cumsum(-1)[..., -(lq + LK) :]
    c[..., lq + 5] = c[..., 0] + 1e-9  # rounds to c[..., 0]'s float32
    c[..., lq + 9] = c[..., lq - 1] - 1e-9
    return q, k, v, c


def test_the_reference_reads_each_sum_rounded_then_subtracts():
    _, _, _, c = _call()
    dense = dense_term(CrossDecay(c), LQ, LK, torch.float32)
    c32 = c.float()
    assert dense.dtype == torch.float32
    assert torch.equal(dense, -(c32[..., :LQ, None] - c32[..., None, LQ:]).abs())
    assert dense[0, 0, 0, 5] == 0  # the near tie: 0 after rounding, not ~1e-9


@pytest.mark.parametrize("lq", [1, LQ])
@pytest.mark.parametrize("backend", _backends())
def test_float64_sums_give_what_the_sums_in_float32_give(backend, lq):
    q, k, v, c = _call(lq)
    with torch.no_grad():
        got = attention(q, k, v, bias=CrossDecay(c), is_causal=True, backend=backend)
        want = attention(q, k, v, bias=CrossDecay(c.float()), is_causal=True, backend=backend)
        reference = attention(q, k, v, bias=CrossDecay(c), is_causal=True, backend="reference")
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    torch.testing.assert_close(got, reference)


@pytest.mark.parametrize("backend", _backends())
def test_gradients_reach_the_float64_sums_as_the_reference_s(backend):
    q, k, v, c = _call(seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, c)]
    grads = {}
    for name in (backend, "reference"):
        for t in leaves:
            t.grad = None
        q_, k_, v_, c_ = leaves
        out = attention(q_, k_, v_, bias=CrossDecay(c_), is_causal=True, backend=name)
        out.square().sum().backward()
        grads[name] = [t.grad for t in leaves]
    assert grads[backend][3].dtype == torch.float64
    for got, want in zip(grads[backend], grads["reference"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_cpp_forward_reads_float64_rows_where_they_lie():
    """The raw op takes the float64 rows (a cache's: a buffer's capacity apart) of a float32
    call and gives what their float32 copy gives."""
    if unavailable() is not None:
        pytest.skip(unavailable())
    q, k, v, c = _call(lq=1)
    rows = torch.zeros(B, H, 64, dtype=torch.float64)
    rows[..., : 1 + LK] = c
    strided = rows.narrow(-1, 0, 1 + LK)

    def forward(bias):
        none = dict(gate_kind=0, gate=None, gate_index=None, float_mask=None, bool_mask=None)
        return torch.ops.urpe_cpp.forward(
            q, k, v, bias_kind=CrossDecay.code, bias=bias, bias_index=None, **none,
            key_padding=None, documents=None, fixed=None, causal=False, norm=0, scale=0.3,
            dropout_p=0.0, dropout_threshold=0, dropout_seed=None, block_q=4, block_k=8,
        )  # fmt: skip

    got, want = forward(strided), forward(c.float().contiguous())
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
