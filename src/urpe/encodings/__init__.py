"""Positional encodings and URPE's gate: small modules with one interface each.

Each is declared under its config name in a registry (`POSITION_REGISTRY`, `GATE_REGISTRY`,
`ABSOLUTE_REGISTRY`) beside its class, with its options; an `EncodingSpec` (a name and options)
names one in every front door. Every one reads where queries and keys sit from a `Positions`
object.
"""

from .absolute import LearnedAbsolute, SinusoidalAbsolute, sinusoid, sinusoid_frequencies
from .base import NoPosition, RelativeEncoding, clipped_table_term
from .bias import ALiBi, FireBias, KerpleBias, RelativeBias, T5Bias, alibi_slopes
from .buckets import t5_buckets
from .forgetting import ForgetGate
from .gate import RelationGate, ToeplitzGate
from .positions import Positions
from .registry import (
    ABSOLUTE_REGISTRY,
    GATE_REGISTRY,
    POSITION_REGISTRY,
    EncodingSettings,
    EncodingSpec,
    Registered,
    RegisteredNames,
    SpecLike,
    build_encoding,
    check_runs,
    register_absolute,
    register_gate,
    register_position,
    registered,
    resolve,
)
from .relation import RelationBias
from .rotary import RotaryEncoding
from .shaw import ShawRelative
from .transformer_xl import TransformerXLRelative

__all__ = [
    "ABSOLUTE_REGISTRY",
    "ALiBi",
    "EncodingSettings",
    "EncodingSpec",
    "FireBias",
    "ForgetGate",
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
    "SpecLike",
    "ShawRelative",
    "SinusoidalAbsolute",
    "T5Bias",
    "ToeplitzGate",
    "TransformerXLRelative",
    "alibi_slopes",
    "build_encoding",
    "check_runs",
    "clipped_table_term",
    "register_absolute",
    "register_gate",
    "register_position",
    "registered",
    "resolve",
    "sinusoid",
    "sinusoid_frequencies",
    "t5_buckets",
]
