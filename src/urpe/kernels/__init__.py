"""Attention kernels: pure functions on tensors. Depends on torch alone.

`attention` is the entry point; `BACKENDS` and `NORMALIZATIONS` are the registries a new kernel
or normalisation is added to (see `dispatch` and `normalization`).
"""

from .capabilities import Capabilities
from .cpp import cpp_backend
from .dispatch import (
    AUTO_ORDER,
    BACKENDS,
    Backend,
    attention,
    choose_backend,
    native_backends,
    reference_attention,
    register_backend,
    select_backend,
)
from .flex import flex_backend
from .masks import causal_keep
from .normalization import NORMALIZATIONS, Normalization, register_normalization
from .reference import reference_weights
from .spec import AttentionSpec, resolve
from .tables import (
    Decay,
    PositionTerm,
    Relation,
    Toeplitz,
    dense_term,
    query_positions,
    relative_offsets,
)
from .triton import triton_backend
from .watched import registered

# The GPU backends. "triton" goes first in "auto" (it declines CPU calls and plain softmax);
# "flex" runs only when asked for by name (the exact FlexAttention route, the baseline).
register_backend(triton_backend())
register_backend(flex_backend())
# The compiled CPU tile loop, before "blockwise" in "auto" on the CPU (built on first use; where
# it cannot be built, "auto" warns once and "blockwise" runs).
register_backend(cpp_backend())

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "NORMALIZATIONS",
    "AttentionSpec",
    "Backend",
    "Decay",
    "Capabilities",
    "Normalization",
    "PositionTerm",
    "Relation",
    "Toeplitz",
    "attention",
    "causal_keep",
    "choose_backend",
    "native_backends",
    "dense_term",
    "query_positions",
    "reference_attention",
    "reference_weights",
    "register_backend",
    "register_normalization",
    "registered",
    "relative_offsets",
    "resolve",
    "select_backend",
]
