"""The C++ backend's run(spec): the kernel behind its custom ops (`ops`, imported on first use)."""

from __future__ import annotations

from torch import Tensor

from ..layout import ForwardArgs
from ..reference import draw_seed
from ..spec import AttentionSpec


def cpp_run(spec: AttentionSpec, block_q: int = 0, block_k: int = 0) -> Tensor:
    """The C++ backend: (B, H, Lq, Dv) in q's dtype. block_q, block_k: tile sizes (0: the
    tuned defaults)."""
    from .ops import CPP, reads_in_place

    if spec.dropout_p > 0.0 and spec.dropout_seed is None:
        spec = spec.replace(dropout_seed=draw_seed(spec.q.device))
    # A short call reads views of a training step's (B, L, H, D) projections in place and
    # writes their gradients in that layout. A long one copies q, k, v here, before the
    # kernel's autograd Function, which then saves the copies for its backward.
    if not reads_in_place(spec.q, spec.k):
        spec = spec.replace(q=_contiguous(spec.q), k=_contiguous(spec.k), v=_contiguous(spec.v))
    out = CPP(ForwardArgs.from_spec(spec, block_q, block_k))
    return out if out.dtype == spec.q.dtype else out.to(spec.q.dtype)


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()
