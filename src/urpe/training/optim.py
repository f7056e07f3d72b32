"""Adam with linear warm-up and polynomial decay (fairseq's `polynomial_decay` schedule)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class OptimConfig:
    """lr: peak learning rate, reached after `warmup_steps`; then decays polynomially (`power`,
    1 = linear) to `end_lr` at `total_steps`, and stays there. (Gradient clipping is the
    Trainer's: `TrainConfig.gradient_clip_val`.)"""

    lr: float = 1e-3
    warmup_steps: int = 0
    total_steps: int = 1000
    end_lr: float = 0.0
    power: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(
                f"need total_steps >= 1 and warmup_steps >= 0, got {self.total_steps}, "
                f"{self.warmup_steps}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (`betas` as a list). `from_dict(to_dict())` gives it back."""
        return {**asdict(self), "betas": list(self.betas)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimConfig:
        return cls(**{**data, "betas": tuple(data["betas"])})


def warmup_polynomial_decay(step: int, config: OptimConfig) -> float:
    """The learning rate at optimizer step `step` (0-based: the first update uses step 0).

    lr(t) = peak * (t + 1) / W                                  for t < W
    lr(t) = end + (peak - end) * (1 - (t - W) / (T - W))^power  for W <= t < T, end after.
    """
    c = config
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    if step >= c.total_steps or c.total_steps <= c.warmup_steps:
        return c.end_lr if step >= c.total_steps else c.lr
    remaining = 1.0 - (step - c.warmup_steps) / (c.total_steps - c.warmup_steps)
    return c.end_lr + (c.lr - c.end_lr) * remaining**c.power


def build_optimizer(
    parameters: Iterable[nn.Parameter], config: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Adam (AdamW when weight_decay > 0) and a per-step LambdaLR following the schedule."""
    kind = torch.optim.AdamW if config.weight_decay > 0 else torch.optim.Adam
    optimizer = kind(
        parameters,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_polynomial_decay(step, config) / config.lr
    )
    return optimizer, scheduler
