"""URPE attention as a Triton kernel (FlashAttention-2 with a post-softmax gate), backend "triton".

Importing this package does not import Triton: the kernels (`kernels.py`) and the torch ops around
them (`ops.py`) load on the first call, so that `urpe` stays importable with torch alone.

Where it runs:
- CUDA tensors: natively; "auto" takes it first for every call it supports that carries a bias,
  a gate or a non-softmax normalisation (plain softmax goes to SDPA's FlashAttention).
- CPU tensors: only under Triton's interpreter, which executes the same kernels with numpy. Set
  `TRITON_INTERPRET=1` in the environment before `triton` is first imported (Triton decides at
  import and at kernel definition whether to interpret). It is for testing: "auto" never picks
  it on the CPU; ask for it with `backend="triton"`.

Supported: every normalisation ("softmax", "exp", "l2", "relu2"), bias and gate as `Toeplitz`,
`Relation` or dense tensors (each with gradients), a `Decay` bias (formed per tile from
cumsum(log_forget), O(L) memory, gradient to log_forget without atomics), key padding, causal
masking (tiles beyond the diagonal skipped), packed documents (`document_ids`, (B, Lk) ids read
per tile, O(L) memory; tiles sharing no document skipped), `attn_mask` (bool: read per tile,
hidden pairs weigh exactly 0; float: added to the bias, which is then expanded to a dense
(B, H, Lq, Lk) tensor, so prefer a bias table or a bool mask where memory matters), Lq != Lk,
grouped-query attention (k and v with fewer heads), float16, bfloat16 (float32 accumulation),
float32 and float64, head dims 1 to 256 (padded to a
power of two >= 16; 16 to 128 is what it is tuned and tested for), dropout after the gate. It
composes with `torch.func.grad`, `vmap` (per-example gradients included), `functional_call` and
`torch.compile(fullgraph=True)`. See `ops.py` for the autotuning key and cache, for why table
gradients use atomics and for the deterministic mode (`torch.use_deterministic_algorithms`);
`launch.py` for the tile configurations, the grid, and the failures that make "auto" fall back;
the repository's `benchmarks/compile_kernels.py` for the registers, spills and shared memory of
every configuration.
"""

from __future__ import annotations

from torch import Tensor

from ..backends import Backend, BackendFailure
from ..spec import AttentionSpec, resolve
from .support import (
    MAX_HEAD_DIM,
    TRITON_CAPABILITIES,
    interpreter_state,
    refusal,
    spec_defers,
    spec_unsupported,
    triton_missing,
)


def _resolved_or_reason(q: Tensor, k: Tensor, v: Tensor, kwargs: dict):
    try:
        return resolve(q, k, v, enable_gqa=True, **kwargs), None
    except (TypeError, ValueError) as error:
        return None, str(error)


def triton_unsupported(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> str | None:
    """Why the Triton kernel cannot run `urpe.attention(q, k, v, **kwargs)`, or None when it can
    (k and v may have fewer heads than q)."""
    spec, reason = _resolved_or_reason(q, k, v, kwargs)
    return reason if spec is None else refusal(spec)


def triton_defers(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> str | None:
    """Why "auto" would leave `urpe.attention(q, k, v, **kwargs)` to another backend."""
    spec, reason = _resolved_or_reason(q, k, v, kwargs)
    return reason if spec is None else spec_defers(spec)


def triton_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """URPE attention on the Triton kernel; the arguments are `ops.triton_attention`'s (bias,
    gate, attn_mask, key_padding_mask, is_causal, normalization, scale, dropout_p, dropout_seed,
    block_q, block_k). A forwarder, so that importing this package does not import Triton.

    k and v may have fewer heads than q (grouped-query attention).
    """
    from .ops import triton_attention as run

    return run(q, k, v, **kwargs)


def dropout_keep_mask(batch, heads, lq, lk, dropout_p, seed, device="cpu") -> Tensor:
    """The (B, H, Lq, Lk) bool keep mask the kernel uses for this seed (for tests)."""
    from .ops import dropout_keep_mask as make

    return make(batch, heads, lq, lk, dropout_p, seed, device)


def _spec_run(spec: AttentionSpec) -> Tensor:
    try:
        from .ops import triton_run
    except Exception as error:  # noqa: BLE001 - Triton missing or broken: a backend failure
        raise BackendFailure(
            f"Triton cannot be imported: {type(error).__name__}: {error}"
        ) from error
    return triton_run(spec)


def triton_backend() -> Backend:
    """The registry's entry: "auto" puts it before the blockwise kernel, and it defers CPU calls
    and plain softmax (see `triton_defers`)."""
    return Backend(
        "triton",
        _spec_run,
        spec_unsupported,
        priority=40,
        defers=spec_defers,
        capabilities=TRITON_CAPABILITIES,
    )


__all__ = [
    "MAX_HEAD_DIM",
    "TRITON_CAPABILITIES",
    "dropout_keep_mask",
    "spec_defers",
    "spec_unsupported",
    "interpreter_state",
    "triton_attention",
    "triton_backend",
    "triton_defers",
    "triton_missing",
    "triton_unsupported",
]
