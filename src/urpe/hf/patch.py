"""`add_urpe`: a URPE gate C on each self-attention module of a transformers model.

    model = urpe.hf.add_urpe(model)   # C = 1 everywhere: outputs unchanged until C is trained
    model = urpe.hf.add_urpe(model, decay="fox")   # and FoX forget gates inside the softmax

The model's own position scheme (RoPE, learned absolute embeddings, T5's bias) stays as it is;
URPE multiplies the attention weights by C after the softmax, as in the paper; a decay (see
`decay`) adds a data-dependent bias inside it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from ..encodings import (
    GATE_REGISTRY,
    EncodingSettings,
    EncodingSpec,
    SpecLike,
    build_encoding,
    check_runs,
    resolve,
)
from ..kernels import AttentionCalls
from .attention import CALLS, base_of, implementation_name, register
from .decay import (
    FORGET,
    LOG_FORGET,
    PRETRAINED_INIT_BIAS,
    decay_entry,
    new_forget,
    record_call,
)
from .discovery import select_layers
from .guards import install, load_note, route_through_urpe
from .options import BASE_IMPLEMENTATIONS, UrpeOptions, bucket_reach, default_max_distance
from .packing import READS, DocumentReads
from .positions import LAYOUT, record_cache_layout

GATE = "urpe_gate"
# The module names add_urpe attaches: what PEFT's modules_to_save must name to train and save
# them beside adapters.
MODULE_NAMES = (GATE, FORGET)
# What the pre-hooks leave on a module for one call's attention (see positions, decay).
CALL_STATE = (LAYOUT, LOG_FORGET)


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


def _head_dim(module: nn.Module, heads: int, dim: int) -> int:
    for name in ("head_dim", "attention_head_size", "key_value_proj_dim"):
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return dim // heads


def gate_settings(model: nn.Module, module: nn.Module, max_distance: int) -> EncodingSettings:
    """What this door knows for a gate on `module`: its heads and widths, and sequences of up to
    K + 1 tokens (per-offset tables clip farther offsets); token sequences carry no relation.
    A bucketed table reaches across the model's context unless its spec says otherwise."""
    heads = _num_heads(module, model.config)
    dim = int(getattr(model.config.get_text_config(), "hidden_size", 0) or 0)
    return EncodingSettings(
        num_heads=heads,
        head_dim=_head_dim(module, heads, dim),
        dim=dim,
        max_length=max_distance + 1,
        causal=bool(getattr(module, "is_causal", False)),
        num_relations=None,
        model=f"urpe.hf ({type(model).__name__})",
        option_defaults={"bucket_max_distance": bucket_reach(model.config)},
    )


def _new_gate(options: UrpeOptions, model: nn.Module, module: nn.Module) -> nn.Module:
    dtype, device = _float_dtype(module)
    settings = gate_settings(model, module, options.max_distance)
    gate = build_encoding(GATE_REGISTRY, options.gate, settings, "gate")
    return gate.to(device=device, dtype=dtype)


def _new_forget(options: UrpeOptions, model: nn.Module, module: nn.Module) -> nn.Module:
    dtype, device = _float_dtype(module)
    settings = _decay_settings(model, module, options.max_distance)
    return new_forget(options.decay, settings, dtype, device)


def _decay_settings(model: nn.Module, module: nn.Module, max_distance: int) -> EncodingSettings:
    return replace(
        gate_settings(model, module, max_distance),
        option_defaults={"init_bias": PRETRAINED_INIT_BIAS},
    )


def _legacy_gate(gate, max_distance, num_buckets, bucket_max_distance) -> EncodingSpec:
    """The gate spec of add_urpe's deprecated num_buckets / bucket_max_distance arguments."""
    spec = EncodingSpec.of(gate)
    if num_buckets is None and bucket_max_distance is None:
        return spec
    warnings.warn(
        "add_urpe(num_buckets=..., bucket_max_distance=...) is deprecated: give "
        "gate={'name': 't5', 'num_buckets': N, 'bucket_max_distance': D}",
        DeprecationWarning,
        stacklevel=3,
    )
    if num_buckets is None:
        return spec  # bucket_max_distance alone never changed a per-offset gate
    if max_distance is not None:
        raise ValueError("give add_urpe max_distance or num_buckets, not both")
    if spec != EncodingSpec("toeplitz"):
        raise ValueError(f"give add_urpe gate={gate!r} or num_buckets, not both")
    given = {"bucket_max_distance": bucket_max_distance} if bucket_max_distance else {}
    return EncodingSpec("t5", {"num_buckets": num_buckets, **given})


