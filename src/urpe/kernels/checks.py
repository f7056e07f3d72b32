"""Data-dependent checks as opaque custom ops, so that they hold under every transform.

A check that reads tensor values (is every relation index in range? did `exp` overflow?) needs a
host sync and a Python branch: in eager that is a plain `if`, but `torch.compile(fullgraph=True)`
cannot trace it and `vmap` cannot branch on a batched value. Each check here is a
`torch.library.custom_op` that returns a fresh tensor the caller goes on using (so the compiler
keeps it), with a fake implementation for tracing and a vmap rule; it raises the same ValueError
in eager, compiled and vmapped code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .host import may_read


@torch.library.custom_op("urpe::checked_relation_index", mutates_args=())
def _checked_relation_index(index: Tensor, size: int, name: str) -> Tensor:
    _check_range(index, size, name)
    return index.to(torch.int64, copy=True).contiguous()


@_checked_relation_index.register_fake
def _(index: Tensor, size: int, name: str) -> Tensor:
    return torch.empty(index.shape, dtype=torch.int64, device=index.device)


@_checked_relation_index.register_vmap
def _(info, in_dims, index: Tensor, size: int, name: str):
    return _checked_relation_index(index, size, name), in_dims[0]


def checked_relation_index(index: Tensor, size: int, name: str) -> Tensor:
    """index as int64; ValueError naming `name` unless every entry is in [0, size).

    Where values may be read (the CPU, eager) the check runs directly; under torch.compile and
    torch.func through the custom op above. Where they may not (an accelerator) it is a device
    assertion, which never makes the host wait (the call fails at the next synchronisation,
    with a device-side assertion naming `name`): see `host`.
    """
    if may_read(index):
        _check_range(index, size, name)
        return index if index.dtype == torch.int64 else index.long()
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return _checked_relation_index(index, size, name)
    torch._assert_async(
        ((index >= 0) & (index < size)).all(),
        f"{name} index must lie in [0, {size}) (the {name} table has {size} relations)",
    )
    return index if index.dtype == torch.int64 else index.long()


def _check_range(index: Tensor, size: int, name: str) -> None:
    if index.numel():
        low, high = (int(x) for x in torch.aminmax(index.to(torch.int64)))
        if low < 0 or high >= size:
            bad = low if low < 0 else high
            raise ValueError(
                f"{name} index must lie in [0, {size}) (the {name} table has {size} "
                f"relations), got {bad}"
            )


@torch.library.custom_op("urpe::checked_finite_output", mutates_args=())
def _checked_finite_output(out: Tensor, expected_nan: Tensor, normalization: str) -> Tensor:
    unexpected = ~torch.isfinite(out) & ~expected_nan
    if bool(unexpected.any()):
        limit = torch.finfo(out.dtype).max
        raise ValueError(
            f"normalization={normalization!r} overflowed: the result holds inf/NaN although q, "
            f"k and v are finite. exp(s) has no denominator and exceeds {out.dtype}'s largest "
            f"value ({limit:.3g}) once a logit passes {math.log(limit):.1f} "
            "(less when many keys add up); lower `scale` or the bias, compute in float64, or "
            "use 'softmax' or 'l2' (a bias or gate holding inf/NaN also ends here)"
        )
    return out.clone()


@_checked_finite_output.register_fake
def _(out: Tensor, expected_nan: Tensor, normalization: str) -> Tensor:
    return torch.empty_like(out)


@_checked_finite_output.register_vmap
def _(info, in_dims, out: Tensor, expected_nan: Tensor, normalization: str):
    out_dim, nan_dim = in_dims[:2]
    out = (
        out.movedim(out_dim, 0) if out_dim is not None else out.expand(info.batch_size, *out.shape)
    )
    if nan_dim is not None:
        expected_nan = expected_nan.movedim(nan_dim, 0)
    return _checked_finite_output(out, expected_nan, normalization), 0


class _CheckedFiniteOutput(torch.autograd.Function):
    """Identity with a check; the gradient passes through unchanged."""

    generate_vmap_rule = True

    @staticmethod
    def forward(out: Tensor, expected_nan: Tensor, normalization: str) -> Tensor:
        return _checked_finite_output(out, expected_nan, normalization)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None


def checked_finite_output(out: Tensor, expected_nan: Tensor, normalization: str) -> Tensor:
    """A copy of out; ValueError if it holds inf/NaN where `expected_nan` (broadcast) is False."""
    return _CheckedFiniteOutput.apply(out, expected_nan, normalization)
