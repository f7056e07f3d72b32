"""The paper's synthetic tasks and Su's probe, generated on the fly.

Every task maps a batch of input tokens (B, L) to per-position class targets (B, L). Sampling
draws only from the `torch.Generator` passed in, so a seed fixes the data exactly.

- `position_identification` (PI, the paper): uniform random tokens; the target at position k is k.
- `even_token_prediction` (ETP, the paper): uniform random tokens; the target at position
  k < L // 2 is the input token at position 2k + 1 (0-based, i.e. the tokens at even 1-based
  positions packed into the first half); every later position targets one filler class.
- `position_probe` (Su 2022): L identical tokens (all `token`); the target at position k is k.

A relative-only Transformer whose attention rows sum to 1 maps identical tokens to identical
outputs, so on the probe it predicts one class everywhere and scores exactly 1 / L.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def _check(batch_size: int, length: int, vocab_size: int) -> None:
    for name, value in (("batch_size", batch_size), ("length", length), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _uniform_tokens(
    batch_size: int, length: int, vocab_size: int, generator: torch.Generator | None
) -> Tensor:
    return torch.randint(vocab_size, (batch_size, length), generator=generator)  # (B, L)


def position_identification(
    batch_size: int, length: int, vocab_size: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """PI: tokens (B, L) uniform in [0, V); targets (B, L) = position index k in [0, L)."""
    _check(batch_size, length, vocab_size)
    tokens = _uniform_tokens(batch_size, length, vocab_size, generator)
    targets = torch.arange(length).expand(batch_size, length).clone()  # (B, L)
    return tokens, targets


def even_token_prediction(
    batch_size: int, length: int, vocab_size: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """ETP: tokens (B, L) uniform in [0, V); targets (B, L) in [0, V].

    targets[:, k] = tokens[:, 2k + 1] for k < L // 2, and the filler class V for k >= L // 2, so
    always predicting the filler scores 1 - (L // 2) / L (0.5 for even L).
    """
    _check(batch_size, length, vocab_size)
    if length < 2:
        raise ValueError(f"even token prediction needs length >= 2, got {length}")
    tokens = _uniform_tokens(batch_size, length, vocab_size, generator)
    half = length // 2
    targets = torch.full((batch_size, length), vocab_size, dtype=tokens.dtype)  # filler = V
    targets[:, :half] = tokens[:, 1 : 2 * half : 2]  # positions 1, 3, 5, ... (0-based)
    return tokens, targets


def position_probe(
    batch_size: int,
    length: int,
    vocab_size: int,
    generator: torch.Generator | None = None,
    token: int = 0,
) -> tuple[Tensor, Tensor]:
    """Su's probe: tokens (B, L) all equal to `token`; targets (B, L) = position index k.

    The generator is accepted for a uniform interface; the probe has no randomness.
    """
    _check(batch_size, length, vocab_size)
    if not 0 <= token < vocab_size:
        raise ValueError(f"probe token must lie in [0, {vocab_size}), got {token}")
    tokens = torch.full((batch_size, length), token, dtype=torch.long)
    targets = torch.arange(length).expand(batch_size, length).clone()
    return tokens, targets


@dataclass(frozen=True)
class SyntheticTask:
    """A task by name: how to sample it, how many output classes it needs, and chance level."""

    name: str
    description: str
    sample: Callable[..., tuple[Tensor, Tensor]]
    num_classes: Callable[[int, int], int]  # (length, vocab_size) -> classes
    chance: Callable[[int, int], float]  # (length, vocab_size) -> accuracy of a constant answer

    def __call__(
        self, batch_size: int, length: int, vocab_size: int, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        return self.sample(batch_size, length, vocab_size, generator)


def _etp_chance(length: int, vocab_size: int) -> float:
    # Always answering the filler: what a model that cannot tell positions apart falls back to.
    return (length - length // 2) / length


TASKS: dict[str, SyntheticTask] = {
    "pi": SyntheticTask(
        "pi",
        "position identification: random tokens in, position index out",
        position_identification,
        lambda length, vocab: length,
        lambda length, vocab: 1.0 / length,
    ),
    "etp": SyntheticTask(
        "etp",
        "even token prediction: token at 2k+1 (0-based) for k < L/2, filler after",
        even_token_prediction,
        lambda length, vocab: vocab + 1,
        _etp_chance,
    ),
    "probe": SyntheticTask(
        "probe",
        "Su's probe: identical tokens in, position index out",
        position_probe,
        lambda length, vocab: length,
        lambda length, vocab: 1.0 / length,
    ),
}


def get_task(name: str) -> SyntheticTask:
    """The synthetic task registered in `TASKS` under `name` ("pi", "etp", "probe"); ValueError
    naming the choices for any other name."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]
