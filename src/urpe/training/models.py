"""Small task models built on `urpe.models`, describable in checkpoints."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..models import TransformerConfig, TransformerEncoder


class EncoderTokenClassifier(nn.Module):
    """tokens (B, L) -> logits (B, L, num_classes): a `TransformerEncoder` and a linear head."""

    def __init__(self, config: TransformerConfig, num_classes: int):
        super().__init__()
        self.config, self.num_classes = config, num_classes
        self.encoder = TransformerEncoder(config)
        self.head = nn.Linear(config.dim, num_classes)

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.head(self.encoder(tokens, key_padding_mask))  # (B, L, C)

    def model_config(self) -> dict[str, Any]:
        return {"transformer": self.config.to_dict(), "num_classes": self.num_classes}

    @classmethod
    def from_model_config(cls, config: dict[str, Any]) -> EncoderTokenClassifier:
        return cls(TransformerConfig.from_dict(config["transformer"]), int(config["num_classes"]))
