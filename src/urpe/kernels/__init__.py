"""Attention kernels: pure functions on tensors. Depends on torch alone."""

from .dispatch import AUTO_ORDER, BACKENDS, Backend, attention, register_backend, select_backend
from .flex import flex_backend
from .reference import reference_attention, reference_weights
from .tables import PositionTerm, Relation, Toeplitz, dense_term, query_positions, relative_offsets
from .triton import triton_backend

# The GPU backends. "triton" goes first in "auto" (it declines CPU calls and plain softmax);
# "flex" runs only when asked for by name (the exact FlexAttention route, the baseline).
register_backend(triton_backend(), auto_priority=0)
register_backend(flex_backend())

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "Backend",
    "PositionTerm",
    "Relation",
    "Toeplitz",
    "attention",
    "dense_term",
    "query_positions",
    "reference_attention",
    "reference_weights",
    "register_backend",
    "relative_offsets",
    "select_backend",
]
