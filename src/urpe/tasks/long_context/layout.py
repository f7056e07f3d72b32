"""One task sample as token ids of an exact length: its haystack, needles, scored answers.

A sample is `length` tokens that a causal model reads whole. Its answers are spans of those
tokens: answer unit u is correct when the model, reading tokens [0, p), predicts token p for
every p in the span (teacher forcing; equal to greedy decoding of the unit, which stops being
right at the first wrong token). A haystack is filler cut to the token, with needles placed at
depths: a needle at depth d has round(d * F) of the F filler tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100  # a target position that is not scored (torch's cross-entropy default)

Ids = tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """tokens (L,) int64; answers: [start, end) spans of the scored units; needles: where each
    needle (or assignment) starts, the queried one first; depth: the queried needle's, for the
    tasks placed by depth."""

    tokens: Tensor
    answers: tuple[tuple[int, int], ...]
    needles: tuple[int, ...] = ()
    depth: float | None = None

    def targets(self) -> Tensor:
        """Next-token targets (L,): targets[p - 1] = tokens[p] for every answered position p,
        IGNORE_INDEX elsewhere (the training loss of a task sample)."""
        targets = torch.full_like(self.tokens, IGNORE_INDEX)
        for start, end in self.answers:
            targets[start - 1 : end - 1] = self.tokens[start:end]
        return targets

    def hits(self, predictions: Tensor) -> list[bool]:
        """predictions (L,): the model's argmax next token after each position -> whether each
        answer unit is right in every token."""
        right = predictions[:-1] == self.tokens[1:]  # (L - 1,): position p - 1 predicts p
        return [bool(right[start - 1 : end - 1].all()) for start, end in self.answers]


class TooShort(ValueError):
    """The length cannot hold a task's fixed parts (needles, query, answer)."""


def cycled_filler(count: int, sentences: Sequence[Ids], first: int) -> list[int]:
    """`count` filler tokens: the sentences in order from sentence `first`, repeated, the last
    one cut where the count ends."""
    out: list[int] = []
    index = first
    while len(out) < count:
        out.extend(sentences[index % len(sentences)])
        index += 1
    return out[:count]


def haystack(
    size: int, needles: Sequence[tuple[float, Ids]], filler: list[int]
) -> tuple[list[int], list[int]]:
    """`size` tokens: filler with each needle (depth in [0, 1], ids) inserted after round(depth
    * F) of the F filler tokens. Returns the tokens and each needle's start, in the order given;
    needles at the same filler position keep that order. `filler` must hold at least F tokens.
    TooShort when the needles alone exceed `size`."""
    fill = size - sum(len(ids) for _, ids in needles)
    if fill < 0:
        raise TooShort(f"{size} tokens cannot hold needles of {size - fill} tokens")
    cuts = [round(depth * fill) for depth, _ in needles]
    order = sorted(range(len(needles)), key=lambda i: (cuts[i], i))
    tokens: list[int] = []
    starts = [0] * len(needles)
    taken = 0
    for i in order:
        tokens.extend(filler[taken : cuts[i]])
        taken = cuts[i]
        starts[i] = len(tokens)
        tokens.extend(needles[i][1])
    tokens.extend(filler[taken:fill])
    return tokens, starts


def join(parts: Sequence[Sequence[int]]) -> Tensor:
    return torch.tensor([t for part in parts for t in part], dtype=torch.long)
