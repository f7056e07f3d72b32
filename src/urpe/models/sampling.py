"""Choosing the next token from a language model's logits: temperature, top-k, top-p, greedy.

For logits z (..., V) the distribution sampled from is built in this order (HF transformers' order):

1. temperature T: p = softmax(z / T); T = 0 is greedy decoding (argmax, the lowest id on ties);
2. top-k: keep the k largest logits (exactly k; ties at the k-th value are broken by id);
3. top-p (nucleus, Holtzman et al. 2020): sort the remaining probabilities in decreasing order and
   keep the smallest prefix whose mass reaches p (at least one token);
4. renormalise and draw with `torch.multinomial`, from `generator` when given, so a seeded
   generator fixes the draw.

`generate_tokens` runs the decoding loop for any model that can return next-token logits for the
tokens it has not seen yet (a KV-cached decoder, one with segment memory, or a plain forward).

The filtering runs in float64. A prefix whose mass falls short of p by no more than the rounding
of the logits' own dtype (16 ulps, at most 1e-4) counts as reaching p, so that probabilities
given as float32 logits (0.4 + 0.25 = 0.65) select the prefix they select in exact arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor


def rounding_tolerance(dtype: torch.dtype) -> float:
    """How far below p a prefix's mass may fall and still count as reaching p."""
    return min(1e-4, max(1e-12, 16 * torch.finfo(dtype).eps))


def _check(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError("logits must be a floating-point tensor of shape (..., V)")
    if logits.shape[-1] == 0:
        raise ValueError("logits must have at least one entry per row")
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise ValueError("logits contain NaN or +inf")
    if (logits == -math.inf).all(dim=-1).any():
        raise ValueError("a row of logits is -inf everywhere: nothing can be sampled")
    if (
        not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1] or be None, got {top_p!r}")


def top_k_mask(logits: Tensor, k: int) -> Tensor:
    """Bool mask (..., V), True for the k largest logits of each row (all of them if k >= V)."""
    if k >= logits.shape[-1]:
        return torch.ones_like(logits, dtype=torch.bool)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    return keep.scatter_(-1, torch.topk(logits, k, dim=-1).indices, True)


def top_p_mask(probs: Tensor, p: float, tolerance: float = 1e-12) -> Tensor:
    """Bool mask (..., V), True for the smallest set of most probable tokens whose total
    probability reaches p - tolerance (ties in probability broken by id, lower first)."""
    # A stable sort of -probs orders equal probabilities by id.
    order = torch.sort(-probs, dim=-1, stable=True).indices
    sorted_probs = probs.gather(-1, order)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the better tokens
    keep_sorted = mass_before < p - tolerance
    keep_sorted[..., 0] = True  # the most probable token always stays, however small p is
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def next_token_distribution(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """The float64 distribution (..., V) that `sample` draws from, for temperature > 0."""
    _check(logits, temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature 0 is greedy decoding: it has no distribution to sample")
    scaled = logits.double() / temperature
    if top_k is not None:
        scaled = scaled.masked_fill(~top_k_mask(scaled, top_k), -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if top_p is not None and top_p < 1:
        keep = top_p_mask(probs, top_p, rounding_tolerance(logits.dtype))
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token id per row of `logits` (..., V) -> (...,) int64.

    temperature 0 returns the argmax (greedy); top_k / top_p restrict the draw as the module
    docstring says; `generator` (on the logits' device) makes the draw reproducible.
    """
    _check(logits, temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = next_token_distribution(logits, temperature, top_k, top_p)
    flat = probs.reshape(-1, probs.shape[-1])  # (rows, V): multinomial takes 1-D or 2-D
    drawn = torch.multinomial(flat, 1, generator=generator)  # (rows, 1)
    return drawn.reshape(probs.shape[:-1])


def generate_tokens(
    next_logits: Callable[[Tensor], Tensor],
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[Tensor]:
    """Autoregressive decoding, one token per step, streamed as it is drawn.

    `next_logits(new_tokens (B, n)) -> logits (B, V)` receives the tokens the model has not seen
    yet (first the whole prompt, then each drawn token as (B, 1)) and returns the next-token
    logits; it keeps its own state (a KV cache, segment memory), so this loop works for any
    model. Yields `max_new_tokens` tensors of shape (B,).
    """
    if not isinstance(prompt, Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        raise ValueError("prompt must be an integer tensor of shape (B, P)")
    if prompt.shape[0] == 0 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must hold at least one token per row, got {tuple(prompt.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens}")
    feed = prompt
    for _ in range(max_new_tokens):
        logits = next_logits(feed)
        if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.shape[0] != len(prompt):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"next_logits must return (B={len(prompt)}, V) logits, got {shape}")
        token = sample(logits, temperature, top_k, top_p, generator)  # (B,)
        yield token
        feed = token[:, None]  # (B, 1)
