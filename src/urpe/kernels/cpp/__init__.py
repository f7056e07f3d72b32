"""URPE attention as a compiled C++ tile loop on the CPU: backend "cpp", first in "auto" there.

The eager blockwise kernel ("blockwise") runs each step of a tile as its own PyTorch op over an
8 MB score tile, each op parallel on its own: many short passes that each wait for the slowest
thread, which a busy machine makes slow. This kernel keeps a score tile (256 x 512 forward,
128 x 512 backward) in cache and does everything per element on it inside one C++ loop
(`forward.cpp`, `backward.cpp`): q k^T and the products with V by BLAS, then the bias, the
masks, the normalisation, the gate C and dropout row by row, and in the backward the gate's
and the normalisation's rules and the bias and gate gradients (Toeplitz gradients as sums along
each row of an offset-indexed copy). The
work is parallelised once per call over (batch, head, query block) forward and (batch, kv head,
query range) backward, with workers taking the next item when they finish one, so a thread that
shares its core with another process takes fewer items instead of holding the others back.

Same maths as the reference (the specification), every normalisation of the registry's four
built-ins, Toeplitz / Relation / dense bias and gate with their gradients, key padding, causal
masking (key blocks past the diagonal skipped), packed documents (`document_ids`, compared per
row and tiles of disjoint id ranges skipped), a `Decay` bias read from its cumulative sums (O(L),
with its gradient), bool and float `attn_mask`, Lq != Lk, grouped
queries, dropout (the reference's own hash, so both draw the same mask), float64 and float32.
float16 is computed in float32. bfloat16 too, but its seven matrix products take bfloat16
operands (q, k, v, dO as given; the weights and dS rounded to bfloat16) and accumulate in
float32, as SDPA does, where torch's BLAS has a bf16 x bf16 -> float routine (MKL's, on AMX or
AVX512-BF16); elsewhere they run in float32 too. A normalisation registered later (or registered
again with other formulas) is left to "blockwise": see `CPP_CAPABILITIES`.

What it needs: a C++ compiler and ninja when it is first used (see `build`); without them
"auto" warns once and runs "blockwise" instead. The layers are those of the blockwise and Triton
kernels: C++ ops on tensors (`library.cpp`), custom ops with fakes, vmap rules and an autograd
Function around them (`ops.py`), and the backend here. From `CppRun` (a prepared call's run,
`Backend.prepare`; `cpp_run` makes one per call) one route per mode:

- no gradient, eager: `ops.NoGradForward` (made once per prepared call, `CppRun`) ->
  `forward_if_finite` (which also finds NaN/inf in q, k, v: its table says `finds_nonfinite`),
  called through the library's Python entry (`entry.cpp`, no dispatcher) in plain eager mode
  (`host.dispatcher_free`), else as the op `urpe_cpp::forward_if_finite`;
- gradients, eager: the kernel's autograd Function -> `urpe_cpp::forward_checked_with_stat`
  (which also finds NaN/inf in the rows of q, k, v its tiles read: no pass over them before it)
  / `backward`; after the non-finite rule has made q, k, v finite, `urpe_cpp::forward`;
- torch.compile and torch.func: the custom ops `urpe::cpp_attention_r2_forward` / `_backward`
  around the same C++ ops; a compiled call that needs no gradient runs as one opaque op,
  `urpe::cpp_guarded_forward_r2` -> `ops.NoGradForward`, applying the non-finite rule itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends import Backend
from ..blockwise import blockwise_defers
from ..capabilities import BIAS_KINDS, Capabilities, built_in
from ..dtypes import FLOATING
from ..execute import execute
from ..host import compiling
from ..layout import ForwardArgs
from ..nonfinite import FINITE_CHECKS
from ..reference import draw_seed
from ..spec import AttentionSpec, resolve
from .arguments import reads_in_place
from .build import is_loaded, threaded, unavailable

__all__ = [
    "FEW_QUERIES",
    "cpp_attention",
    "cpp_backend",
    "cpp_defers",
    "CppRun",
    "cpp_run",
    "cpp_unsupported",
    "unavailable",
]


# The registry's four built-ins as the C++ loop implements them (codes in ops.py).
CPP_CAPABILITIES = Capabilities(
    "the C++ kernel",
    normalizations=built_in("softmax", "exp", "l2", "relu2"),
    bias=(*BIAS_KINDS, "cross_decay"),
    dtypes=FLOATING,
    devices=("cpu",),
    finds_nonfinite=True,
)


def cpp_unsupported(spec: AttentionSpec) -> str | None:
    """Why the C++ kernel cannot run this call beyond its table (None: it can): it could not
    be built. Builds it on the first CPU call."""
    return unavailable()


class CppRun:
    """The C++ backend's run for one kind of call (`Backend.prepare`): a prepared call keeps
    one, so what the kind fixes (the op's scalar arguments, term codes, tiles: `ops.OpArguments`)
    is worked out once; `cpp_run` makes one per call. Calling it on a spec of that kind gives
    (B, H, Lq, Dv) in q's dtype, or None where a call whose q, k, v nobody checked
    (`spec.finite` None) meets NaN/inf (module docstring). block_q, block_k: tile sizes (0: the
    defaults)."""

    def __init__(self, spec: AttentionSpec, block_q: int = 0, block_k: int = 0) -> None:
        self.blocks = (block_q, block_k)
        self.ops = _ops()
        self._no_grad = None  # ops.NoGradForward, made by the first call that needs no gradient

    def __call__(self, spec: AttentionSpec) -> Tensor | None:
        ops = self.ops
        if spec.dropout_p > 0.0 and spec.dropout_seed is None:
            spec = spec.replace(dropout_seed=draw_seed(spec.q.device))
        # needs no gradient (`torch.is_grad_enabled` first: a decoding step under no_grad then
        # skips the property's frame); `nonfinite.guarded` asks
        if spec.finite is None and not (torch.is_grad_enabled() and spec.records_grad):
            if compiling():
                return ops.GUARDED_FORWARD(*ForwardArgs.from_spec(spec, *self.blocks))
            terms = ops.spec_terms(spec)
            if self._no_grad is None:
                self._no_grad = ops.NoGradForward(spec, terms, self.blocks)
            return self._no_grad(spec, terms)
        # A short call reads views of a training step's (B, L, H, D) projections in place and
        # writes their gradients in that layout. A long one copies q, k, v here, before the
        # kernel's autograd Function, which then saves the copies for its backward.
        q, k, v = spec.q, spec.k, spec.v
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()) and not (
            reads_in_place(q, k)
        ):
            spec = spec.replace(q=_contiguous(q), k=_contiguous(k), v=_contiguous(v))
        args = ForwardArgs.from_spec(spec, *self.blocks)
        if spec.finite is None:  # gradients in plain eager mode, q, k, v not asked (`guarded`)
            out = ops.CPP.if_finite(args)
            if out is None:
                return None
        else:
            out = ops.CPP(args)
        return out if out.dtype == spec.q.dtype else out.to(spec.q.dtype)


def cpp_run(spec: AttentionSpec, block_q: int = 0, block_k: int = 0) -> Tensor | None:
    """The C++ backend on one call (`CppRun`)."""
    return CppRun(spec, block_q, block_k)(spec)


def _ops():
    """The ops module, imported on the first call (it registers the custom ops)."""
    if not _OPS_MODULE:
        from . import ops

        _OPS_MODULE.append(ops)
    return _OPS_MODULE[0]


_OPS_MODULE: list = []


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def cpp_attention(
    q: Tensor, k: Tensor, v: Tensor, *, block_q: int = 0, block_k: int = 0, **kwargs
) -> Tensor:
    """`urpe.attention(q, k, v, **kwargs, backend="cpp")` with chosen tile sizes (queries x
    keys; 0: the defaults)."""
    if int(block_q) < 0 or int(block_k) < 0:
        raise ValueError(f"block_q and block_k must be >= 0, got {block_q}, {block_k}")
    spec = resolve(q, k, v, **kwargs)
    reason = cpp_backend().refusal(spec)
    if reason is not None:
        raise ValueError(f"backend 'cpp' cannot run this call: {reason}")
    return execute(CppRun(spec, block_q, block_k), spec, finds_nonfinite=True)


# Up to this many queries (decoding, a few speculative tokens) the kernel runs plain softmax
# too: one op call that also checks for NaN/inf costs less than SDPA plus a separate check;
# measured 0.6-0.9x of the SDPA route at Lq 1-16 (BENCHMARKS.md, "model" section).
FEW_QUERIES = 16


def cpp_defers(spec: AttentionSpec) -> str | None:
    """Why "auto" should hand a call the kernel could run to a later backend: plain softmax
    with more than FEW_QUERIES queries (SDPA is faster), or a build without OpenMP, whose tiles
    run on one thread ("blockwise" uses torch's threads)."""
    if not threaded():
        return "the C++ kernel was built without OpenMP: its tiles run on one thread"
    if spec.lq <= FEW_QUERIES:
        return None
    return blockwise_defers(spec)


def cpp_backend() -> Backend:
    """Before "blockwise" in "auto" on the CPU; plain softmax still goes to SDPA."""
    return Backend(
        "cpp",
        cpp_run,
        cpp_unsupported,
        priority=35,
        prepare=CppRun,
        defers=cpp_defers,
        capabilities=CPP_CAPABILITIES,
        available=unavailable,
    )


def cpp_all_finite(tensors: tuple[Tensor, ...]) -> bool | None:
    """Whether q, k, v hold only finite numbers, by one C++ pass (None: the kernel is not
    loaded; the non-finite rule then asks torch)."""
    if not is_loaded():
        return None
    if not _ALL_FINITE:  # the overload itself: a lookup through torch.ops costs about a microsecond
        _ALL_FINITE.append(torch.ops.urpe_cpp.all_finite.default)
    return _ALL_FINITE[0](list(tensors))


_ALL_FINITE: list = []
FINITE_CHECKS["cpu"] = cpp_all_finite
