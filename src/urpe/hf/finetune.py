"""Fine-tuning and evaluating a causal language model on token batches: the loop a fine-tuning
experiment (with and without URPE) runs, kept free of any data set or trainer.

Batches are (B, L) int64 token ids; the model predicts each token from the ones before it
(transformers shifts the labels). Any optimizer and any parameters: gates only, LoRA + gates, all.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn


def language_model_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Mean next-token cross-entropy over a (B, L) batch (B * (L - 1) predictions)."""
    return model(input_ids=tokens, labels=tokens).loss


def train_steps(
    model: nn.Module, batches: Iterable[Tensor], optimizer: torch.optim.Optimizer
) -> list[float]:
    """One optimizer step per batch, in training mode; returns the training losses."""
    model.train()
    losses = []
    for tokens in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = language_model_loss(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: Iterable[Tensor]) -> float:
    """Mean next-token cross-entropy over all predictions of all batches, in evaluation mode
    (the mode is restored afterwards)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for tokens in batches:
        n = tokens.shape[0] * (tokens.shape[1] - 1)
        total += float(language_model_loss(model, tokens)) * n
        count += n
    model.train(was_training)
    if count == 0:
        raise ValueError("evaluate_loss needs at least one batch with two or more tokens")
    return total / count
