"""nn modules built on `urpe.attention`."""

from .attention import KVCache, MultiheadAttention
from .layer import FeedForward, TransformerLayer
from .mixers import BilinearMixer, SeparableConvMixer

__all__ = [
    "BilinearMixer",
    "FeedForward",
    "KVCache",
    "MultiheadAttention",
    "SeparableConvMixer",
    "TransformerLayer",
]
