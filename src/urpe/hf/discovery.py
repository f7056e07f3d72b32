"""Which modules of a transformers model are self-attention that urpe can take over.

A module qualifies when its class's forward looks its attention function up in transformers'
`ALL_ATTENTION_FUNCTIONS` (the AttentionInterface): then a function registered there receives the
module and its q, k, v. Cross-attention modules (decoder over encoder states) are recognised by
their names and flags and stay on the model's own attention: URPE's gate is indexed by the offset
key - query, which has no meaning between two different sequences.
"""

from __future__ import annotations

import inspect
from functools import cache

from torch import nn

# Names transformers gives to cross-attention modules or their parents: T5 (EncDecAttention),
# BART/Marian/Whisper (encoder_attn), GPT-2 and BERT (crossattention).
CROSS_NAMES = ("encdecattention", "encoder_attn", "crossattention", "cross_attn", "cross_attention")
# Keyword arguments an attention class may pass to its attention function for variants that
# urpe.attention does not compute (Gemma 2's soft-capping; gpt-oss's and others' sinks).
SOFTCAP = "softcap"
SINKS = ("s_aux", "sinks")


class UnsupportedModelError(TypeError):
    """The model's attention cannot be replaced through transformers' AttentionInterface."""


@cache
def routes_through_interface(cls: type) -> bool:
    """True when cls.forward reads its attention function from ALL_ATTENTION_FUNCTIONS."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


@cache
def _passed_keywords(cls: type) -> frozenset[str]:
    """Keyword names cls.forward passes in its calls (read from its bytecode's constants)."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    consts = () if code is None else code.co_consts
    return frozenset(k for c in consts if isinstance(c, tuple) for k in c if isinstance(k, str))


def refused_feature(module: nn.Module, config) -> str | None:
    """The attention variant this module uses that urpe.attention does not compute, or None:
    logit soft-capping (passed as softcap=, Gemma 2) or attention sinks (s_aux= / sinks=)."""
    passed = _passed_keywords(type(module))
    if SOFTCAP in passed:
        cap = getattr(module, "attn_logit_softcapping", None)
        cap = getattr(config, "attn_logit_softcapping", None) if cap is None else cap
        if cap is not None:
            return f"logit soft-capping (attn_logit_softcapping={cap})"
    if passed & set(SINKS):
        return "attention sinks"
    return None


def is_cross_attention(name: str, module: nn.Module) -> bool:
    """Cross-attention by flag (GPT-2's is_cross_attention), class name (BertCrossAttention) or
    module path (T5's EncDecAttention, BART's encoder_attn, ...)."""
    if getattr(module, "is_cross_attention", False):
        return True
    if "cross" in type(module).__name__.lower():
        return True
    parts = [part.lower() for part in name.split(".")]
    return any(part in CROSS_NAMES or "cross" in part for part in parts)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module whose attention goes through the interface."""
    return [(n, m) for n, m in model.named_modules() if routes_through_interface(type(m))]


def self_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The self-attention modules `add_urpe` can gate, in model order (T5: encoder, then decoder).

    Raises UnsupportedModelError, naming the model class, when the model does not route its
    attention through transformers' AttentionInterface (DeBERTa, for example).
    """
    found = attention_modules(model)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if not found or (can_set is not None and not can_set()):
        raise UnsupportedModelError(
            f"urpe.hf cannot add URPE to {type(model).__name__}: its attention does not go "
            "through transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS), so no attention "
            "function can replace it. Supported: models whose attention classes call "
            "ALL_ATTENTION_FUNCTIONS.get_interface (Llama, Mistral, Qwen2, GPT-2, BERT, RoBERTa, "
            "T5, BART, ...); for other models use urpe.attention inside your own attention "
            "module (see the README)."
        )
    return [(n, m) for n, m in found if not is_cross_attention(n, m)]


def select_layers(
    model: nn.Module, layers
) -> tuple[list[tuple[str, nn.Module]], tuple[int, ...] | None]:
    """The modules to gate and their indices (None: all). `layers` holds indices into
    `self_attention_modules(model)` and/or qualified module names. UnsupportedModelError when a
    chosen module uses an attention variant urpe.attention does not compute."""
    chosen, indices = _select(model, layers)
    for _, module in chosen:
        feature = refused_feature(module, getattr(module, "config", None) or model.config)
        if feature is not None:
            raise UnsupportedModelError(
                f"urpe.hf cannot add URPE to {type(model).__name__}: its attention uses "
                f"{feature}, which urpe.attention does not compute"
            )
    return chosen, indices


def _select(model: nn.Module, layers) -> tuple[list[tuple[str, nn.Module]], tuple[int, ...] | None]:
    candidates = self_attention_modules(model)
    if layers is None:
        return candidates, None
    if isinstance(layers, (int, str)):
        layers = [layers]
    names = {n: i for i, (n, _) in enumerate(candidates)}
    chosen: set[int] = set()
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, (int, str)):
            raise TypeError(f"layers must hold ints or module names, got {layer!r}")
        if isinstance(layer, int):
            if not 0 <= layer < len(candidates):
                raise ValueError(
                    f"layer index {layer} is out of range: {type(model).__name__} has "
                    f"{len(candidates)} self-attention modules (0..{len(candidates) - 1})"
                )
            chosen.add(layer)
            continue
        if layer in names:
            chosen.add(names[layer])
            continue
        module = dict(model.named_modules()).get(layer)
        if module is not None and routes_through_interface(type(module)):
            raise ValueError(
                f"{layer!r} is a cross-attention module of {type(model).__name__}: urpe.hf gates "
                "self-attention only (the offset key - query has no meaning across two "
                "sequences); cross-attention stays on the model's own attention"
            )
        raise ValueError(
            f"{layer!r} is not a self-attention module of {type(model).__name__}; "
            f"choose from {list(names)[:4]}{' ...' if len(names) > 4 else ''}"
        )
    indices = tuple(sorted(chosen))
    if not indices:
        raise ValueError("layers selects no module; pass None to gate every self-attention module")
    return [candidates[i] for i in indices], indices
