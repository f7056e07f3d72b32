"""Objectives: LightningModules that receive the model they train.

An objective owns the loss, the metrics (torchmetrics, synchronised across devices) and the
optimiser; the model is any `nn.Module`, passed in. Checkpoints store the model's description
(`checkpoint.model_spec`) so `load_model` rebuilds it without the objective, and the run's input
encoding (`inputs=`, see `inputs.py`: the tokenizer, or the molecule featuriser with the target
and its unit) so that it comes back with its inputs.

`TokenClassification`: a model mapping tokens (B, L) to logits (B, L, C), trained with
per-token cross-entropy; reports token accuracy. The graph-regression and causal-LM objectives
sit beside it, with the same shape: `__init__(model, ..., optim)`, `training_step`,
`validation_step` logging "val/<metric>", `configure_optimizers`, `on_save_checkpoint`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning as L
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from .checkpoint import model_spec
from .inputs import InputEncoding
from .optim import OptimConfig, build_optimizer


class Objective(L.LightningModule):
    """What every urpe objective shares: the wrapped `model`, Adam with warm-up and polynomial
    decay stepped every update, and a description of itself in each checkpoint: the model, the
    run's config (`run`) and how raw data becomes the model's input (`inputs`; default: the
    model takes tensors as they are)."""

    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig,
        run: dict | None = None,
        inputs: InputEncoding | None = None,
    ):
        super().__init__()
        self.model, self.optim, self.run = model, optim, dict(run or {})
        self.inputs = inputs or InputEncoding()

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer, scheduler = build_optimizer(self.model.parameters(), self.optim)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    def describe(self) -> dict[str, Any]:
        """JSON for the checkpoint's config.json (besides the model)."""
        return {"class": type(self).__name__, "optim": asdict(self.optim)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Read by SafeCheckpointIO: becomes config.json, next to the weights.
        checkpoint["urpe"] = {
            "model": model_spec(self.model),
            "state_dict_prefix": "model.",
            "objective": self.describe(),
            "run": self.run,
            "inputs": self.inputs.record(),
            "files": self.inputs.files(),  # written beside config.json (tokenizer.json)
        }


class TokenClassification(Objective):
    """Per-token classification: `model(tokens)` (B, L) -> logits (B, L, num_classes).

    loss = mean over tokens (targets != ignore_index) of cross-entropy; logs train/loss,
    train/acc each step and val/loss, val/acc (token accuracy over the whole held-out set,
    summed across devices before dividing) at each validation.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        optim: OptimConfig,
        ignore_index: int = -100,
        run: dict | None = None,
        inputs: InputEncoding | None = None,
    ):
        super().__init__(model, optim, run, inputs)
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.num_classes, self.ignore_index = num_classes, ignore_index

        def accuracy() -> MulticlassAccuracy:
            # micro average = correct tokens / all counted tokens; argument checks cost more
            # than the tiny models' steps, and the loss already checks the targets.
            return MulticlassAccuracy(
                num_classes, average="micro", ignore_index=ignore_index, validate_args=False
            )

        self.train_accuracy, self.val_accuracy = accuracy(), accuracy()
        self.val_loss = MeanMetric()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        tokens, targets = batch
        logits = self(tokens)  # (B, L, C)
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=self.ignore_index
        )
        counted = (targets != self.ignore_index).sum()
        return loss, logits.argmax(-1), targets, counted

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, predictions, targets, _ = self._loss(batch)
        self.train_accuracy(predictions, targets)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_accuracy, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, predictions, targets, counted = self._loss(batch)
        self.val_accuracy.update(predictions, targets)
        self.val_loss.update(loss, weight=counted)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True)
        self.log("val/acc", self.val_accuracy, on_step=False, on_epoch=True, prog_bar=True)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "num_classes": self.num_classes,
            "ignore_index": self.ignore_index,
        }
