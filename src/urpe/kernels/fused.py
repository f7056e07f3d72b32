"""The fused backend: the blockwise kernel behind a custom op, in flash-attention's three layers.

1. Raw ops on tensors and scalars, `urpe::fused_attention_forward` and `..._backward`, registered
   with `torch.library.custom_op`. Each has a fake (meta) implementation, so `torch.compile`
   traces through the call without a graph break, and a vmap rule (`composable`: it folds the
   vmapped dim into the batch dim, or loops where folding would be wrong). The bodies run
   eagerly, so the kernel's host syncs (which key blocks hold padding, the dropout seed) are fine
   inside them.
2. `FusedAttention`, an `autograd.Function` with `setup_context` around the forward op, whose
   backward calls the backward op (`composable.attention_function`, shared with the Triton
   backend): `torch.func.grad`, `vmap` and `functional_call` compose with it.
3. `fused_run(spec)`, the backend, and `fused_attention(...)`, the public call with tile sizes.

Higher-order gradients are not implemented: differentiating the backward raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .blockwise import BLOCK_K, BLOCK_Q, _Call, blockwise_backward, blockwise_forward
from .composable import attention_function, register_vmap_rules, strided_like, term_arguments
from .execute import execute
from .reference import draw_seed
from .spec import AttentionSpec, resolve

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


# ---------------------------------------------------------------------------------------------
# 1. Raw ops


@torch.library.custom_op("urpe::fused_attention_forward", mutates_args=())
def fused_forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    bias_index: Tensor | None,
    gate: Tensor | None,
    gate_index: Tensor | None,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    seed: Tensor | None,
    bias_kind: str,
    gate_kind: str,
    is_causal: bool,
    normalization: str,
    scale: float,
    dropout_p: float,
    block_q: int,
    block_k: int,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, Dv) in the compute dtype, row statistic (B, H, Lq, 1))."""
    call = _Call(q, k, v, bias, bias_index, bias_kind, gate, gate_index, gate_kind, attn_mask,
                 key_padding_mask, is_causal, normalization, scale, dropout_p, seed, block_q,
                 block_k)  # fmt: skip
    return blockwise_forward(call)


@fused_forward_op.register_fake
def _(q, k, v, bias, bias_index, gate, gate_index, attn_mask, key_padding_mask, seed, *scalars):
    b, h, lq, _ = q.shape
    dtype = _compute_dtype(q.dtype)
    return q.new_empty(b, h, lq, v.shape[-1], dtype=dtype), q.new_empty(b, h, lq, 1, dtype=dtype)


@torch.library.custom_op("urpe::fused_attention_backward", mutates_args=())
def fused_backward_op(
    grad_out: Tensor,
    out: Tensor,
    stat: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    bias_index: Tensor | None,
    gate: Tensor | None,
    gate_index: Tensor | None,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    seed: Tensor | None,
    bias_kind: str,
    gate_kind: str,
    is_causal: bool,
    normalization: str,
    scale: float,
    dropout_p: float,
    block_q: int,
    block_k: int,
    needs_bias: bool,
    needs_gate: bool,
    needs_mask: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d bias, d gate, d float attn_mask); a gradient not asked for is empty (0,)."""
    call = _Call(q, k, v, bias, bias_index, bias_kind, gate, gate_index, gate_kind, attn_mask,
                 key_padding_mask, is_causal, normalization, scale, dropout_p, seed, block_q,
                 block_k)  # fmt: skip
    needs = (needs_bias, needs_gate, needs_mask)
    grads = blockwise_backward(call, grad_out, out, stat, needs)
    inputs = (q, k, v, bias, gate, attn_mask)
    return tuple(
        q.new_empty(0) if g is None else strided_like(g, t)
        for g, t in zip(grads, inputs, strict=True)
    )


@fused_backward_op.register_fake
def _(grad_out, out, stat, q, k, v, bias, bias_index, gate, gate_index, attn_mask,
      key_padding_mask, seed, *scalars):  # fmt: skip
    needs = scalars[-3:]
    terms = (bias, gate, attn_mask)
    extra = (
        torch.empty_like(t) if w else q.new_empty(0) for t, w in zip(terms, needs, strict=True)
    )
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *extra)


register_vmap_rules(fused_forward_op, fused_backward_op)


# ---------------------------------------------------------------------------------------------
# 2. Autograd

# Differentiable in q, k, v, the bias and gate tensors (dense or table) and a float mask.
FusedAttention = attention_function(fused_forward_op, fused_backward_op, "FusedAttention")


# ---------------------------------------------------------------------------------------------
# 3. The backend and the public call


def fused_run(spec: AttentionSpec, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> Tensor:
    """The fused backend: (B, H, Lq, Dv) in q's dtype."""
    bias, bias_index, bias_kind = term_arguments(spec.bias)
    gate, gate_index, gate_kind = term_arguments(spec.gate)
    seed = spec.dropout_seed
    if spec.dropout_p > 0.0 and seed is None:
        seed = draw_seed(spec.q.device)  # a tensor: no .item() on the traced side
    out, _ = FusedAttention.apply(
        spec.q, spec.k, spec.v, bias, bias_index, gate, gate_index, spec.attn_mask,
        spec.key_padding_mask, seed, bias_kind, gate_kind, spec.is_causal, spec.normalization,
        spec.scale, spec.dropout_p, int(block_q), int(block_k),
    )  # fmt: skip
    return out.to(spec.q.dtype)


def fused_unsupported(spec: AttentionSpec) -> str | None:
    """The fused kernel runs every call that `urpe.attention` accepts."""
    return None


def fused_defers(spec: AttentionSpec) -> str | None:
    """Why "auto" should hand this call to a later backend: plain softmax without bias or gate,
    where PyTorch's own fused SDPA kernel is faster."""
    if spec.gate is None and spec.bias is None and spec.normalization == "softmax":
        return "plain softmax attention: SDPA is faster"
    return None


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    seed: int | Tensor | None = None,
    **kwargs,
) -> Tensor:
    """`urpe.attention(q, k, v, **kwargs, backend="fused")` with chosen tile sizes.

    block_q, block_k: tile size (queries x keys). seed: the dropout seed (`dropout_seed`); by
    default one is drawn from torch's generator, so `torch.manual_seed` reproduces the masks.
    """
    if seed is not None:
        kwargs["dropout_seed"] = seed
    if int(block_q) < 1 or int(block_k) < 1:
        raise ValueError(f"block_q and block_k must be >= 1, got {block_q}, {block_k}")
    spec = resolve(q, k, v, **kwargs)
    return execute(lambda s: fused_run(s, block_q, block_k), spec)
