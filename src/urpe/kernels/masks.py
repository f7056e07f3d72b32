"""Which keys each query may see: key padding, causality, documents and a boolean `attn_mask`.

These four are the *hiding* masks. A hidden (query, key) pair takes no part in the call at all:
its weight is exactly 0 under every normalisation, and non-finite numbers in a hidden key or value
never reach the query's output (see `nonfinite`). A `-inf` in a bias or a float `attn_mask` also
gives weight 0, but does not hide the key's contents.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .offsets import relative_offsets


def causal_keep(lq: int, lk: int, device: torch.device | None = None) -> Tensor:
    """(Lq, Lk) bool: query i sees key j iff j <= i + Lk - Lq (the last query meets the last key).

    This is urpe's alignment, which decoding with a cache needs. SDPA's `is_causal` aligns the
    first query with the first key instead (j <= i); the two agree when Lq == Lk.
    """
    return relative_offsets(lq, lk, device) <= 0


def query_documents(document_ids: Tensor, lq: int, lk: int | None = None) -> tuple[Tensor, Tensor]:
    """The document of each query: ids at pos(i) = i + Lk - Lq, and whether pos(i) >= 0 (a
    query before the first key belongs to no document). (B|1, Lk) -> (B|1, Lq), (Lq,) bool.

    Given `lk`, ids of Lq + Lk entries are the queries' own, then the keys' (`key_documents`):
    queries that are not the last Lq keys (a chunk of a sequence against another chunk of it,
    `urpe.distributed`), each in the document its id names."""
    n = document_ids.shape[-1]
    if lk is not None and lq > 0 and n == lq + lk:
        placed = torch.ones(lq, dtype=torch.bool, device=document_ids.device)
        return document_ids[:, :lq], placed
    positions = torch.arange(lq, device=document_ids.device) + (n - lq)
    return document_ids[:, positions.clamp_min(0)], positions >= 0


def key_documents(document_ids: Tensor, lk: int) -> Tensor:
    """The keys' documents (B|1, Lk): the last Lk ids (the queries' come first where they are
    given apart, `query_documents`)."""
    return document_ids[:, document_ids.shape[-1] - lk :]


def document_keep(document_ids: Tensor, lq: int, lk: int | None = None) -> Tensor:
    """(B|1, 1, Lq, Lk) bool: query i and key j are in the same document (ids (B|1, Lk), or
    (B|1, Lq + Lk) for queries and keys apart: `query_documents`)."""
    lk = document_ids.shape[-1] if lk is None else lk
    query_ids, placed = query_documents(document_ids, lq, lk)
    same = query_ids[:, :, None] == key_documents(document_ids, lk)[:, None, :]  # (B|1, Lq, Lk)
    return (same & placed[:, None])[:, None]


def keep_mask(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    lq: int,
    lk: int,
    device: torch.device | None = None,
    document_ids: Tensor | None = None,
) -> Tensor | None:
    """Bool (B|1, H|1, Lq|1, Lk), True where query i may see key j; None when nothing is hidden.

    key_padding_mask: (B|1, Lk) bool, True marks a padded key. attn_mask: 4-D, only a bool one
    hides (True takes part); a float mask is additive and is ignored here. document_ids:
    (B|1, Lk) integer, a query sees only keys of its own document (see `query_documents`;
    (B|1, Lq + Lk): the queries' ids given apart).
    """
    keep = None
    if is_causal:
        keep = causal_keep(lq, lk, device)[None, None]  # (1, 1, Lq, Lk)
    if document_ids is not None:
        same = document_keep(document_ids, lq, lk)
        keep = same if keep is None else keep & same
    if key_padding_mask is not None:
        keys = ~key_padding_mask[:, None, None, :]  # (B|1, 1, 1, Lk)
        keep = keys if keep is None else keep & keys
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    return keep


def visible_key_counts(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    lq: int,
    lk: int,
    key_flags: Tensor | None = None,
    device: torch.device | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """n_i: how many keys query i sees (only keys with key_flags True, if given).

    key_flags: (B|1, H|1, Lk) bool or None. Returns int64 (B|1, H|1, Lq). Without a boolean
    attn_mask this never builds an (Lq, Lk) matrix: causal counts are prefix sums over the keys
    (per document: over the keys sorted by document, see `_document_counts`). Either mask may
    broadcast over the keys (key dim 1): it then counts for all Lk of them.
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep_mask(key_padding_mask, attn_mask, is_causal, lq, lk, device, document_ids)
        if key_flags is not None:
            keep = keep & key_flags[..., None, :]  # (B|1, H|1, Lq|1, Lk|1)
        keep = keep.expand(*keep.shape[:-1], lk)  # a broadcast key dim stands for Lk keys
        return keep.sum(-1).expand(*keep.shape[:2], lq)
    keys = torch.ones(1, 1, lk, dtype=torch.bool, device=device)  # (B|1, H|1, Lk)
    if key_padding_mask is not None:
        keys = keys & ~key_padding_mask[:, None, :]  # (B|1, Lk|1) broadcasts over the keys
    if key_flags is not None:
        keys = keys & key_flags
    if document_ids is not None:
        return _document_counts(keys, document_ids, is_causal, lq, lk)
    if not is_causal:
        return keys.sum(-1, keepdim=True).expand(*keys.shape[:2], lq)
    # seen[..., c]: flagged keys among the first c; query i sees the first i + Lk - Lq + 1
    seen = torch.cat([torch.zeros_like(keys[..., :1], dtype=torch.int64), keys.cumsum(-1)], -1)
    last = (torch.arange(lq, device=device) + (lk - lq + 1)).clamp(0, lk)  # (Lq,)
    return seen[..., last]


def _document_counts(
    keys: Tensor, document_ids: Tensor, is_causal: bool, lq: int, lk: int
) -> Tensor:
    """Visible-key counts with documents in O(L log L), no (Lq, Lk) matrix. keys (B|1, H|1,
    Lk|1) bool (True: counted), document_ids (B|1, Lk) or, without causal masking, (B|1,
    Lq + Lk) (`query_documents`) -> int64 (B, H|1, Lq).

    A stable sort by document puts each document's keys side by side in their original order,
    so a query's visible keys are a run of the sorted order: from its document's first key to
    itself (causal) or to its document's last key. Prefix sums over the sorted flags count them.
    """
    query_ids, placed = query_documents(document_ids, lq, lk)  # (B|1, Lq), (Lq,)
    apart = document_ids.shape[-1] != lk  # the queries' ids given apart
    if apart and is_causal:
        raise ValueError(
            "visible-key counts of queries whose document ids are given apart from the keys' "
            "(Lq + Lk ids) are defined without causal masking"
        )
    document_ids = key_documents(document_ids, lk)
    batch = max(keys.shape[0], document_ids.shape[0])
    heads = keys.shape[1]
    sorted_ids, order = torch.sort(document_ids, dim=-1, stable=True)  # (B|1, Lk)
    flags = keys.expand(batch, heads, lk).gather(-1, order[:, None].expand(batch, heads, lk))
    zero = flags.new_zeros(batch, heads, 1, dtype=torch.int64)
    prefix = torch.cat([zero, flags.cumsum(-1)], -1)  # (B, H|1, Lk + 1)
    rank = order.argsort(-1)  # rank[p]: where key p sits in the sorted order (the inverse)
    first = torch.searchsorted(sorted_ids, query_ids.contiguous())  # (B|1, Lq)
    if is_causal:
        last = rank[:, (torch.arange(lq, device=order.device) + (lk - lq)).clamp_min(0)] + 1
    else:
        last = torch.searchsorted(sorted_ids, query_ids.contiguous(), right=True)
    at = (batch, heads, lq)
    counts = prefix.gather(-1, last[:, None].expand(at)) - prefix.gather(
        -1, first[:, None].expand(at)
    )
    return counts * placed