def _refuse_peft(model: nn.Module) -> None:
    """PEFT's save_pretrained writes the adapters and the modules named in modules_to_save only:
    gates added to a model PEFT already wraps would train, then be lost silently."""
    wrapped = next((m for m in model.modules() if type(m).__module__.startswith("peft.")), None)
    if wrapped is not None:
        raise ValueError(
            f"{type(model).__name__} already holds PEFT modules ({type(wrapped).__name__}), whose "
            "save_pretrained would drop URPE gates added now: call add_urpe on the base model "
            "first, then get_peft_model(model, LoraConfig(..., modules_to_save="
            f"{list(MODULE_NAMES)})) (urpe.hf.MODULE_NAMES)"
        )


def _base_implementation(model: nn.Module) -> str:
    _refuse_peft(model)
    current = model.config._attn_implementation
    if base_of(current) is not None or any(GATE in n for n, _ in model.named_modules()):
        raise ValueError(f"{type(model).__name__} already has URPE gates (add_urpe was called)")
    if any(FORGET in n for n, _ in model.named_modules()):
        raise ValueError(f"{type(model).__name__} already has URPE decays (add_urpe was called)")
    if current not in BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"urpe.hf wraps the 'eager' or 'sdpa' attention of {type(model).__name__}, but it "
            f"uses {current!r}; load it with attn_implementation='sdpa' (or 'eager')"
        )
    return current


def add_urpe(
    model: nn.Module,
    *,
    gate: SpecLike | None = "toeplitz",
    decay: SpecLike | None = None,
    max_distance: int | None = None,
    shared: bool = False,
    layers: Iterable[int | str] | int | str | None = None,
    num_buckets: int | None = None,
    bucket_max_distance: int | None = None,
) -> nn.Module:
    """Attach URPE gates (ones at init) to a transformers model, in place; returns the model.

    Args:
        model: a `PreTrainedModel` whose attention goes through transformers' AttentionInterface
            (Llama, Mistral, Qwen2, GPT-2, BERT, RoBERTa, T5, BART, ...), loaded with
            attn_implementation "sdpa" or "eager" (the baseline the gated model equals at init).
        gate: the gate's spec, as `TransformerConfig.gate` takes it: a name in
            `urpe.encodings.GATE_REGISTRY` ("toeplitz": an entry per offset; "t5": T5-style log
            buckets, even num_buckets >= 4, half per direction, up to bucket_max_distance,
            default here the context length) or {"name": ..., <option>: ...}. Gates that read
            graph relations are refused: token sequences have none. None: no gate (with a decay).
        decay: None, or a data-dependent decay bias inside the softmax, computed from each gated
            module's input: "fox", the Forgetting Transformer's forget gates (one
            `<module>.urpe_forget` per module, also when `shared`; init_bias defaults to 10
            here, f = 0.99995, so the pretrained model barely changes at init; see
            `urpe.hf.decay`). With a KV cache the tokens' log f are kept beside the cache, so
            `generate` (greedy, sampling, beam search; dynamic and static caches) decays cached
            keys too.
        max_distance: K, the reach of per-offset tables: offsets -K..K get their own entry,
            farther ones share the edge entries. Default: min(context length - 1, 1024), the
            context length read from max_position_embeddings / n_positions; T5 (none):
            relative_attention_max_distance.
        shared: one gate for all layers (`model.urpe_gate`, as the official code shares B and C)
            instead of one per self-attention module (`<module>.urpe_gate`).
        layers: which self-attention modules get a gate: indices into
            `urpe.hf.self_attention_modules(model)` and/or qualified module names; None: all.
        num_buckets, bucket_max_distance: deprecated, for gate={"name": "t5", ...}.

    Gate parameters have "urpe" in their names. Cross-attention keeps the model's own attention;
    naming it in `layers` raises ValueError. Models that do not route attention through the
    interface, or that use soft-capping or attention sinks, raise `urpe.hf.UnsupportedModelError`
    naming their class; a model PEFT already wraps raises ValueError (add the gates first, then
    name `MODULE_NAMES` in PEFT's modules_to_save). The model gets a config of its own (one
    shared with other models stays as it was) whose `urpe` entry holds the options, so
    `save_pretrained` + `urpe.hf.from_pretrained` rebuild the gates (transformers' own
    `from_pretrained` drops them; the saved README.md and config.urpe["load"] say so). Afterwards
    the model's `set_attn_implementation` keeps the gates ("eager", "sdpa") or refuses (see
    `guards`).
    """
    base = _base_implementation(model)
    chosen, indices = select_layers(model, layers)
    spec = (
        None if gate is None else _legacy_gate(gate, max_distance, num_buckets, bucket_max_distance)
    )
    if spec is None and decay is None:
        raise ValueError(
            "add_urpe needs a gate, a decay or both; gate=None and decay=None add nothing"
        )
    if max_distance is None:
        max_distance = default_max_distance(model.config)
    elif not isinstance(max_distance, int) or isinstance(max_distance, bool) or max_distance < 1:
        raise ValueError(f"add_urpe max_distance must be an int >= 1, got {max_distance!r}")
    options = UrpeOptions(
        attn_implementation=base,
        gate=spec,
        decay=None if decay is None else EncodingSpec.of(decay),
        max_distance=max_distance,
        shared=shared,
        layers=indices,
    )
    attach(model, options, chosen)
    return model


