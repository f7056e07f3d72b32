"""urpe: Transformers with universal relative positional encodings (Luo et al., NeurIPS 2022).

Layers, bottom to top: `urpe.kernels` (attention functions) -> `urpe.encodings` (positional
encodings and the URPE gate) -> `urpe.nn` (modules) -> `urpe.models`. All of it needs torch only.

The names below are imported on first use (PEP 562), so `import urpe` and the `urpe` command's
`--help` and `--version` start without importing torch; `urpe.attention` and the rest behave as
ordinary attributes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_SOURCES = {
    **dict.fromkeys(
        (
            "ALiBi",
            "FireBias",
            "ForgetGate",
            "KerpleBias",
            "LearnedAbsolute",
            "NoPosition",
            "Positions",
            "RelationBias",
            "RelationGate",
            "RelativeBias",
            "RelativeEncoding",
            "RotaryEncoding",
            "ShawRelative",
            "SinusoidalAbsolute",
            "T5Bias",
            "ToeplitzGate",
            "TransformerXLRelative",
        ),
        "urpe.encodings",
    ),
    **dict.fromkeys(
        ("Decay", "Relation", "Toeplitz", "attention", "reference_attention"), "urpe.kernels"
    ),
    **dict.fromkeys(
        ("LanguageModel", "TransformerConfig", "TransformerDecoder", "TransformerEncoder"),
        "urpe.models",
    ),
    **dict.fromkeys(
        (
            "AttentionContext",
            "BilinearMixer",
            "KVCache",
            "MultiheadAttention",
            "SeparableConvMixer",
        ),
        "urpe.nn",
    ),
    # Saving and loading trained models needs safetensors (the `train` extra).
    "load_model": "urpe.training.bundles",
    "save_model": "urpe.training.checkpoint",
}
# Subpackages that `import urpe` has always made available as attributes.
_SUBPACKAGES = ("encodings", "files", "kernels", "models", "nn")

__all__ = [
    "ALiBi",
    "AttentionContext",
    "BilinearMixer",
    "Decay",
    "FireBias",
    "ForgetGate",
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


def __getattr__(name: str):
    if name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"urpe.{name}")
    raise AttributeError(f"module 'urpe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from .encodings import (
        ALiBi,
        FireBias,
        ForgetGate,
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
    from .nn import (
        AttentionContext,
        BilinearMixer,
        KVCache,
        MultiheadAttention,
        SeparableConvMixer,
    )
    # (load_model and save_model stay out: urpe.training sits above this package's layer)
