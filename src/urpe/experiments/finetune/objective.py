"""The fine-tuning objective: urpe's causal-LM objective, with the URPE gates at their own
learning rate and frozen parameters left out of the optimiser."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...training.lm import CausalLM
from ...training.optim import OptimConfig, build_optimizer


class FineTuningLM(CausalLM):
    """`CausalLM` over the trainable parameters only; the gates (names with "urpe") peak at
    `gate_lr` (None: the model's lr) on the same warm-up and decay as the rest."""

    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig,
        gate_lr: float | None,
        metric: str = "bpc",
        run: dict | None = None,
    ):
        super().__init__(model, optim, metric=metric, run=run)
        self.gate_lr = gate_lr

    def configure_optimizers(self) -> dict[str, Any]:
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        gates = [p for n, p in trained if "urpe" in n]
        others = [p for n, p in trained if "urpe" not in n]
        groups: list[dict[str, Any]] = [{"params": others}] if others else []
        if gates:
            groups.append({"params": gates, "lr": self.gate_lr or self.optim.lr})
        optimizer, scheduler = build_optimizer(groups, self.optim)
        schedule = {"scheduler": scheduler, "interval": "step", "frequency": 1}
        return {"optimizer": optimizer, "lr_scheduler": schedule}
