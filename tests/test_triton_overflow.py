"""What the interpreter hides, checked under it: 32-bit offset overflow, grid limits, the
dropout counter, recompilation per length. (A GPU wraps int32 arithmetic silently; the
interpreter computes with numpy's int32 and wraps the same way, so these checks are faithful.)"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from urpe.kernels.triton import kernels as K
from urpe.kernels.triton import launch, triton_unsupported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _corner_probe(out_ptr, b, s_b, h, s_h, m0, s_i, n0, s_j):
    tl.store(out_ptr, K.origin(b, s_b, h, s_h, m0, s_i, n0, s_j))


@triton.jit
def _naive_probe(out_ptr, b, s_b, h, s_h, m0, s_i, n0, s_j):
    tl.store(out_ptr, (b * s_b + h * s_h + m0 * s_i + n0 * s_j).to(tl.int64))


# (b, s_b, h, s_h, m0, s_i, n0, s_j), each below 2^31, products above: a dense (B, H, L, L) term
# at B*H*L^2 > 2^31, a mask read through a transposed view, a long sequence's row stride.
HUGE = [
    (9, 2**28, 7, 2**24, 0, 0, 0, 0),
    (0, 0, 0, 0, 60000, 50000, 70000, 1),
    (1, 2**30, 1, 2**30, 16000, 2**17, 5, 2**20),
]


@pytest.mark.parametrize("values", HUGE)
def test_tile_corners_are_computed_in_64_bits(values):
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    _corner_probe[(1,)](out, *values)
    b, s_b, h, s_h, m0, s_i, n0, s_j = values
    assert int(out) == b * s_b + h * s_h + m0 * s_i + n0 * s_j > 2**31


def test_the_probe_can_fail_int32_arithmetic_wraps():
    """The check above is not vacuous: the same sum in 32 bits comes out wrong."""
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    values = HUGE[1]
    _naive_probe[(1,)](out, *values)
    b, s_b, h, s_h, m0, s_i, n0, s_j = values
    assert int(out) != b * s_b + h * s_h + m0 * s_i + n0 * s_j


@triton.jit
def _program_probe(out_ptr, length, BLOCK: tl.constexpr):
    tile, row = K.program(length, BLOCK)
    tl.store(out_ptr + tl.program_id(0) * 2, tile)
    tl.store(out_ptr + tl.program_id(0) * 2 + 1, row)


def test_one_grid_axis_holds_every_head_with_tiles_fastest():
    """b * h = 512 * 128 programs per tile would pass grid axis 1's limit of 65,535: the grid is
    one axis (limit 2^31 - 1), decoded as (tile, row) with the tile fastest."""
    big = launch.Launch("backward_kv", (), {}, length=1000, rows=512 * 128)
    grid = launch.grid_size(big, {"BLOCK_N": 64})
    assert len(grid) == 1 and grid[0] == 16 * 512 * 128 <= 2**31 - 1
    small = launch.Launch("forward", (), {}, length=40, rows=3)
    (programs,) = launch.grid_size(small, {"BLOCK_M": 16})
    out = torch.zeros(programs, 2, dtype=torch.int32, device=DEVICE)
    _program_probe[(programs,)](out, 40, BLOCK=16)
    expected = [(t, r) for r in range(3) for t in range(3)]
    assert [tuple(x) for x in out.tolist()] == expected


def test_dropout_counters_that_would_wrap_are_refused():
    """The Philox counter is i Lk + j in 32 bits: a head with Lq Lk >= 2^32 would repeat masks,
    so the kernel refuses dropout there ("auto" moves on) and accepts it just below."""
    q = torch.zeros(1, 1, 2**16, 1, device=DEVICE)
    assert "Philox" in triton_unsupported(q, q, q, dropout_p=0.1)
    assert triton_unsupported(q, q[:, :, :-1], q[:, :, :-1], dropout_p=0.1) is None
    assert triton_unsupported(q, q, q) is None


@pytest.mark.slow
def test_lengths_in_one_power_of_two_share_a_tuning_key():
    """The autotuner keys on the next power of two of each length, so a new length in a bucket
    reuses the tuned configuration (and Triton's own specialisation, divisible by 16 or not,
    compiles at most a few variants) instead of tuning and compiling per length."""
    from harness.launches import Call, recorded

    calls = {n: Call(dtype="bfloat16", lq=n, lk=n) for n in (1000, 1017, 1024, 1025)}
    found = recorded(list(calls.values()))  # what `urpe.attention` launches at each length

    def key(length):
        one = next(x for x in found[calls[length]] if x.kernel == "forward")
        names = launch.KERNELS["forward"].arg_names
        runtime = [n for n in names if n not in one.constants and n not in ("BLOCK_M", "BLOCK_N")]
        named = dict(zip(runtime, one.args, strict=True), **one.constants)
        return tuple(named[name] for name in launch.TUNING_KEY)

    assert key(1000) == key(1017) == key(1024)
    assert key(1025) != key(1024)
