"""Attention dropout as a pure function of a seed tensor, for the reference kernel.

The keep decision for weight (b, h, i, j) is a hash of the seed and of the weight's flat index, so
the mask needs no generator state: it is the same in eager, compiled and vmapped code and on every
device, and a seed passed as a tensor never has to leave the device (.item() would break a
compiled graph).

A kernel's raw op takes the seed as an int64 tensor: a scalar, or five numbers (seed, first
row, rows, first column, columns) placing the call's (Lq, Lk) weights inside a larger
(B, H, rows, columns) matrix whose flat indices the counter hashes (`seed_placement`): a chunk
of queries against a chunk of keys then draws exactly the entries of the whole call's mask
(context parallelism, `urpe.distributed`).
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # < 2^27: a product with a 32-bit value stays below 2^59, no overflow


def _fold(x: Tensor) -> Tensor:
    return (x ^ (x >> 32)) & _MASK32  # int64 -> 32 bits


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash: two multiply-xorshift rounds (values stay below 2^59)."""
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _MASK32
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _MASK32
    return (x >> 16) ^ x


def uniform_bits(seed: Tensor, counter: Tensor) -> Tensor:
    """32 pseudo-random bits (int64 in [0, 2^32)) per entry of `counter` (int64, >= 0).

    Two hash rounds keyed by two words derived from the seed (scalar work), so that masks of
    different seeds are not permutations of one another.
    """
    first = _mix(_fold(seed))
    second = _mix(first ^ 0x5BD1E995)
    return _mix(_mix(_fold(counter) ^ first) ^ second)


def seed_placement(seed: Tensor, lq: int, lk: int) -> tuple[Tensor, Tensor | int, ...]:
    """(seed, first row, rows, first column, columns) of a raw op's seed tensor (module
    docstring): for a scalar seed the call's own (0, Lq, 0, Lk). The numbers stay tensors (no
    host read); weight (b, h, i, j)'s counter is ((b H + h) rows + first row + i) columns +
    first column + j."""
    if seed.dim() == 0:
        return seed, 0, lq, 0, lk
    return seed[0], seed[1], seed[2], seed[3], seed[4]


def keep_threshold(p: float) -> int:
    """An entry is kept when its 32 bits are below this: probability 1 - p."""
    return int(round((1.0 - p) * 2**32))


def dropout_scale(seed: Tensor, p: float, shape: tuple[int, ...], dtype, device) -> Tensor:
    """keep / (1 - p) for a tensor of `shape`; keep has probability 1 - p per entry."""
    counter = torch.arange(int(torch.Size(shape).numel()), device=device).view(shape)
    return dropout_scale_at(seed, p, counter, dtype)


def dropout_scale_at(seed: Tensor, p: float, counter: Tensor, dtype) -> Tensor:
    """keep / (1 - p) for the weights whose flat indices are `counter` (int64, any shape): the
    entries of `dropout_scale`'s full tensor at those indices (a kernel's tile)."""
    keep = uniform_bits(seed.to(device=counter.device, dtype=torch.int64), counter)
    return (keep < keep_threshold(p)).to(dtype) / (1.0 - p)
