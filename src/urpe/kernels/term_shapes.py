"""What a term is checked and keyed against: the call's shape (`CallShape`), and the checks and
signature parts every kind of term shares (broadcasting, device, dtype, the keys' length left
out of a signature, leading batch dims flattened)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .dtypes import HALF


@dataclass(frozen=True, slots=True)
class CallShape:
    """The call a term is checked against: q's dtype and device, and (*batch, H, Lq, Lk)."""

    batch: tuple[int, ...]
    heads: int
    lq: int
    lk: int
    dtype: torch.dtype
    device: torch.device

    @property
    def full(self) -> tuple[int, ...]:
        return (*self.batch, self.heads, self.lq, self.lk)


# Stands for the keys' length Lk in a signature: a prepared call serves any Lk (a growing KV
# cache), and nothing it decided depends on Lk.
ANY_LENGTH = "Lk"


def length_free(shape: torch.Size, lk: int) -> tuple:
    """A shape whose last dim, where it is Lk, reads `ANY_LENGTH` (every tensor of a call that
    runs over the keys has them as its last dim: masks, dense terms, indices, decays, ids)."""
    if shape and shape[-1] == lk:
        return (*shape[:-1], ANY_LENGTH)
    return tuple(shape)


def tensor_signature(t: Tensor | None, lk: int) -> tuple | None:
    """(type, length-free shape, dtype, device) of a tensor in a signature."""
    if t is None:
        return None
    return (type(t), length_free(t.shape, lk), t.dtype, t.device)


def broadcasts(name: str, shape: tuple[int, ...], full: tuple[int, ...], what: str) -> None:
    """ValueError unless `shape` broadcasts to `full` (its dims, right-aligned, are 1 or full's)."""
    if len(shape) > len(full):
        raise ValueError(f"{name} must broadcast to {what} = {full}, got rank {len(shape)}")
    for n, m in zip(reversed(shape), reversed(full), strict=False):  # len(shape) <= len(full)
        if n != m and n != 1:
            reason = "is larger than" if m == 1 else "does not broadcast to"
            raise ValueError(f"{name} of shape {tuple(shape)} {reason} {what} = {full}")


def check_device(name: str, t: Tensor, call: CallShape) -> None:
    if t.device != call.device:
        raise ValueError(f"{name} is on {t.device} but q is on {call.device}")


def check_dtype(name: str, t: Tensor, call: CallShape) -> None:
    """A term's floating-point tensor has q's dtype, or any floating dtype for half-precision q
    (computed in float32 anyway)."""
    if t.dtype != call.dtype and call.dtype not in HALF:
        raise TypeError(f"{name} dtype {t.dtype} does not match q dtype {call.dtype}")


def flatten_leading(t: Tensor, batch_shape: tuple[int, ...], trailing: int) -> Tensor:
    """(..., *trailing dims) broadcastable over batch_shape -> (B|1, *trailing dims).

    No copy when the leading dims are all 1 or all of batch_shape; a partial broadcast expands.
    """
    if len(batch_shape) == 1 and t.dim() == trailing + 1:  # (B|1, ...): already the form
        return t
    t = t.reshape((1,) * (len(batch_shape) + trailing - t.dim()) + tuple(t.shape))
    lead, rest = tuple(t.shape[: len(batch_shape)]), tuple(t.shape[len(batch_shape) :])
    if all(n == 1 for n in lead):
        return t.reshape(1, *rest)
    if lead != batch_shape:
        t = t.expand(*batch_shape, *rest)
    return t.reshape(math.prod(batch_shape), *rest)
