"""What the blockwise kernel's plan reads off a call's tensors before its tiles run: which
(query block, key block) pairs may share a document, and whether a row's logits could all be
-inf (which rules out the one-shot softmax)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..host import may_read
from ..layout import ForwardArgs
from ..masks import key_documents, query_documents


def may_hold_neg_inf(call: ForwardArgs, dtype: torch.dtype) -> bool:
    """Whether a row's logits could all be -inf without a mask hiding them: an additive term
    holding -inf, or scale q.k overflowing. The one-shot softmax would turn such a row into NaN;
    the online recurrence gives 0, as the reference does."""
    flags = []
    for term in (call.bias, call.attn_mask):
        if term is not None and term.dtype != torch.bool:
            flags.append(torch.isneginf(term).any())
    if call.q.numel() and call.k.numel():
        # |s| <= scale * D * max|q| * max|k| (Cauchy-Schwarz on the worst case)
        q_lo, q_hi = torch.aminmax(call.q.to(dtype))
        k_lo, k_hi = torch.aminmax(call.k.to(dtype))
        bound = call.scale * call.q.shape[-1]
        bound = bound * torch.maximum(-q_lo, q_hi) * torch.maximum(-k_lo, k_hi)
        flags.append(~(bound < torch.finfo(dtype).max / 4))
    return bool(torch.stack(flags).any()) if flags else False


def document_fields(ids: Tensor | None, lq: int, lk: int, block_q: int, block_k: int) -> dict:
    """The plan's document fields: ids per query and per reversed key, and which (query block,
    key block) pairs may share a document (one host read, where values may be read). ids:
    (B|1, Lk), or (B|1, Lq + Lk) with the queries' own first (`masks.query_documents`)."""
    if ids is None:
        return dict(key_documents=None, query_documents=None, placed=None, shares=None)
    ids = ids.long()
    queries, placed = query_documents(ids, lq, lk)  # (B|1, Lq), (Lq,)
    keys = key_documents(ids, lk).flip(-1)  # (B|1, Lk), reversed like the kernel's columns
    shares = None
    if may_read(ids):
        # per block: [lo, hi] of its ids; queries with no document stay out of the range
        big = torch.iinfo(torch.int64).max
        q_lo = block_reduce(queries.masked_fill(~placed, big), block_q, torch.amin)
        q_hi = block_reduce(queries.masked_fill(~placed, -big), block_q, torch.amax)
        k_lo = block_reduce(keys, block_k, torch.amin)
        k_hi = block_reduce(keys, block_k, torch.amax)
        # (B|1, nq, nk): the ranges overlap in some batch row
        meet = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
        shares = meet.any(0).tolist()
    return dict(
        key_documents=keys,
        query_documents=queries,
        placed=placed[None, None, :, None],
        shares=shares,
    )


def block_reduce(x: Tensor, block: int, reduce) -> Tensor:
    """(B, L) -> (B, ceil(L / block)): reduce over each block of `block` columns."""
    n = x.shape[-1]
    blocks = -(-n // block)
    pad = blocks * block - n
    if pad:
        x = torch.cat([x, x[:, -1:].expand(-1, pad)], -1)  # repeats an id of the last block
    return reduce(x.view(x.shape[0], blocks, block), -1)
