"""The Triton backward pass's bias and gate gradients: which buffer the dQ kernel accumulates a
term's gradient into (the term's own layout, or dense where a table's gradient must be
deterministic), and how that buffer becomes the gradient of the term's own tensor."""

from __future__ import annotations

import torch
from torch import Tensor

from ..dtypes import compute_dtype
from ..layout import ForwardArgs
from . import kernels as K

TABLE_CODES = (K.TOEPLITZ.value, K.RELATION.value)  # the kinds whose gradients use atomics


def buffer_kind(kind: int, needed: bool) -> int:
    """The gradient buffer's kind: none, the term's own, or dense where a table's gradient must
    be deterministic (`torch.use_deterministic_algorithms(True)`: no atomics, see the package
    docstring; the dense gradient is then reduced to the table by `index_add_`, which torch
    runs deterministically in that mode, at O(B H Lq Lk) float32 memory)."""
    if not needed or kind == K.NO_TERM.value:
        return K.NO_TERM.value
    if kind in TABLE_CODES and torch.are_deterministic_algorithms_enabled():
        return K.DENSE.value
    return kind  # a Decay's gradient needs no atomics: deterministic as it is


def term_grad_buffer(q: Tensor, k: Tensor, term: Tensor | None, grad_kind: int):
    """(buffer, head stride) that the dQ kernel accumulates a term's gradient into."""
    acc = compute_dtype(q.dtype)
    if grad_kind == K.NO_TERM.value:
        return torch.empty(1, device=q.device, dtype=acc), 0  # unused
    if grad_kind == K.DECAY.value:  # the queries' share of d c, (B, H, Lq), written once
        return torch.empty(q.shape[:3], device=q.device, dtype=acc), 0
    if grad_kind == K.DENSE.value:  # full (B, H, Lq, Lk); reduced to the term's shape afterwards
        b, h, lq = q.shape[:3]
        return torch.zeros(b, h, lq, k.shape[2], device=q.device, dtype=acc), h
    grad = torch.zeros(term.shape, device=q.device, dtype=acc)
    return grad, (0 if term.shape[0] == 1 else grad.stride(0))


def table_grad(dense: Tensor, args: ForwardArgs, term: str) -> Tensor:
    """A dense (B, H, Lq, Lk) gradient reduced to a Toeplitz or Relation table's shape, in a
    fixed order (`index_add_` is deterministic under torch's deterministic mode)."""
    table = args.bias if term == "bias" else args.gate
    rows = dense.sum(0) if table.shape[0] == dense.shape[1] else dense.sum((0, 1))[None]
    b, _, lq, lk = dense.shape
    if args.kind(term) == "toeplitz":  # entry clamp(j - i - (Lk - Lq), -K, K) + K
        k = (table.shape[1] - 1) // 2
        offsets = (
            torch.arange(lk, device=dense.device) - torch.arange(lq, device=dense.device)[:, None]
        )
        column = (offsets - (lk - lq)).clamp(-k, k) + k  # (Lq, Lk)
        return torch.zeros_like(table, dtype=dense.dtype).index_add_(
            1, column.flatten(), rows.flatten(1)
        )
    index = args.bias_index if term == "bias" else args.gate_index
    index = index.expand(b, lq, lk)  # (B, Lq, Lk)
    per_head = dense.transpose(0, 1).reshape(dense.shape[1], -1)  # (H, B Lq Lk)
    if table.shape[0] == 1:
        per_head = per_head.sum(0, keepdim=True)
    return torch.zeros_like(table, dtype=dense.dtype).index_add_(1, index.flatten(), per_head)


def decay_grad(queries: Tensor, keys: Tensor, log_forget: Tensor) -> Tensor:
    """d log_forget from d c's two shares: queries (B, H, Lq) at positions i + Lk - Lq (those
    before the first key read a constant), keys (B, H, Lk). c is a cumulative sum, so
    d log_forget_t = sum_{s >= t} d c_s, a reversed cumulative sum (O(L))."""
    lq, lk = queries.shape[-1], keys.shape[-1]
    dc = keys.clone()
    dc[..., max(lk - lq, 0) :] += queries[..., max(lq - lk, 0) :]
    grad = dc.flip(-1).cumsum(-1).flip(-1)
    return grad.sum_to_size(log_forget.shape).to(log_forget.dtype)


def term_grad_result(buffer: Tensor, args: ForwardArgs, term: str, grad_kind: int):
    """The gradient of the bias or gate (`term`) from the buffer the dQ kernel filled, in the
    term's own shape and dtype (None where none was asked for)."""
    if grad_kind == K.NO_TERM.value:
        return None
    tensor = args.bias if term == "bias" else args.gate
    if grad_kind == K.DECAY.value:  # buffer: (queries' share, keys' share)
        return decay_grad(*buffer, tensor)
    if grad_kind == K.DENSE.value:
        if args.kind(term) == "dense":
            buffer = buffer.sum_to_size(tensor.shape)
        else:
            buffer = table_grad(buffer, args, term)
    return buffer.to(tensor.dtype)
