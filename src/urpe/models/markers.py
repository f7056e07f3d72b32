"""Learned marker tokens around a sequence: the model's own [CLS] ... [SEP] (Su 2022).

Because the first and last tokens differ from the rest, even an unmodified RPE Transformer can
tell positions apart on an input of identical tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MarkerTokens(nn.Module):
    """[CLS] right before each row's first real token and (append_end) [SEP] right after its last.

    Works with any padding (left, right, both sides, or none): padded slots before the first real
    token stay in front of [CLS], those after the last one stay behind [SEP], so [CLS], the real
    tokens and [SEP] are contiguous and their offsets do not depend on where the padding was.
    """

    def __init__(self, dim: int, append_end: bool = True):
        super().__init__()
        self.start = nn.Parameter(torch.randn(dim) * 0.02)
        self.end = nn.Parameter(torch.randn(dim) * 0.02) if append_end else None

    @property
    def count(self) -> int:
        return 1 if self.end is None else 2

    def layout(self, padding: Tensor | None, length: int, device) -> tuple[Tensor, Tensor, Tensor]:
        """Where things go in the wrapped sequence of length L + count.

        Returns (slot, start_at, end_at): slot (B or 1, L) the wrapped index of each input token,
        start_at and end_at (B or 1, 1) the indices of [CLS] and [SEP] (end_at unused without
        [SEP]). With f the first real token and l the last: tokens before f keep their index,
        [CLS] sits at f, tokens f..l move by one, [SEP] sits at l + 2, later tokens move by
        count. A row with no real token gets [CLS] (and [SEP]) after all of its padding.
        """
        index = torch.arange(length, device=device)[None, :]  # (1, L)
        if padding is None:
            first = torch.zeros(1, 1, dtype=torch.long, device=device)
            last = torch.full((1, 1), length - 1, dtype=torch.long, device=device)
        else:
            real = ~padding  # (B, L)
            # Leading padding = first real index (L when none); last real index (first - 1 when
            # the row is all padding).
            first = (real.long().cumsum(-1) == 0).sum(-1, keepdim=True)  # (B, 1)
            trailing = (real.long().flip(-1).cumsum(-1) == 0).sum(-1, keepdim=True)
            last = torch.maximum(length - 1 - trailing, first - 1)  # (B, 1)
        slot = index + (index >= first).long() + (index > last).long() * (self.count - 1)
        return slot, first, last + 2

    def wrap(self, x: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
        """x (B, L, E) -> (B, L + count, E) with the markers placed by `layout`.

        padding (B, L) True = padded. Returns the wrapped input, its padding mask (None when
        none was given) and `slot` (B or 1, L), to hand to `unwrap`.
        """
        b, length, dim = x.shape
        slot, start_at, end_at = self.layout(padding, length, x.device)
        wrapped_length = length + self.count
        slots = slot.expand(b, length)  # (B, L)
        wrapped = x.new_zeros(b, wrapped_length, dim)
        wrapped = wrapped.scatter(1, slots[..., None].expand(b, length, dim), x)  # (B, L+c, E)
        index = torch.arange(wrapped_length, device=x.device)[None, :, None]  # (1, L+c, 1)
        wrapped = torch.where(index == start_at[..., None], self.start.to(x.dtype), wrapped)
        if self.end is not None:
            wrapped = torch.where(index == end_at[..., None], self.end.to(x.dtype), wrapped)
        new_padding = None
        if padding is not None:  # markers are real; padded tokens stay padded in their slots
            new_padding = padding.new_zeros(b, wrapped_length).scatter(1, slots, padding)
        return wrapped, new_padding, slot

    def unwrap(self, x: Tensor, slot: Tensor) -> Tensor:
        """Drop the markers: (B, L + count, E) -> (B, L, E), each token back at its input index."""
        b, _, dim = x.shape
        slots = slot.expand(b, slot.shape[-1])  # (B, L)
        return x.gather(1, slots[..., None].expand(b, slots.shape[1], dim))
