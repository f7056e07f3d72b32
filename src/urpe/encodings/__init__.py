"""Positional encodings and URPE's gate: small modules with one interface each."""

from .absolute import LearnedAbsolute, SinusoidalAbsolute, sinusoid
from .base import NoPosition, RelativeEncoding
from .bias import ALiBi, FireBias, KerpleBias, RelativeBias, T5Bias, alibi_slopes
from .buckets import t5_buckets
from .gate import ToeplitzGate
from .rotary import RotaryEncoding
from .shaw import ShawRelative
from .transformer_xl import TransformerXLRelative

__all__ = [
    "ALiBi",
    "FireBias",
    "KerpleBias",
    "LearnedAbsolute",
    "NoPosition",
    "RelativeBias",
    "RelativeEncoding",
    "RotaryEncoding",
    "ShawRelative",
    "SinusoidalAbsolute",
    "T5Bias",
    "ToeplitzGate",
    "TransformerXLRelative",
    "alibi_slopes",
    "sinusoid",
    "t5_buckets",
]
