"""`add_urpe`: a URPE gate C on each self-attention module of a transformers model.

    model = urpe.hf.add_urpe(model)   # C = 1 everywhere: outputs unchanged until C is trained

The model's own position scheme (RoPE, learned absolute embeddings, T5's bias) stays as it is;
URPE multiplies the attention weights by C after the softmax, as in the paper.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..encodings import ToeplitzGate
from .attention import base_of, implementation_name, register
from .discovery import select_layers
from .guards import install, load_note, route_through_urpe
from .options import (
    BASE_IMPLEMENTATIONS,
    NO_CONTEXT_DISTANCE,
    UrpeOptions,
    context_length,
    default_max_distance,
)
from .positions import record_cache_layout

GATE = "urpe_gate"


def _num_heads(module: nn.Module, config) -> int:
    for name in ("num_heads", "n_heads", "num_attention_heads"):
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(config, "num_attention_heads", None)
    if not isinstance(value, int):
        raise ValueError(f"cannot tell how many heads {type(module).__name__} has")
    return value


def _float_dtype(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in module.parameters():
        return (p.dtype if p.is_floating_point() else torch.float32), p.device
    return torch.get_default_dtype(), torch.device("cpu")


def _new_gate(options: UrpeOptions, heads: int, like: nn.Module) -> ToeplitzGate:
    dtype, device = _float_dtype(like)
    if options.num_buckets is not None:
        gate = ToeplitzGate(
            heads, num_buckets=options.num_buckets, bucket_max_distance=options.bucket_max_distance
        )
    else:
        gate = ToeplitzGate(heads, options.max_distance)
    return gate.to(device=device, dtype=dtype)


def _base_implementation(model: nn.Module) -> str:
    current = model.config._attn_implementation
    if base_of(current) is not None or any(GATE in n for n, _ in model.named_modules()):
        raise ValueError(f"{type(model).__name__} already has URPE gates (add_urpe was called)")
    if current not in BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"urpe.hf wraps the 'eager' or 'sdpa' attention of {type(model).__name__}, but it "
            f"uses {current!r}; load it with attn_implementation='sdpa' (or 'eager')"
        )
    return current


def add_urpe(
    model: nn.Module,
    *,
    max_distance: int | None = None,
    num_buckets: int | None = None,
    bucket_max_distance: int | None = None,
    shared: bool = False,
    layers: Iterable[int | str] | int | str | None = None,
) -> nn.Module:
    """Attach URPE gates (ones at init) to a transformers model, in place; returns the model.

    Args:
        model: a `PreTrainedModel` whose attention goes through transformers' AttentionInterface
            (Llama, Mistral, Qwen2, GPT-2, BERT, RoBERTa, T5, BART, ...), loaded with
            attn_implementation "sdpa" or "eager" (the baseline the gated model equals at init).
        max_distance: K: offsets -K..K get their own entry, farther ones share the edge entries.
            Default: min(context length - 1, 1024), the context length read from
            max_position_embeddings / n_positions; T5 (none): relative_attention_max_distance.
        num_buckets: instead of max_distance, T5-style log buckets (even, >= 4; half per
            direction) up to bucket_max_distance (default: the context length, T5: its own).
        shared: one gate for all layers (`model.urpe_gate`, as the official code shares B and C)
            instead of one per self-attention module (`<module>.urpe_gate`).
        layers: which self-attention modules get a gate: indices into
            `urpe.hf.self_attention_modules(model)` and/or qualified module names; None: all.

    Gate parameters have "urpe" in their names. Cross-attention keeps the model's own attention;
    naming it in `layers` raises ValueError. Models that do not route attention through the
    interface, or that use soft-capping or attention sinks, raise `urpe.hf.UnsupportedModelError`
    naming their class. The options are stored in `model.config.urpe`, so `save_pretrained` +
    `urpe.hf.from_pretrained` rebuild the gates (transformers' own `from_pretrained` drops them;
    the saved README.md and config.urpe["load"] say so). Afterwards the model's
    `set_attn_implementation` keeps the gates ("eager", "sdpa") or refuses (see `guards`).
    """
    base = _base_implementation(model)
    chosen, indices = select_layers(model, layers)
    if max_distance is not None and num_buckets is not None:
        raise ValueError("give add_urpe max_distance or num_buckets, not both")
    if num_buckets is None and max_distance is None:
        max_distance = default_max_distance(model.config)
    if bucket_max_distance is None:
        bucket_max_distance = context_length(model.config) or getattr(
            model.config, "relative_attention_max_distance", NO_CONTEXT_DISTANCE
        )
    options = UrpeOptions(
        attn_implementation=base,
        max_distance=max_distance,
        num_buckets=num_buckets,
        bucket_max_distance=bucket_max_distance,
        shared=shared,
        layers=indices,
    )
    attach(model, options, chosen)
    return model


def attach(model: nn.Module, options: UrpeOptions, chosen: list[tuple[str, nn.Module]]) -> None:
    """Build the gates for `options` on the chosen modules and switch the attention function."""
    heads = {_num_heads(m, model.config) for _, m in chosen}
    if options.shared:
        if len(heads) != 1:
            raise ValueError(f"a shared gate needs one head count, the layers have {heads}")
        model.add_module(GATE, _new_gate(options, heads.pop(), chosen[0][1]))
    for _, module in chosen:
        if options.shared:
            # A plain reference (not a submodule): the gate is saved once, under the model.
            module.__dict__["_urpe_owner"] = model
        else:
            module.add_module(GATE, _new_gate(options, _num_heads(module, model.config), module))
        module.register_forward_pre_hook(record_cache_layout, with_kwargs=True)
    register()
    model.config.urpe = {**options.to_dict(), "load": load_note(model)}
    model.set_attn_implementation(implementation_name(options.attn_implementation))
    route_through_urpe(model)
    install(model)


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The URPE gate parameters (those with "urpe" in their qualified names)."""
    return [p for n, p in model.named_parameters() if "urpe" in n]
