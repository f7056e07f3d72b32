"""A LightningModule for per-token classification: an encoder, a linear head, cross-entropy."""

from __future__ import annotations

from dataclasses import asdict

import lightning as L
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import TransformerConfig, TransformerEncoder
from .optim import OptimConfig, build_optimizer


class TokenClassifier(L.LightningModule):
    """tokens (B, L) -> logits (B, L, num_classes) through `TransformerEncoder(config)`.

    Logs train/loss and train/acc every step, val/loss and val/acc (token accuracy over the whole
    validation set, averaged across devices) at each validation.
    """

    def __init__(self, config: TransformerConfig, num_classes: int, optim: OptimConfig):
        super().__init__()
        self.save_hyperparameters(
            {"model": config.to_dict(), "num_classes": num_classes, "optim": asdict(optim)}
        )
        self.config, self.optim = config, optim
        self.encoder = TransformerEncoder(config)
        self.head = nn.Linear(config.dim, num_classes)

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.head(self.encoder(tokens, key_padding_mask))  # (B, L, C)

    def _step(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        tokens, targets = batch
        logits = self(tokens)  # (B, L, C)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        accuracy = (logits.argmax(-1) == targets).float().mean()
        return loss, accuracy

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, accuracy = self._step(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", accuracy, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, accuracy = self._step(batch)
        size = batch[0].numel()
        self.log("val/loss", loss, sync_dist=True, batch_size=size)
        self.log("val/acc", accuracy, prog_bar=True, sync_dist=True, batch_size=size)

    def configure_optimizers(self):
        optimizer, scheduler = build_optimizer(self.parameters(), self.optim)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        clip = self.optim.clip_norm if gradient_clip_val is None else gradient_clip_val
        if clip:
            self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")
