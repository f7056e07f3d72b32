"""urpe: Transformers with universal relative positional encodings (Luo et al., NeurIPS 2022).

Layers, bottom to top: `urpe.kernels` (attention functions) -> `urpe.encodings` (positional
encodings and the URPE gate) -> `urpe.nn` (modules) -> `urpe.models`. All of it needs torch only.
"""

from .encodings import (
    ALiBi,
    FireBias,
    KerpleBias,
    LearnedAbsolute,
    NoPosition,
    Positions,
    RelationBias,
    RelationGate,
    RelativeBias,
    RelativeEncoding,
    RotaryEncoding,
    ShawRelative,
    SinusoidalAbsolute,
    T5Bias,
    ToeplitzGate,
    TransformerXLRelative,
)
from .kernels import Decay, Relation, Toeplitz, attention, reference_attention
from .models import LanguageModel, TransformerConfig, TransformerDecoder, TransformerEncoder
from .nn import AttentionContext, BilinearMixer, KVCache, MultiheadAttention, SeparableConvMixer

__all__ = [
    "ALiBi",
    "AttentionContext",
    "BilinearMixer",
    "Decay",
    "FireBias",
    "KVCache",
    "KerpleBias",
    "LanguageModel",
    "LearnedAbsolute",
    "MultiheadAttention",
    "NoPosition",
    "Positions",
    "Relation",
    "RelationBias",
    "RelationGate",
    "RelativeBias",
    "RelativeEncoding",
    "RotaryEncoding",
    "SeparableConvMixer",
    "ShawRelative",
    "SinusoidalAbsolute",
    "T5Bias",
    "Toeplitz",
    "ToeplitzGate",
    "TransformerConfig",
    "TransformerDecoder",
    "TransformerEncoder",
    "TransformerXLRelative",
    "attention",
    "load_model",
    "reference_attention",
    "save_model",
]
__version__ = "0.1.0"

# Saving and loading trained models needs safetensors (the `train` extra): imported on first use,
# so `import urpe` stays torch-only.
_LAZY = {"load_model": "urpe.training.bundles", "save_model": "urpe.training.checkpoint"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'urpe' has no attribute {name!r}")
