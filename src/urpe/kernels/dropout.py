"""Attention dropout as a pure function of a seed tensor, for the reference kernel.

The keep decision for weight (b, h, i, j) is a hash of the seed and of the weight's flat index, so
the mask needs no generator state: it is the same in eager, compiled and vmapped code and on every
device, and a seed passed as a tensor never has to leave the device (.item() would break a
compiled graph). The hash is two rounds of the "lowbias32" integer mixer (Wellons), computed in
int64 on 32-bit halves so that no product overflows.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for 0 <= x, c < 2^32, as two 16-bit partial products (each < 2^48)."""
    low, high = x & 0xFFFF, x >> 16
    return (low * c + (((high * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_bits(seed: Tensor, counter: Tensor) -> Tensor:
    """32 pseudo-random bits (int64 in [0, 2^32)) per entry of `counter` (int64, >= 0)."""
    h = _mix32((counter & _MASK32) ^ (seed & _MASK32))
    return _mix32(h ^ (counter >> 32) ^ ((seed >> 32) & _MASK32))


def dropout_scale(seed: Tensor, p: float, shape: tuple[int, ...], dtype, device) -> Tensor:
    """keep / (1 - p) for a tensor of `shape`; keep has probability 1 - p per entry."""
    counter = torch.arange(int(torch.Size(shape).numel()), device=device).view(shape)
    threshold = int(round((1.0 - p) * 2**32))
    keep = uniform_bits(seed.to(device=device, dtype=torch.int64), counter) < threshold
    return keep.to(dtype) / (1.0 - p)
