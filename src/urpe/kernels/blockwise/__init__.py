"""The blockwise backend: the blockwise kernel behind a custom op, in flash-attention's layers.

Pure PyTorch ops, so it runs on any device and for any registered normalisation. On the CPU
"auto" prefers the compiled C++ kernel (`urpe.kernels.cpp`) and uses this one where that cannot
be built.

1. Raw ops on tensors and scalars, `urpe::blockwise_attention_forward` and `..._backward`, on the
   argument layout every such kernel shares (`layout.ForwardArgs`). Each has a fake (meta)
   implementation, so `torch.compile` traces through the call without a graph break, and a vmap
   rule (it folds the vmapped dim into the batch dim, or loops where folding would be wrong).
   The bodies run eagerly, so the kernel's host syncs (which key blocks hold padding, the
   dropout seed) are fine inside them.
2. `BlockwiseAttention`, an `autograd.Function` with `setup_context` around the forward op, whose
   backward calls the backward op. Both layers come from `composable.define_attention_ops`,
   shared with the Triton backend: `torch.func.grad`, `vmap` and `functional_call` compose.
3. `blockwise_run(spec)`, the backend, and `blockwise_attention(...)`, the public call with
   tile sizes.

Higher-order gradients are not implemented: differentiating the backward raises.
"""

from __future__ import annotations

import warnings

from torch import Tensor

from ..capabilities import ANY_KIND, Capabilities
from ..composable import define_attention_ops
from ..dtypes import compute_dtype
from ..execute import execute
from ..layout import ForwardArgs
from ..reference import draw_seed
from ..sdpa import SDPA_CAPABILITIES
from ..spec import AttentionSpec, resolve
from .kernel import blockwise_backward, blockwise_forward

# ---------------------------------------------------------------------------------------------
# 1. and 2. Raw ops and autograd


def forward_fake(args: ForwardArgs):
    """out (B, H, Lq, Dv) and row statistic (B, H, Lq, 1), both in the compute dtype."""
    b, h, lq, _ = args.q.shape
    dtype = compute_dtype(args.q.dtype)
    out = args.q.new_empty(b, h, lq, args.v.shape[-1], dtype=dtype)
    return out, args.q.new_empty(b, h, lq, 1, dtype=dtype)


# Differentiable in q, k, v, the bias and gate tensors (dense or table) and a float mask.
BLOCKWISE = define_attention_ops(
    "blockwise_attention", blockwise_forward, blockwise_backward, forward_fake
)
BlockwiseAttention = BLOCKWISE.function


# ---------------------------------------------------------------------------------------------
# 3. The backend and the public call


def blockwise_run(spec: AttentionSpec, block_q: int = 0, block_k: int = 0) -> Tensor:
    """The blockwise backend: (B, H, Lq, Dv) in q's dtype. block_q, block_k: tile sizes (0: the
    kernel's choice, `BLOCK_Q` x `BLOCK_K`, or narrower key tiles where documents are given)."""
    if spec.dropout_p > 0.0 and spec.dropout_seed is None:
        spec = spec.replace(dropout_seed=draw_seed(spec.q.device))  # a tensor: no .item()
    return BLOCKWISE(ForwardArgs.from_spec(spec, block_q, block_k)).to(spec.q.dtype)


# Every call that `urpe.attention` accepts, with the registry's formulas of any normalisation
# and every term kind (one without a reader of its own through its dense form).
BLOCKWISE_CAPABILITIES = Capabilities("the blockwise kernel", bias=ANY_KIND, gate=ANY_KIND)


def blockwise_defers(spec: AttentionSpec) -> str | None:
    """Why "auto" should hand this call to a later backend: plain softmax without bias, gate or
    documents, where PyTorch's own fused SDPA kernel is faster (where SDPA implements the softmax:
    not one registered again with other formulas; SDPA would need the documents' dense mask)."""
    plain = spec.gate is None and spec.bias is None and spec.document_ids is None
    if plain and SDPA_CAPABILITIES.implements(spec.norm):
        return "plain softmax attention: SDPA is faster"
    return None


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_q: int = 0,
    block_k: int = 0,
    seed: int | Tensor | None = None,
    **kwargs,
) -> Tensor:
    """`urpe.attention(q, k, v, **kwargs, backend="blockwise")` with chosen tile sizes.

    block_q, block_k: tile size (queries x keys); 0: the kernel's choice. `dropout_seed` (in
    kwargs, as in `urpe.attention`) fixes the dropout masks; by default one is drawn from
    torch's generator, so `torch.manual_seed` reproduces them. `seed` is its old name (deprecated).
    """
    if seed is not None:
        warnings.warn(
            "blockwise_attention(seed=...) is deprecated; pass dropout_seed=... (urpe.attention's "
            "name)",
            DeprecationWarning,
            stacklevel=2,
        )
        kwargs.setdefault("dropout_seed", seed)
    if int(block_q) < 0 or int(block_k) < 0:
        raise ValueError(f"block_q and block_k must be >= 0 (0: default), got {block_q}, {block_k}")
    spec = resolve(q, k, v, **kwargs)
    return execute(lambda s: blockwise_run(s, block_q, block_k), spec)
