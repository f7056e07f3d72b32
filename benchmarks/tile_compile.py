"""Does torch.compile (Inductor) speed up one fused-kernel tile's elementwise work?

Times, on one (1, H, bq, bk) score tile with Toeplitz B and C read as Hankel views, the eager ops
the fused kernel runs against the same maths compiled:
  forward:  softmax(s + B) * C
  backward: A = P * C, dC = dA * P, dS = P * (dA * C - delta), with P recomputed
The result quoted in benchmarks/README.md came from this script (default sizes, median of 15).

    python benchmarks/tile_compile.py [--heads 8 --block-q 128 --block-k 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from urpe.kernels.fused_terms import hankel_view


def forward_eager(s, b, c):
    s.add_(b)
    p = torch.softmax(s, -1, out=s)
    return p.mul_(c)


def forward_pure(s, b, c):
    return torch.softmax(s + b, -1) * c


def backward_eager(s, b, c, da, delta):
    s.add_(b)
    p = torch.softmax(s, -1, out=s)
    a, dc = torch.mul(p, c), torch.mul(da, p)
    ds = da.mul_(c).sub_(delta).mul_(p)
    return a, dc, ds


def backward_pure(s, b, c, da, delta):
    p = torch.softmax(s + b, -1)
    return p * c, da * p, p * (da * c - delta)


def median_ms(fn, make_args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        args = make_args()  # fresh copies: the eager versions work in place
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    h, bq, bk = args.heads, args.block_q, args.block_k
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(1, h, bq, bk, generator=gen)
    b = hankel_view(0.1 * torch.randn(h, bq + bk - 1, generator=gen), bq, bk)[None]
    c = hankel_view(1 + 0.1 * torch.randn(h, bq + bk - 1, generator=gen), bq, bk)[None]
    da = torch.randn(1, h, bq, bk, generator=gen)
    delta = torch.randn(1, h, bq, 1, generator=gen)
    forward_compiled = torch.compile(forward_pure, dynamic=False)
    backward_compiled = torch.compile(backward_pure, dynamic=False)
    torch.testing.assert_close(forward_compiled(s.clone(), b, c), forward_eager(s.clone(), b, c))
    backward_compiled(s.clone(), b, c, da.clone(), delta)  # compile before timing
    fwd_args = lambda: (s.clone(), b, c)  # noqa: E731
    bwd_args = lambda: (s.clone(), b, c, da.clone(), delta)  # noqa: E731
    for name, fn, make in (
        ("forward, eager", forward_eager, fwd_args),
        ("forward, compiled", forward_compiled, fwd_args),
        ("backward, eager", backward_eager, bwd_args),
        ("backward, compiled", backward_compiled, bwd_args),
    ):
        print(f"{name:20s} {median_ms(fn, make, args.repeats):7.2f} ms per tile")


if __name__ == "__main__":
    main()
