"""Packed sequences as a term: `urpe.attention`'s document_ids, checked, flattened and read
like a bias or gate (`terms.Term`), but hiding pairs instead of weighting them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .masks import document_keep
from .term_shapes import CallShape, broadcasts, check_device, flatten_leading
from .terms import Term, register_term_kind


@register_term_kind
@dataclass(frozen=True)
class Documents(Term):
    """Packed sequences: query i sees key j only if ids[pos(i)] == ids[j], pos(i) = i + Lk - Lq
    (a query with pos(i) < 0 sees no key). ids: integer, broadcastable to (..., Lk).

    A hiding term (`urpe.attention`'s document_ids): its dense form is the bool keep mask
    (B|1, 1, Lq, Lk); the kernels read the ids (B|1, Lk) per tile instead."""

    kind: ClassVar[str] = "documents"
    roles: ClassVar[tuple[str, ...]] = ("document_ids",)

    ids: Tensor

    def check(self, role: str, call: CallShape) -> None:
        ids = self.ids
        integer = isinstance(ids, Tensor) and not (
            ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
        )
        if not integer:
            raise TypeError(
                "document_ids must be an integer Tensor (..., Lk): the document of each key"
            )
        broadcasts("document_ids", tuple(ids.shape), (*call.batch, call.lk), "(..., Lk)")
        check_device("document_ids", ids, call)

    def flattened(self, batch_shape: tuple[int, ...]) -> Documents:
        ids = flatten_leading(self.ids, batch_shape, 1)  # (B|1, Lk|1)
        return self if ids is self.ids else Documents(ids)

    def expanded(self, lk: int) -> Documents:
        """(B|1, Lk): ids given once for every key (a last dim of 1) expanded, since every kernel
        reads one id per key."""
        ids = self.ids
        return self if ids.shape[-1] == lk else Documents(ids.expand(*ids.shape[:-1], lk))

    def dense(self, lq: int, lk: int) -> Tensor:
        return document_keep(self.ids.expand(self.ids.shape[0], lk), lq)
