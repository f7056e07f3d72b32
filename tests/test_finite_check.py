"""The C++ finiteness check that every eager CPU call asks of q, k and v
(`torch.ops.urpe_cpp.all_finite`), against torch.isfinite."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels.cpp import cpp_all_finite, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="the C++ kernel is not built")

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _views(t: torch.Tensor):
    """The tensor and views of it with other strides: transposed, sliced, stepped."""
    yield t
    yield t.transpose(1, 2)  # last dim still of stride 1 (q as transformers makes it)
    yield t[:, :, 1:, 1:]
    yield t[..., ::2]  # last stride 2
    yield t.transpose(-1, -2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_non_finite_entry_is_found_in_every_layout(dtype, bad):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 5, 7, generator=gen).to(dtype)
    for index in [(0, 0, 0, 0), (1, 2, 4, 6), (1, 0, 3, 2)]:
        t = base.clone()
        t[index] = bad
        for view in _views(t):
            expected = bool(torch.isfinite(view).all())
            assert torch.ops.urpe_cpp.all_finite([base, view]) is expected


def test_finite_tensors_of_any_size_and_empty_or_integer_ones():
    big = torch.randn(9, 70_000)  # several parallel chunks (past 2^19 entries)
    assert torch.ops.urpe_cpp.all_finite([big, torch.empty(0, 4), torch.arange(5)])
    big[8, 69_999] = float("inf")
    assert not torch.ops.urpe_cpp.all_finite([big])
    huge = torch.full((4,), 3.0e38)  # finite, although a sum of them overflows
    assert cpp_all_finite((huge, huge, huge))


def test_a_decoding_steps_keys_are_checked_on_one_thread():
    """Up to 2^19 entries (the keys or values of a decoding step up to Lk = 2048 at B = 1,
    H = 8, D = 32) the check runs on the calling thread: a parallel region would wait for a
    busy core's time slice (the kernel runs such a step on one thread too); past it, on
    torch's threads."""
    threads = torch.ops.urpe_cpp.all_finite_threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert threads(8 * 2048 * 32) == 1
        assert threads(8 * 2048 * 32 + 1) == 2
        torch.set_num_threads(1)
        assert threads(8 * 4096 * 32) == 1
    finally:
        torch.set_num_threads(before)
