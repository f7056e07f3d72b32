"""Attention kernels: pure functions on tensors. Depends on torch alone.

`attention` is the entry point (`dispatch`); `prepare` holds a checked call for reuse
(`prepared`). `BACKENDS` and `NORMALIZATIONS` are the registries a new kernel or normalisation
is added to (`backends`, `normalization`); `Term` is what a new kind of position term derives
from (`terms`).
"""

from .backends import (
    AUTO_ORDER,
    BACKENDS,
    Backend,
    BackendFailure,
    choose_backend,
    native_backends,
    register_backend,
    select_backend,
)
from .capabilities import Capabilities
from .cpp import cpp_backend
from .dispatch import attention, reference_attention
from .documents import Documents
from .flex import flex_backend
from .masks import causal_keep
from .normalization import NORMALIZATIONS, Normalization, register_normalization
from .offsets import query_positions, relative_offsets
from .prepared import AttentionCalls, PreparedAttention, prepare
from .reference import reference_weights
from .spec import Arguments, AttentionSpec, resolve
from .term_shapes import CallShape
from .terms import (
    TERM_KINDS,
    CrossDecay,
    Decay,
    Dense,
    PositionTerm,
    Relation,
    Term,
    Toeplitz,
    dense_term,
    register_term_kind,
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
    "TERM_KINDS",
    "Arguments",
    "AttentionCalls",
    "AttentionSpec",
    "Backend",
    "BackendFailure",
    "CallShape",
    "Capabilities",
    "CrossDecay",
    "Decay",
    "Dense",
    "Documents",
    "Normalization",
    "PositionTerm",
    "PreparedAttention",
    "Relation",
    "Term",
    "Toeplitz",
    "attention",
    "causal_keep",
    "choose_backend",
    "dense_term",
    "native_backends",
    "prepare",
    "query_positions",
    "reference_attention",
    "reference_weights",
    "register_backend",
    "register_normalization",
    "register_term_kind",
    "registered",
    "relative_offsets",
    "resolve",
    "select_backend",
]