def attach(model: nn.Module, options: UrpeOptions, chosen: list[tuple[str, nn.Module]]) -> None:
    """Build the gates for `options` on the chosen modules and switch the attention function.
    The gate spec is checked (registered, its options declared, runnable on token sequences)
    before the model changes; config.urpe records it with this door's defaults written in."""
    if options.max_distance is None:  # version-1 entries of bucketed gates
        options = replace(options, max_distance=default_max_distance(model.config))
    first = chosen[0][1]
    if options.gate is not None:
        _, entry = resolve(GATE_REGISTRY, options.gate, "gate")
        settings = gate_settings(model, first, options.max_distance)
        check_runs(GATE_REGISTRY, entry, settings)
        options = replace(options, gate=entry.with_door_defaults(options.gate, settings))
    if options.decay is not None:
        settings = _decay_settings(model, first, options.max_distance)
        entry = decay_entry(options.decay, settings)
        options = replace(options, decay=entry.with_door_defaults(options.decay, settings))
    heads = {_num_heads(m, model.config) for _, m in chosen}
    if options.shared and options.gate is not None:
        if len(heads) != 1:
            raise ValueError(f"a shared gate needs one head count, the layers have {heads}")
        model.add_module(GATE, _new_gate(options, model, first))
    reads = DocumentReads()  # packed batches' document ids, read once per pass of the model
    passes = pass_module(model, [module for _, module in chosen])
    passes.register_forward_pre_hook(reads.begin)
    passes.register_forward_hook(reads.end, always_call=True)
    for _, module in chosen:
        module.__dict__[READS] = reads
        module.__dict__[CALLS] = AttentionCalls(capacity=2)  # (a copy of the model: a new one)
        if options.gate is not None and options.shared:
            # A plain reference (not a submodule): the gate is saved once, under the model.
            module.__dict__["_urpe_owner"] = model
        elif options.gate is not None:
            module.add_module(GATE, _new_gate(options, model, module))
        if options.decay is not None:
            module.add_module(FORGET, _new_forget(options, model, module))
            module.register_forward_pre_hook(record_call, with_kwargs=True)  # and the layout
        else:
            module.register_forward_pre_hook(record_cache_layout, with_kwargs=True)
        module.register_forward_hook(end_of_call, always_call=True)
    register()
    own_config(model)
    model.config.urpe = {**options.to_dict(), "load": load_note(model)}
    model.set_attn_implementation(implementation_name(options.attn_implementation))
    route_through_urpe(model)
    install(model)


def pass_module(model: nn.Module, chosen: list[nn.Module]) -> nn.Module:
    """The module whose call is one pass over the chosen layers: the model's base model (the
    decoder stack under the LM head) where it holds them all, else the model. Its hooks run
    inside the model's call, so `torch.compile(model)` (transformers' static-cache generation)
    traces them into the model's graph; hooks of the compiled module itself would be two more
    compiled frames, each checking its guards at every decoding step."""
    base = getattr(model, "base_model", model)
    if base is model or not isinstance(base, nn.Module):
        return model
    inside = {id(module) for module in base.modules()}
    return base if all(id(module) in inside for module in chosen) else model


def own_config(model: nn.Module) -> None:
    """Give the model a config object of its own before add_urpe writes to it (its `urpe` entry,
    the attention implementation): one config may be shared by several models
    (`LlamaForCausalLM(config)` twice), and the others must stay as they are. Every module of
    the model that held the config, or one of its sub-configs, gets the copy."""
    copies: dict[int, object] = {}
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        own = module.__dict__.get("config")
        if own is not None and id(own) in copies:
            module.config = copies[id(own)]


def end_of_call(module: nn.Module, args: tuple, output) -> None:
    """Forward hook, also after an exception: drop this call's state, so that no tensor with
    autograd history (log f in training) stays on the module, where copy.deepcopy(model)
    would refuse it, and no call reads another's."""
    for key in CALL_STATE:
        module.__dict__.pop(key, None)


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The URPE parameters: gates and decays (those with "urpe" in their qualified names)."""
    return [p for n, p in model.named_parameters() if "urpe" in n]
