"""The kernel a context-parallel call runs on each chunk pair: a native kernel's raw layer.

Each takes `urpe.kernels.layout.ForwardArgs` -> (out, row statistic r) and `BackwardArgs`
(the merged out and r of the whole rows, not the pair's own) -> gradients. Both read the pair
forms a ring needs: a `CrossDecay` bias, document ids of the queries apart from the keys', and
a dropout seed placed in the whole matrix of weights.

- "cpp": the compiled CPU kernel, the default on CPUs where it builds;
- "blockwise": pure PyTorch, any device (the default elsewhere: the Triton kernel has none of
  the pair forms yet).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..kernels.blockwise.kernel import blockwise_backward, blockwise_forward
from ..kernels.cpp import CPP_CAPABILITIES, unavailable
from ..kernels.spec import AttentionSpec

CHUNK_BACKENDS = ("auto", "cpp", "blockwise")


@dataclass(frozen=True)
class ChunkKernel:
    name: str
    forward: Callable
    backward: Callable


BLOCKWISE = ChunkKernel("blockwise", blockwise_forward, blockwise_backward)


def _cpp_refusal(spec: AttentionSpec) -> str | None:
    if spec.q.device.type != "cpu":
        return f"the C++ kernel runs on CPUs, not {spec.q.device.type}"
    if not CPP_CAPABILITIES.implements(spec.norm):
        return f"the C++ kernel has no form for normalization {spec.normalization!r}"
    if spec.q.dtype not in CPP_CAPABILITIES.dtypes:
        return f"the C++ kernel takes no {spec.q.dtype}"
    return unavailable()


def chunk_kernel(backend: str, spec: AttentionSpec) -> ChunkKernel:
    """The kernel for the chunk pairs of `spec` (this rank's call): `backend` one of
    `CHUNK_BACKENDS` ("auto": "cpp" where it runs, else "blockwise")."""
    if backend not in CHUNK_BACKENDS:
        raise ValueError(
            f"context parallelism runs its chunks on backend {' or '.join(CHUNK_BACKENDS)}, "
            f"not {backend!r}"
        )
    if backend == "blockwise":
        return BLOCKWISE
    reason = _cpp_refusal(spec)
    if reason is None:
        from ..kernels.cpp.ops import cpp_backward, cpp_forward

        return ChunkKernel("cpp", cpp_forward, cpp_backward)
    if backend == "cpp":
        raise ValueError(f"backend 'cpp' cannot run these chunks: {reason}")
    return BLOCKWISE
