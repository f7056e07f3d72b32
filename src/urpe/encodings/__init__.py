"""Positional encodings and URPE's gate: small modules with one interface each.

Each is declared under its config name in a registry (`POSITION_REGISTRY`, `GATE_REGISTRY`,
`ABSOLUTE_REGISTRY`) beside its class; every one reads where queries and keys sit from a
`Positions` object.
"""

from .absolute import LearnedAbsolute, SinusoidalAbsolute, sinusoid, sinusoid_frequencies
from .base import NoPosition, RelativeEncoding, clipped_table_term
from .bias import ALiBi, FireBias, KerpleBias, RelativeBias, T5Bias, alibi_slopes
from .buckets import t5_buckets
from .gate import RelationGate, ToeplitzGate
from .positions import Positions
from .registry import (
    ABSOLUTE_REGISTRY,
    GATE_REGISTRY,
    POSITION_REGISTRY,
    EncodingSettings,
    Registered,
    RegisteredNames,
    register_absolute,
    register_gate,
    register_position,
)
from .relation import RelationBias
from .rotary import RotaryEncoding
from .shaw import ShawRelative
from .transformer_xl import TransformerXLRelative

__all__ = [
    "ABSOLUTE_REGISTRY",
    "ALiBi",
    "EncodingSettings",
    "FireBias",
    "GATE_REGISTRY",
    "KerpleBias",
    "LearnedAbsolute",
    "NoPosition",
    "POSITION_REGISTRY",
    "Positions",
    "Registered",
    "RegisteredNames",
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
    "alibi_slopes",
    "clipped_table_term",
    "register_absolute",
    "register_gate",
    "register_position",
    "sinusoid",
    "sinusoid_frequencies",
    "t5_buckets",
]
