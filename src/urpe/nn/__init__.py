"""nn modules built on `urpe.attention`."""

from .attention import MultiheadAttention
from .context import AttentionContext
from .layer import FeedForward, TransformerLayer
from .mixers import (
    MIXER_REGISTRY,
    BilinearMixer,
    MixerSettings,
    SeparableConvMixer,
    register_mixer,
)
from .past import KVCache

__all__ = [
    "AttentionContext",
    "BilinearMixer",
    "FeedForward",
    "KVCache",
    "MIXER_REGISTRY",
    "MixerSettings",
    "MultiheadAttention",
    "SeparableConvMixer",
    "TransformerLayer",
    "register_mixer",
]
