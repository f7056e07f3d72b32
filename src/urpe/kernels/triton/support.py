"""What the Triton kernel can run: its capability table and the checks a table cannot state
(is Triton installed, is its CPU interpreter on, does dropout's counter reach). Shared by the
backend's registry entry (`__init__`) and its public function (`ops.triton_attention`); imports
no Triton.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from ..capabilities import Capabilities, built_in
from ..dtypes import FLOATING
from ..sdpa import SDPA_CAPABILITIES
from ..spec import AttentionSpec

MAX_HEAD_DIM = 256
TRITON_CAPABILITIES = Capabilities(
    "Triton",
    normalizations=built_in("softmax", "exp", "l2", "relu2"),
    dtypes=FLOATING,
    devices=("cuda",),
    emulated=("cpu",),  # under the interpreter (TRITON_INTERPRET=1), for the tests
    max_head_dim=MAX_HEAD_DIM,
)


def refusal(spec: AttentionSpec) -> str | None:
    """Why the Triton kernel cannot run this resolved call (its table, then `spec_unsupported`)."""
    return TRITON_CAPABILITIES.refuses(spec) or spec_unsupported(spec)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "on", "yes")


def triton_missing() -> str | None:
    """Why Triton cannot be imported, or None."""
    if sys.modules.get("triton") is not None or importlib.util.find_spec("triton") is not None:
        return None
    return "Triton is not installed (pip install triton)"


def interpreter_state() -> str | None:
    """Why the Triton interpreter is not usable for CPU tensors, or None when it is."""
    missing = triton_missing()
    if missing is not None:
        return missing
    module = sys.modules.get("triton")
    if module is not None:
        knobs = getattr(module, "knobs", None)  # Triton < 3.4 reads the environment only
        # torch.compile cannot trace the knobs (they read the environment through C++): while
        # tracing, read the variable they read
        on = (
            knobs.runtime.interpret
            if knobs is not None and not torch.compiler.is_compiling()
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


def spec_unsupported(spec: AttentionSpec) -> str | None:
    """Why the Triton kernel cannot run this resolved call beyond its table, or None when it
    can. (On CUDA a missing or broken Triton is found when the call runs: "auto" then warns once
    and moves on.)"""
    q, k, v = spec.q, spec.k, spec.v
    device = q.device.type
    missing = triton_missing()
    if missing is not None and device != "cuda":
        return missing
    if device == "cpu":
        reason = interpreter_state()
        if reason is not None:
            return reason
    elif device != "cuda":
        return f"Triton kernels run on CUDA devices, not {device}"
    if min(q.shape) == 0 or min(k.shape) == 0 or v.shape[-1] == 0:
        return "an empty dimension (nothing to launch)"
    if spec.dropout_p > 0.0 and spec.lq * spec.lk >= 2**32:
        return "dropout's Philox counter covers Lq * Lk < 2^32 entries per head"
    return None


def spec_defers(spec: AttentionSpec) -> str | None:
    """Why "auto" should leave a call the Triton kernel could run to another backend."""
    if spec.q.device.type == "cpu":
        return "Triton's CPU interpreter is for testing; the blockwise kernel is faster"
    plain = spec.gate is None and spec.bias is None and spec.document_ids is None
    if plain and SDPA_CAPABILITIES.implements(spec.norm):  # (SDPA takes documents as a dense mask)
        return "plain softmax attention: SDPA (FlashAttention) is faster"
    return None
