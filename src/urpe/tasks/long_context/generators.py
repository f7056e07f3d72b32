"""The long-context tasks: passkey, needles (one key or several), multi-query associative recall,
copying and variable tracking, each drawn from a `torch.Generator` alone (a seed fixes a sample).

Every task writes its sample with `Pieces` (words.py) and returns a `Sample` (layout.py) of
exactly the length asked for; `TooShort` when that length cannot hold its fixed parts.

- `passkey` (Mohtashami & Jaggi 2023): "the pass key is 7 1 4 3 2 . remember it ." at a depth
  in repeated filler; asked for at the end. One unit: all digits.
- `needle`: one needle "the number for river is 3 0 9 1 ." at a depth in the filler, asked for
  by its key (RULER's single needle). One unit: the value's digits.
- `multikey`: the same needle at a depth among distractors with other keys and values at random
  depths (RULER's multi-key needle).
- `mqar` (Zoology's multi-query associative recall): key-value pairs ("river red apple calm"),
  then filler in which the keys come back in a random order, each followed by its value. One
  unit per query: its value.
- `copy`: random words, then "again :" and the same words. One unit per copied word.
- `vartrack` (RULER's variable tracking): "var apple is 4 2 7 ." and a chain "var river is var
  apple ." scattered in the filler, with a distractor chain of another value; then "which
  variables hold 4 2 7 :" answered by the chain's names in order. One unit per name.

Chance (`task.chance`): the accuracy of answering every unit uniformly from the words it is drawn
from (digits, `VALUES`, `KEYS`): (1/10)^digits for a number, 1/|words| for a word.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from .layout import Sample, TooShort, cycled_filler, haystack, join
from .words import FILLER, KEYS, VALUES, Pieces, spaced_digits


def _below(bound: int, generator: torch.Generator, count: int = 1) -> list[int]:
    return torch.randint(bound, (count,), generator=generator).tolist()


def _distinct(bound: int, count: int, generator: torch.Generator) -> list[int]:
    """`count` distinct integers in [0, bound), in random order."""
    if count > bound:
        raise ValueError(f"cannot draw {count} distinct items from {bound}")
    return torch.randperm(bound, generator=generator)[:count].tolist()


def _numbers(count: int, digits: int, generator: torch.Generator) -> list[str]:
    """`count` distinct numbers of `digits` spaced digits."""
    if count > 10**digits:
        raise ValueError(f"cannot draw {count} distinct numbers of {digits} digits")
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen[spaced_digits(_below(10, generator, digits))] = None
    return list(seen)


def _depths(count: int, generator: torch.Generator) -> list[float]:
    return torch.rand(count, generator=generator, dtype=torch.float64).tolist()


def _filler(pieces: Pieces, count: int, generator: torch.Generator) -> list[int]:
    """`count` filler tokens starting at a random sentence."""
    return cycled_filler(count, pieces.filler(), _below(len(FILLER), generator)[0])


def _check_length(length: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an integer >= 2, got {length!r}")


class LongContextTask(ABC):
    """A task: `sample(pieces, length, generator, depth)` -> a `Sample` of `length` tokens."""

    name: ClassVar[str]
    description: ClassVar[str]
    uses_depth: ClassVar[bool] = False  # whether `depth` places the queried needle

    @property
    @abstractmethod
    def chance(self) -> float:
        """Accuracy of answering every unit uniformly from its alphabet."""

    def sample(
        self,
        pieces: Pieces,
        length: int,
        generator: torch.Generator,
        depth: float | None = None,
    ) -> Sample:
        """A sample of exactly `length` tokens. depth in [0, 1] for tasks that use it (None:
        drawn uniformly); ignored by the others. TooShort when the length is too small."""
        _check_length(length)
        if self.uses_depth:
            if depth is None:
                depth = _depths(1, generator)[0]
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"depth must lie in [0, 1], got {depth}")
        sample = self._draw(pieces, length, generator, depth if self.uses_depth else None)
        assert sample.tokens.numel() == length, (self.name, sample.tokens.numel(), length)
        return sample

    @abstractmethod
    def _draw(
        self, pieces: Pieces, length: int, generator: torch.Generator, depth: float | None
    ) -> Sample: ...


def _asked_at_end(
    pieces: Pieces,
    length: int,
    generator: torch.Generator,
    needles: list[tuple[float, tuple[int, ...]]],
    query: tuple[int, ...],
    answers: list[tuple[int, ...]],
    depth: float | None,
) -> Sample:
    """Needles in filler, then the query and its answer units: the shape of every task asked
    at the end."""
    fixed = len(query) + sum(len(ids) for ids in answers)
    region = length - fixed
    needed = sum(len(ids) for _, ids in needles)
    if region < needed:
        raise TooShort(
            f"length {length} is too short: needles, query and answer take {needed + fixed} tokens"
        )
    tokens, starts = haystack(region, needles, _filler(pieces, region - needed, generator))
    spans = []
    start = region + len(query)
    for ids in answers:
        spans.append((start, start + len(ids)))
        start += len(ids)
    return Sample(
        join([tokens, query, *answers]), answers=tuple(spans), needles=tuple(starts), depth=depth
    )


@dataclass(frozen=True)
class Passkey(LongContextTask):
    digits: int = 5
    name: ClassVar[str] = "passkey"
    description: ClassVar[str] = "a number hidden in repeated filler, asked for at the end"
    uses_depth: ClassVar[bool] = True

    @property
    def chance(self) -> float:
        return 0.1**self.digits

    def _draw(self, pieces, length, generator, depth):
        (number,) = _numbers(1, self.digits, generator)
        needle = pieces(f"the pass key is {number} . remember it .")
        query = pieces("what is the pass key ? the pass key is")
        return _asked_at_end(
            pieces, length, generator, [(depth, needle)], query, [pieces(number)], depth
        )


@dataclass(frozen=True)
class Needle(LongContextTask):
    """One key-value needle at the depth, `keys - 1` distractors at random depths."""

    keys: int = 1
    digits: int = 4
    name: ClassVar[str] = "needle"
    description: ClassVar[str] = "a key-value needle in filler, asked for by its key"
    uses_depth: ClassVar[bool] = True

    @property
    def chance(self) -> float:
        return 0.1**self.digits

    def _draw(self, pieces, length, generator, depth):
        keys = [KEYS[i] for i in _distinct(len(KEYS), self.keys, generator)]
        values = _numbers(self.keys, self.digits, generator)
        needles = [
            (at, pieces(f"the number for {key} is {value} ."))
            for at, key, value in zip(
                [depth, *_depths(self.keys - 1, generator)], keys, values, strict=True
            )
        ]
        query = pieces(f"what is the number for {keys[0]} ? the number for {keys[0]} is")
        answer = [pieces(values[0])]
        return _asked_at_end(pieces, length, generator, needles, query, answer, depth)


@dataclass(frozen=True)
class MultiKeyNeedle(Needle):
    keys: int = 4
    name: ClassVar[str] = "multikey"
    description: ClassVar[str] = "a key-value needle among distractor needles with other keys"


@dataclass(frozen=True)
class AssociativeRecall(LongContextTask):
    pairs: int = 8
    name: ClassVar[str] = "mqar"
    description: ClassVar[str] = (
        "key-value pairs, then every key again in filler, each to be followed by its value"
    )

    @property
    def chance(self) -> float:
        return 1.0 / len(VALUES)

    def _draw(self, pieces, length, generator, depth):
        keys = [pieces(KEYS[i]) for i in _distinct(len(KEYS), self.pairs, generator)]
        values = [pieces(VALUES[i]) for i in _distinct(len(VALUES), self.pairs, generator)]
        head = [token for pair in zip(keys, values, strict=True) for ids in pair for token in ids]
        order = _distinct(self.pairs, self.pairs, generator)
        at = _depths(self.pairs, generator)
        queries = [(at[n], keys[i] + values[i]) for n, i in enumerate(order)]
        region = length - len(head)
        needed = sum(len(ids) for _, ids in queries)
        if region < needed:
            raise TooShort(
                f"length {length} is too short: pairs and queries take {len(head) + needed} tokens"
            )
        fill = _filler(pieces, region - needed, generator)
        tokens, starts = haystack(region, queries, fill)
        answers = []
        for start, i in sorted(zip(starts, order, strict=True)):
            begin = len(head) + start + len(keys[i])
            answers.append((begin, begin + len(values[i])))
        return Sample(join([head, tokens]), answers=tuple(answers))


@dataclass(frozen=True)
class Copy(LongContextTask):
    name: ClassVar[str] = "copy"
    description: ClassVar[str] = "random words, then the same words again"

    @property
    def chance(self) -> float:
        return 1.0 / len(KEYS)

    def _draw(self, pieces, length, generator, depth):
        opening, again = pieces("copy :"), pieces("again :")
        budget = length - len(opening) - len(again)
        words: list[tuple[int, ...]] = []
        used = 0
        while True:  # as many words as fit twice; filler in front takes what is left
            ids = pieces(KEYS[_below(len(KEYS), generator)[0]])
            if used + 2 * len(ids) > budget:
                break
            words.append(ids)
            used += 2 * len(ids)
        if not words:
            raise TooShort(f"length {length} is too short to copy one word")
        pad = _filler(pieces, budget - used, generator)
        copied = [token for ids in words for token in ids]
        start = len(pad) + len(opening) + len(copied) + len(again)
        answers = []
        for ids in words:
            answers.append((start, start + len(ids)))
            start += len(ids)
        return Sample(join([pad, opening, copied, again, copied]), answers=tuple(answers))


@dataclass(frozen=True)
class VariableTracking(LongContextTask):
    """`chains` chains of `hops` + 1 variables; the first chain is asked for."""

    hops: int = 2
    chains: int = 2
    digits: int = 3
    name: ClassVar[str] = "vartrack"
    description: ClassVar[str] = (
        "chains of variable assignments in filler; name every variable holding a value"
    )

    @property
    def chance(self) -> float:
        return 1.0 / len(KEYS)

    def _draw(self, pieces, length, generator, depth):
        size = self.hops + 1
        names = [KEYS[i] for i in _distinct(len(KEYS), self.chains * size, generator)]
        values = _numbers(self.chains, self.digits, generator)
        statements = []
        for c, value in enumerate(values):
            chain = names[c * size : (c + 1) * size]
            texts = [f"var {chain[0]} is {value} ."]
            texts += [f"var {b} is var {a} ." for a, b in itertools.pairwise(chain)]
            # Sorted depths, listed in chain order: every assignment follows the one it reads.
            for at, text in zip(sorted(_depths(size, generator)), texts, strict=True):
                statements.append((at, pieces(text)))
        query = pieces(f"which variables hold {values[0]} :")
        answer = [pieces(name) for name in names[:size]]
        return _asked_at_end(pieces, length, generator, statements, query, answer, None)


TASKS: dict[str, LongContextTask] = {
    task.name: task
    for task in (
        Passkey(),
        Needle(),
        MultiKeyNeedle(),
        AssociativeRecall(),
        Copy(),
        VariableTracking(),
    )
}


def long_context_task(name: str) -> LongContextTask:
    """The task registered under `name`; ValueError naming the choices."""
    if name not in TASKS:
        raise ValueError(f"unknown long-context task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]
