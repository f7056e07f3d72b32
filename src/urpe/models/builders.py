"""Turn config specs into the modules they stand for, through the encodings' registries.

The names themselves are declared beside their classes (`urpe.encodings.register_position`,
`register_gate`, `register_absolute`, `urpe.nn.register_mixer`); nothing here lists them.
"""

from __future__ import annotations

import copy

from torch import nn

from ..encodings import (
    ABSOLUTE_REGISTRY,
    GATE_REGISTRY,
    POSITION_REGISTRY,
    EncodingSettings,
    RelativeEncoding,
    build_encoding,
)
from ..nn import MIXER_REGISTRY, MixerSettings, MultiheadAttention, TransformerLayer
from .config import TransformerConfig


def encoding_settings(c: TransformerConfig, causal: bool, length: int) -> EncodingSettings:
    """The sizes the registered builders read. length: the longest sequence the model is built
    for (max_len plus marker tokens). A Transformer runs every encoding: its inputs are
    sequences, and relations come with `positions` when an encoding reads them."""
    return EncodingSettings(
        num_heads=c.num_heads,
        head_dim=c.head_dim,
        dim=c.dim,
        max_length=length,
        causal=causal,
        num_relations=c.num_relations,
        model="a Transformer",
    )


def build_position(c: TransformerConfig, causal: bool, length: int) -> RelativeEncoding:
    """The relative encoding `c.position` names."""
    settings = encoding_settings(c, causal, length)
    return build_encoding(POSITION_REGISTRY, c.position, settings, "position")


def build_gate(c: TransformerConfig, length: int, causal: bool = False) -> nn.Module | None:
    """The gate `c.gate` names, or None."""
    if c.gate is None:
        return None
    return build_encoding(GATE_REGISTRY, c.gate, encoding_settings(c, causal, length), "gate")


def build_absolute(c: TransformerConfig, length: int) -> nn.Module | None:
    """The absolute encoding `c.absolute` names, or None."""
    if c.absolute is None:
        return None
    settings = encoding_settings(c, False, length)
    return build_encoding(ABSOLUTE_REGISTRY, c.absolute, settings, "absolute")


def uses_relation(c: TransformerConfig) -> bool:
    """Whether the model's encoding or gate reads `Positions.relation` (graph relations)."""
    chosen = c.specs()
    return POSITION_REGISTRY[chosen["position"].name].uses_relation or (
        "gate" in chosen and GATE_REGISTRY[chosen["gate"].name].uses_relation
    )


def tied_copy(module: nn.Module | None) -> nn.Module | None:
    """A copy of `module` that holds the very same Parameter objects (tied, like an LM's input
    and output embeddings), and its `term_key`, so that an `AttentionContext` computes their
    term once per forward pass.

    Layers share B and C by sharing parameters, not module objects: `torch.func.functional_call`
    swaps a parameter once per module path, and one module object under several paths would be
    restored wrongly (left holding the substituted tensors).
    """
    if module is None:
        return None
    if getattr(module, "term_key", None) is None:
        module.term_key = f"tied-{id(module)}"
    clone = copy.deepcopy(module)
    for name, param in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(clone.get_submodule(owner), leaf, param)
    return clone


def build_mixer(c: TransformerConfig, kind: str, length: int) -> nn.Module:
    """The token mixer named `kind` in `urpe.nn.MIXER_REGISTRY`."""
    return MIXER_REGISTRY[kind].build(MixerSettings(c.dim, length, c.conv_kernel_size))


def build_layers(c: TransformerConfig, causal: bool, length: int) -> nn.ModuleList:
    """The layer stack. With share_position, every attention layer holds the same B and C
    parameters (tied across the layers' encoding and gate modules)."""
    shared = (build_position(c, causal, length), build_gate(c, length, causal))
    first = True
    layers = []
    for index in range(c.num_layers):
        kind = c.mixers.get(index, "attention")
        if kind != "attention":
            mixer = build_mixer(c, kind, length)
        else:
            if not c.share_position:
                position, gate = build_position(c, causal, length), build_gate(c, length, causal)
            elif first:
                position, gate = shared
            else:
                position, gate = tied_copy(shared[0]), tied_copy(shared[1])
            first = False
            mixer = MultiheadAttention(
                c.dim,
                c.num_heads,
                position=position,
                gate=gate,
                normalization=c.normalization,
                dropout=c.attention_dropout,
                backend=c.attention_backend,
            )
        layers.append(
            TransformerLayer(
                mixer,
                c.dim,
                c.ffn_dim,
                dropout=c.dropout,
                norm_first=c.norm_first,
                activation=c.activation,
            )
        )
    return nn.ModuleList(layers)
