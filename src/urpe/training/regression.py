"""Graph regression: one number per graph, L1 loss, mean absolute error (Graphormer's ZINC setup).

`GraphRegression(model, optim)` trains any model mapping a batch of graphs to predictions
(num_graphs,) (e.g. `urpe.graph.Graphormer`) against the batch's targets `batch.y`:

    loss = mean_g |model(batch)_g - y_g|

and reports the mean absolute error over the whole held-out set (torchmetrics, summed across
devices before dividing, so every graph counts once whatever the batch sizes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MeanAbsoluteError, MeanMetric

from .inputs import InputEncoding
from .objectives import Objective
from .optim import OptimConfig


def graph_targets(batch: Any) -> Tensor:
    """The batch's targets as a float (num_graphs,) tensor; ValueError if it has none or the
    wrong number."""
    y = getattr(batch, "y", None)
    if y is None:
        raise ValueError("the batch has no targets `y` (one number per graph)")
    y = y.reshape(-1)
    graphs = getattr(batch, "num_graphs", y.shape[0])
    if y.shape[0] != graphs:
        raise ValueError(f"expected one target per graph ({graphs}), got {y.shape[0]} values")
    return y if y.is_floating_point() else y.float()


class GraphRegression(Objective):
    """L1 regression of one number per graph; logs train/loss (= train MAE of the batch) each
    step and val/loss, val/mae at each validation (the same number: L1 is the MAE)."""

    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig,
        run: dict | None = None,
        inputs: InputEncoding | None = None,
    ):
        super().__init__(model, optim, run, inputs)
        self.val_mae = MeanAbsoluteError()
        self.val_loss = MeanMetric()

    def forward(self, batch: Any) -> Tensor:
        return self.model(batch)

    def _predict(self, batch: Any) -> tuple[Tensor, Tensor]:
        targets = graph_targets(batch)
        predictions = self(batch)  # (num_graphs,)
        if predictions.shape != targets.shape:
            raise ValueError(
                f"the model returned {tuple(predictions.shape)} for {targets.shape[0]} graphs"
            )
        return predictions, targets.to(predictions.dtype)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        predictions, targets = self._predict(batch)
        loss = torch.nn.functional.l1_loss(predictions, targets)
        self.log("train/loss", loss, prog_bar=True, batch_size=targets.shape[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        predictions, targets = self._predict(batch)
        self.val_mae.update(predictions.detach(), targets)
        self.log(
            "val/mae",
            self.val_mae,
            on_step=False,
            on_epoch=True,
            prog_bar=True,
            batch_size=targets.shape[0],
        )
        # The L1 loss over the whole set equals the MAE; kept as its own metric so that every
        # objective logs val/loss.
        self.val_loss.update(
            torch.nn.functional.l1_loss(predictions.detach(), targets), weight=targets.shape[0]
        )
        self.log(
            "val/loss", self.val_loss, on_step=False, on_epoch=True, batch_size=targets.shape[0]
        )


@torch.no_grad()
def mean_absolute_error(model: nn.Module, batches: Any) -> float:
    """MAE of `model` (in eval mode) over an iterable of graph batches, every graph counted once."""
    was_training = model.training
    model.eval()
    metric = MeanAbsoluteError()
    for batch in batches:
        predictions = model(batch)
        metric.update(predictions.float().cpu(), graph_targets(batch).float().cpu())
    model.train(was_training)
    return float(metric.compute())
