"""What happens around every backend: empty calls, non-finite inputs, overflow, batch dims.

A backend's `run(spec)` only computes attention on a non-empty call with finite q, k and v.
`execute` gives every backend the same behaviour at the edges, so a new backend inherits it:

- empty calls (B, H, Lq or Dv zero, or no keys at all) return zeros without running the backend,
  with zero gradients for every input (a query that sees no key returns 0); so do calls with
  dropout_p = 1, which drop every weight (SDPA and nn.Dropout(1.0) give zeros too);
- non-finite q, k, v follow the rule in `nonfinite`;
- a normalisation without an upper bound (`exp`) that overflows raises a ValueError instead of
  returning inf/NaN;
- SDPA's leading batch dims are restored on the output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .checks import checked_finite_output
from .nonfinite import all_finite_now, guarded
from .spec import AttentionSpec


def _term_tensors(spec: AttentionSpec) -> list[Tensor]:
    """The floating-point tensors of the bias, gate and attn_mask (what a gradient reaches)."""
    return [t for t in spec.differentiable[3:] if t is not None and t.is_floating_point()]


def empty_result(spec: AttentionSpec) -> Tensor:
    """Zeros of shape (B, H, Lq, Dv), connected to every input so that backward gives zeros.

    (q k^T) v over an empty key axis is exactly 0 whatever q holds; each term joins through a
    where() that never selects it, which keeps NaN in a term out of the result.
    """
    none = slice(0, 0)
    k, v = spec.k[:, :, none], spec.v[:, :, none]  # (B, Hkv, 0, D), (B, Hkv, 0, Dv)
    if spec.groups > 1:
        k, v = k.repeat_interleave(spec.groups, 1), v.repeat_interleave(spec.groups, 1)
    out = (spec.q @ k.transpose(-2, -1)) @ v  # (B, H, Lq, Dv), all 0
    for t in _term_tensors(spec):
        never = torch.zeros((), dtype=torch.bool, device=t.device)
        out = out + torch.where(never, t, 0.0).sum().to(out.dtype)
    return out


def execute(
    run: Callable[[AttentionSpec], Tensor | None],
    spec: AttentionSpec,
    finds_nonfinite: bool = False,
) -> Tensor:
    """run(spec) with the behaviour above; returns (*batch_shape, H, Lq, Dv) in q's dtype.
    finds_nonfinite: the backend's table says so (`nonfinite.guarded`)."""
    if spec.is_empty or spec.dropout_p == 1.0:
        out = empty_result(spec)
    else:
        out, poison = guarded(run, spec, finds_nonfinite)
        if spec.norm.overflows:
            out = _checked_overflow(out, poison, spec)
    if len(spec.batch_shape) == 1:  # (B, H, Lq, Dv) already
        return out
    return out.reshape(*spec.batch_shape, spec.heads, spec.lq, spec.value_dim)


def _checked_overflow(out: Tensor, poison: Tensor | None, spec: AttentionSpec) -> Tensor:
    expected = poison if poison is not None else torch.zeros((), dtype=torch.bool)
    expected = expected.to(out.device)
    finite = all_finite_now(out)
    if finite is None:  # compiled, vmapped or off CPU: an op that copies, checks and stays traced
        return checked_finite_output(out, expected, spec.normalization)
    if not finite:  # eager: the op only runs to check (and raise) when something is off
        checked_finite_output(out.detach(), expected, spec.normalization)
    return out
