"""What every experiment builds from its preset in the same way: the Transformer of the preset's
size and the optimiser its schedule states."""

from __future__ import annotations

from typing import Any

from ..models import TransformerConfig
from ..training.optim import OptimConfig


def sized_transformer(preset: Any, vocab_size: int, **fields: Any) -> TransformerConfig:
    """A `TransformerConfig` of the preset's size (num_layers, dim, num_heads, ffn_dim) with
    `fields` set (the experiment's own choices: length, dropout, normalisation placement)."""
    size = {name: getattr(preset, name) for name in ("num_layers", "dim", "num_heads", "ffn_dim")}
    return TransformerConfig(vocab_size=vocab_size, **size, **fields)


def preset_optim(preset: Any) -> OptimConfig:
    """The optimiser of the preset's schedule: peak lr, warmup and steps, with the final lr and
    weight decay where the preset states them."""
    stated = {f: getattr(preset, f) for f in ("end_lr", "weight_decay") if hasattr(preset, f)}
    return OptimConfig(lr=preset.lr, warmup_steps=preset.warmup, total_steps=preset.steps, **stated)
