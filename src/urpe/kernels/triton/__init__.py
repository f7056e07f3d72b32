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
`Relation` or dense tensors (each with gradients), key padding, causal masking (tiles beyond the
diagonal skipped), Lq != Lk, grouped-query attention (k and v with fewer heads), float16,
bfloat16 (float32 accumulation), float32 and float64, head dims 1 to 256 (padded to a power of
two >= 16; 16 to 128 is what it is tuned and tested for), dropout after the gate. See `ops.py`
for the autotuning key and cache and for why table gradients use atomics.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from torch import Tensor

from ..dispatch import Backend
from ..tables import Relation
from ..validation import check_attention_inputs

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "on", "yes")


def interpreter_state() -> str | None:
    """Why the Triton interpreter is not usable for CPU tensors, or None when it is."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    module = sys.modules.get("triton")
    if module is not None:
        knobs = getattr(module, "knobs", None)  # Triton < 3.4 reads the environment only
        on = (
            knobs.runtime.interpret
            if knobs is not None
            else _truthy(os.environ.get("TRITON_INTERPRET"))
        )
        if on:
            return None
        if _truthy(os.environ.get("TRITON_INTERPRET")):
            return "triton was imported before TRITON_INTERPRET=1 was set; set it before"
    elif _truthy(os.environ.get("TRITON_INTERPRET")):
        return None
    return (
        "no CUDA tensors: Triton kernels run on CUDA GPUs, or on the CPU under Triton's "
        "interpreter for testing (TRITON_INTERPRET=1 before triton is imported)"
    )


def triton_unsupported(
    *,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    **_unused,
) -> str | None:
    """Why the Triton kernel cannot run this call, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    device = q.device.type
    if device == "cpu":
        reason = interpreter_state()
        if reason is not None:
            return reason
    elif device != "cuda":
        return f"Triton kernels run on CUDA devices, not {device}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not one of float16, bfloat16, float32, float64"
    d, dv = q.shape[-1], v.shape[-1]
    if max(d, dv) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM}, got D={d}, Dv={dv}"
    if min(q.shape) == 0 or min(k.shape) == 0 or v.shape[-1] == 0:
        return "an empty dimension (nothing to launch)"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}"
    if dropout_p > 0.0 and q.shape[-2] * k.shape[-2] >= 2**32:
        return "dropout's Philox counter covers Lq * Lk < 2^32 entries per head"
    return None


def triton_defers(*, q: Tensor, bias=None, gate=None, normalization="softmax", **_unused):
    """Why "auto" should leave a call the Triton kernel could run to another backend."""
    if q.device.type == "cpu":
        return "Triton's CPU interpreter is for testing; the fused kernel is faster"
    if gate is None and bias is None and normalization == "softmax":
        return "plain softmax attention: SDPA (FlashAttention) is faster"
    return None


def _validate(q, k, v, bias, gate, key_padding_mask, normalization, dropout_p) -> None:
    """`urpe.attention`'s argument checks, with k and v allowed fewer heads (GQA)."""
    if isinstance(k, Tensor) and isinstance(q, Tensor) and k.dim() == 4 and q.dim() == 4:
        if k.shape[1] != q.shape[1] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0:
            # shape-only stand-ins with q's head count (views, no copy)
            k = k[:, :1].expand(-1, q.shape[1], -1, -1)
            v = v[:, :1].expand(-1, q.shape[1], -1, -1) if isinstance(v, Tensor) else v
    check_attention_inputs(q, k, v, bias, gate, key_padding_mask, normalization, dropout_p)
    for name, term in (("bias", bias), ("gate", gate)):
        if isinstance(term, Relation) and term.index.numel():
            low, high = int(term.index.min()), int(term.index.max())
            if low < 0 or high >= term.table.shape[1]:
                raise ValueError(
                    f"{name} index values must lie in [0, {term.table.shape[1]}), "
                    f"got [{low}, {high}]"
                )


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias=None,
    gate=None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    normalization: str = "softmax",
    scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    block_m: int = 0,
    block_n: int = 0,
) -> Tensor:
    """URPE attention on the Triton kernel; see `ops.triton_attention` for the arguments.

    k and v may have fewer heads than q (grouped-query attention).
    """
    _validate(q, k, v, bias, gate, key_padding_mask, normalization, dropout_p)
    from .ops import triton_attention as run

    return run(
        q, k, v, bias=bias, gate=gate, key_padding_mask=key_padding_mask, is_causal=is_causal,
        normalization=normalization, scale=scale, dropout_p=dropout_p, seed=seed,
        block_m=block_m, block_n=block_n,
    )  # fmt: skip


def dropout_keep_mask(batch, heads, lq, lk, dropout_p, seed, device="cpu") -> Tensor:
    """The (B, H, Lq, Lk) bool keep mask the kernel uses for this seed (for tests)."""
    from .ops import dropout_keep_mask as make

    return make(batch, heads, lq, lk, dropout_p, seed, device)


def triton_backend() -> Backend:
    """Adapter from the backend registry's call to the kernel (the one place to re-target when
    the registry passes a spec object instead of keyword arguments)."""

    def run(q, k, v, **call) -> Tensor:
        return triton_attention(q, k, v, **call)

    return Backend("triton", run, triton_unsupported, defers=triton_defers)


__all__ = [
    "dropout_keep_mask",
    "interpreter_state",
    "triton_attention",
    "triton_backend",
    "triton_defers",
    "triton_unsupported",
]
