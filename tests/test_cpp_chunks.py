"""The C++ kernel's workers take short work items in chunks of consecutive items (gemm.cpp's
`chunk_for`): every item is still run exactly once, the last chunk cut short at the end."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import Toeplitz, reference_attention
from urpe.kernels.cpp import cpp_attention, threaded, unavailable

pytestmark = pytest.mark.skipif(
    unavailable() is not None, reason=f"the C++ kernel is unavailable: {unavailable()}"
)
F64 = dict(dtype=torch.float64)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not threaded(), reason="the kernel was built without OpenMP")
def test_chunks_of_short_items_cover_every_item_once(two_threads):
    """111 (batch, head) items of a 20 x 20 problem each on two threads: chunks of 6, the last
    of 3. Output and every gradient equal the reference's."""
    b, h, length, d = 37, 3, 20, 8
    assert torch.ops.urpe_cpp.workers(b * h, b * h * length * length * 2 * d, length) == 2
    gen = torch.Generator().manual_seed(5)
    leaves = [torch.randn(b, h, length, d, generator=gen, **F64) for _ in range(3)]
    tables = [torch.randn(h, 2 * length - 1, generator=gen, **F64) for _ in range(2)]
    grad = torch.randn(b, h, length, d, generator=gen, **F64)

    def step(run):
        params = [t.clone().requires_grad_() for t in (*leaves, *tables)]
        q, k, v, bias, gate = params
        out = run(q, k, v, bias=Toeplitz(bias), gate=Toeplitz(gate), is_causal=True)
        out.backward(grad)
        return [out.detach(), *(p.grad for p in params)]

    for got, want in zip(step(cpp_attention), step(reference_attention), strict=True):
        torch.testing.assert_close(got, want)
