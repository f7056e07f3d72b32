"""Scoring a language model on text, with torch alone (no Lightning): what `urpe evaluate`,
`TextModel.score` and the training objective (`urpe.training.lm`) report.

- `report_metric`: a mean loss in nats per token as bits per token (bits per character for
  character or byte tokens) or perplexity;
- `token_losses`: the summed cross-entropy of a batch's scored targets;
- `evaluate`: a whole token stream scored exactly once, in consecutive chunks of a given context
  length (with or without carried memory) or in sliding windows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.text import IGNORE_INDEX, ContiguousBatches, SlidingWindows
from ..models.lm import LanguageModel

LN2 = math.log(2.0)


def report_metric(loss_nats: float, metric: str) -> float:
    """A mean loss in nats per token as `metric`: "bpc" (bits per token) or "perplexity"."""
    if metric == "bpc":
        return loss_nats / LN2
    if metric == "perplexity":
        return math.exp(min(loss_nats, 700.0))
    raise ValueError(f"metric must be 'bpc' or 'perplexity', got {metric!r}")


def token_losses(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of cross-entropy in nats over scored targets, number scored). logits (B, L, V)."""
    total = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total, (targets != IGNORE_INDEX).sum()


@torch.no_grad()
def evaluate(
    model: LanguageModel,
    tokens: Tensor,
    context: int,
    *,
    mode: str = "chunks",
    use_memory: bool = False,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, float]:
    """Mean next-token loss (nats) over every target of the stream `tokens` (N,), each scored
    once; returns {"loss", "tokens"}.

    mode "chunks": consecutive chunks of `context` inputs (row b of chunk t + 1 continues row b of
        chunk t); with `use_memory`, a memory model carries its M states from chunk to chunk
        (Transformer-XL evaluation), otherwise each chunk starts from nothing (full context:
        target i of a chunk sees the i earlier tokens of its chunk).
    mode "sliding": windows of `context` inputs advancing by context // 2, each scoring its new
        targets only (every target after the first window sees >= context / 2 earlier tokens).
    progress: a progress bar over the batches (lines in a log; see `urpe.progress`).
    """
    if mode not in ("chunks", "sliding"):
        raise ValueError(f"mode must be 'chunks' or 'sliding', got {mode!r}")
    if use_memory and (mode != "chunks" or model.memory_length == 0):
        raise ValueError("memory evaluation needs mode='chunks' and a model with memory_length > 0")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    if mode == "chunks":
        rows = max(1, min(batch_size, (len(tokens) - 1) // context))
        segments = ContiguousBatches(tokens, rows, context, cover_all=True)
    else:
        segments = SlidingWindows(tokens, context, batch_size=batch_size)
    total, count = 0.0, 0
    memory = None
    if progress:
        from ..progress import progress_bar

        segments = progress_bar(segments, desc="evaluate", unit="batch")
    for segment in segments:
        if segment.reset_memory:
            memory = None
        inputs, targets = segment.inputs.to(device), segment.targets.to(device)
        logits, memory = model(inputs, memory, use_memory=use_memory)
        loss, scored = token_losses(logits, targets)
        total, count = total + float(loss), count + int(scored)
    model.train(was_training)
    return {"loss": total / max(count, 1), "tokens": float(count)}
