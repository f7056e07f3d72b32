"""Transformer models assembled from `urpe.nn` parts by a config."""

from .builders import (
    build_absolute,
    build_gate,
    build_layers,
    build_position,
    encoding_settings,
    uses_relation,
)
from .config import ABSOLUTES, GATES, MIXERS, POSITIONS, TransformerConfig
from .lm import LanguageModel
from .markers import MarkerTokens
from .transformer import TransformerDecoder, TransformerEncoder, check_tokens, next_memory

__all__ = [
    "ABSOLUTES",
    "GATES",
    "LanguageModel",
    "MIXERS",
    "POSITIONS",
    "MarkerTokens",
    "TransformerConfig",
    "TransformerDecoder",
    "TransformerEncoder",
    "build_absolute",
    "build_gate",
    "build_layers",
    "build_position",
    "check_tokens",
    "encoding_settings",
    "next_memory",
    "uses_relation",
]
