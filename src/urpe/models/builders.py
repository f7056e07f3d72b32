"""Turn config names into the modules they stand for. The only place that knows the names."""

from __future__ import annotations

from torch import nn

from ..encodings import (
    ALiBi,
    FireBias,
    KerpleBias,
    LearnedAbsolute,
    NoPosition,
    RelativeBias,
    RelativeEncoding,
    RotaryEncoding,
    ShawRelative,
    SinusoidalAbsolute,
    T5Bias,
    ToeplitzGate,
    TransformerXLRelative,
)
from ..nn import BilinearMixer, MultiheadAttention, SeparableConvMixer, TransformerLayer
from .config import TransformerConfig


def build_position(c: TransformerConfig, causal: bool, length: int) -> RelativeEncoding:
    """length: the longest sequence the model sees (max_len plus marker tokens)."""
    h, d, far = c.num_heads, c.head_dim, length - 1
    builders = {
        "none": lambda: NoPosition(),
        "rpe": lambda: RelativeBias(h, far),
        "t5": lambda: T5Bias(h, c.num_buckets, c.bucket_max_distance, bidirectional=not causal),
        "alibi": lambda: ALiBi(h),
        "rope": lambda: RotaryEncoding(d),
        "kerple-log": lambda: KerpleBias(h, "log"),
        "kerple-power": lambda: KerpleBias(h, "power"),
        "fire": lambda: FireBias(h, init_threshold=float(length)),
        "shaw": lambda: ShawRelative(d, far),
        "txl": lambda: TransformerXLRelative(c.dim, h, d),
    }
    return builders[c.position]()


def build_gate(c: TransformerConfig, length: int) -> ToeplitzGate | None:
    if c.gate is None:
        return None
    common = dict(init=c.gate_init, activation=c.gate_activation)
    if c.gate == "t5":
        return ToeplitzGate(
            c.num_heads, num_buckets=c.num_buckets, bucket_max_distance=c.bucket_max_distance,
            **common,
        )  # fmt: skip
    return ToeplitzGate(c.num_heads, length - 1, **common)


def build_absolute(c: TransformerConfig, length: int) -> nn.Module | None:
    if c.absolute == "learned":
        return LearnedAbsolute(length, c.dim)
    if c.absolute == "sinusoidal":
        return SinusoidalAbsolute(c.dim)
    return None


def build_layers(c: TransformerConfig, causal: bool, length: int) -> nn.ModuleList:
    """The layer stack. With share_position, every attention layer holds the same B and C."""
    shared = (build_position(c, causal, length), build_gate(c, length))
    layers = []
    for index in range(c.num_layers):
        kind = c.mixers.get(index, "attention")
        if kind == "bilinear":
            mixer = BilinearMixer(c.dim, length)
        elif kind == "conv":
            mixer = SeparableConvMixer(c.dim, c.conv_kernel_size)
        else:
            position, gate = (
                shared if c.share_position else (build_position(c, causal, length),
                                                 build_gate(c, length))
            )  # fmt: skip
            mixer = MultiheadAttention(
                c.dim, c.num_heads, position=position, gate=gate, normalization=c.normalization,
                dropout=c.attention_dropout, backend=c.attention_backend,
            )  # fmt: skip
        layers.append(
            TransformerLayer(
                mixer,
                c.dim,
                c.ffn_dim,
                dropout=c.dropout,
                norm_first=c.norm_first,
                activation=c.activation,
            )  # fmt: skip
        )
    return nn.ModuleList(layers)
