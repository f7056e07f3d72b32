"""`urpe.attention`: one functional entry point, several interchangeable kernels.

A backend is a kernel with SDPA's calling convention plus a function telling why it cannot run a
given call (None when it can). "auto" walks the preference list and takes the first that can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from .fused import fused_attention, fused_defers, fused_unsupported
from .reference import reference_attention
from .sdpa import sdpa_attention, sdpa_unsupported
from .tables import PositionTerm
from .validation import check_attention_inputs


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[..., Tensor]
    unsupported: Callable[..., str | None]
    # Why "auto" should leave a call it could run to a later, faster backend (None: take it).
    defers: Callable[..., str | None] | None = None


def _always(**_unused) -> str | None:
    return None


BACKENDS: dict[str, Backend] = {}
# Tried in this order by backend="auto"; the reference always applies, so it comes last.
AUTO_ORDER: list[str] = []


def register_backend(backend: Backend, *, auto_priority: int | None = None) -> None:
    """Add a kernel; auto_priority is its place in "auto"'s order (0 first, None: never)."""
    BACKENDS[backend.name] = backend
    if backend.name in AUTO_ORDER:
        AUTO_ORDER.remove(backend.name)
    if auto_priority is not None:
        AUTO_ORDER.insert(auto_priority, backend.name)


register_backend(Backend("reference", reference_attention, _always), auto_priority=0)
register_backend(Backend("sdpa", sdpa_attention, sdpa_unsupported), auto_priority=0)
# Fused goes first: it takes gates, structured biases and every normalisation, and leaves plain
# softmax to SDPA (see `fused_defers` for the measured rule).
register_backend(
    Backend("fused", fused_attention, fused_unsupported, defers=fused_defers), auto_priority=0
)


def select_backend(backend: str, **call) -> Backend:
    """The kernel `attention` would use for this call."""
    if backend == "auto":
        for name in AUTO_ORDER:
            candidate = BACKENDS[name]
            if candidate.unsupported(**call) is None and (
                candidate.defers is None or candidate.defers(**call) is None
            ):
                return candidate
        raise AssertionError("the reference backend supports every call")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    reason = BACKENDS[backend].unsupported(**call)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run this call: {reason}")
    return BACKENDS[backend]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias: PositionTerm | None = None,
    gate: PositionTerm | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    normalization: str = "softmax",
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """URPE attention: out = dropout(normalize(scale * q k^T + B) * C) @ v.

    Args:
        q: (B, H, Lq, D) queries. k: (B, H, Lk, D) keys. v: (B, H, Lk, Dv) values.
        bias: B, added to the logits before normalisation. A tensor broadcastable to
            (B, H, Lq, Lk), a `Toeplitz` table over offsets j - i, or a `Relation` table.
        gate: C, multiplied into the weights after normalisation (URPE). Same forms as bias.
        key_padding_mask: (B, Lk) bool, True marks a padded key (as in nn.MultiheadAttention).
        is_causal: query i sees keys j <= i + Lk - Lq (queries are the last Lq positions).
        normalization: "softmax", "exp" (no denominator), "l2" (exp / l2 norm of the row) or
            "relu2" (relu(s)^2 / number of unmasked keys).
        scale: logit scale, default 1 / sqrt(D).
        dropout_p: dropout on the weights (after the gate). Pass 0 at evaluation.
        backend: "auto" (fastest that applies), or a name from `urpe.kernels.BACKENDS`.

    Returns:
        (B, H, Lq, Dv). Masked keys get weight exactly 0; a query with no visible key returns 0.
    """
    check_attention_inputs(q, k, v, bias, gate, key_padding_mask, normalization, dropout_p)
    call = dict(
        bias=bias,
        gate=gate,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        normalization=normalization,
        scale=scale,
        dropout_p=dropout_p,
    )
    kernel = select_backend(backend, q=q, k=k, v=v, **call)
    return kernel.run(q, k, v, **call)
