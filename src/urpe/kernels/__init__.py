"""Attention kernels: pure functions on tensors. Depends on torch alone."""

from .dispatch import AUTO_ORDER, BACKENDS, Backend, attention, register_backend, select_backend
from .reference import reference_attention, reference_weights
from .tables import PositionTerm, Relation, Toeplitz, dense_term, query_positions, relative_offsets

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
