"""The attention function transformers calls for a model with URPE gates.

`add_urpe` switches `config._attn_implementation` to "urpe_eager" or "urpe_sdpa" (the model's own
implementation behind the prefix). Both names are registered in transformers' AttentionInterface
(this function) and AttentionMaskInterface (the base's mask builder, so masks arrive in the form
the base expects). Modules without a gate (cross-attention, layers left out) run the base
implementation unchanged; gated ones run

    out = dropout(softmax(scaling * q k^T + position_bias + mask) * C) @ v

through `urpe.attention` (its dispatch: the compiled C++ kernel, else the blockwise one, on the CPU;
Triton on CUDA), with C the module's gate at
this call's positions (see `positions`). T5's `position_bias` travels as urpe's `bias`, so its
gradient reaches T5's bias table. A decay (`add_urpe(decay="fox")`) joins the bias (see `decay`).
Packed batches (transformers' DataCollatorWithFlattening) travel
as `document_ids` (see `packing`), each document attending only to itself. Each patched module
keeps its own prepared calls (`CALLS`): a decoding step neither checks its arguments nor
chooses a backend again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ..kernels import attention
from .decay import call_decay, forget_of, with_decay
from .packing import document_ids_of
from .positions import call_positions

PREFIX = "urpe_"
# The attribute under which a patched module keeps its prepared attention calls (an
# `urpe.kernels.AttentionCalls`: the prompt's and the decoding steps' kinds)
CALLS = "_urpe_calls"
MASKS = {"eager": eager_mask, "sdpa": sdpa_mask}
# Arguments of attention variants urpe does not compute; refused rather than silently ignored.
REFUSED = {
    "softcap": "logit soft-capping (Gemma 2)",
    "s_aux": "attention sinks (gpt-oss)",
    "sinks": "attention sinks",
}


def gate_of(module: nn.Module) -> nn.Module | None:
    """The module's gate: its own `urpe_gate`, or the model-wide one when gates are shared.

    Looked up on every call (not cached), so a wrapper that replaces the gate module, such as
    PEFT's modules_to_save, is the one used.
    """
    own = module._modules.get("urpe_gate")
    if own is not None:
        return own
    owner = module.__dict__.get("_urpe_owner")
    return None if owner is None else owner._modules.get("urpe_gate")


def base_function(base: str, module: nn.Module) -> Callable:
    """The base implementation: SDPA's integration, or the model family's eager function."""
    if base == "sdpa":
        return sdpa_attention_forward
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(
            f"{type(module).__name__} has no eager_attention_forward in its module; load the "
            "model with attn_implementation='sdpa' before add_urpe"
        )
    return eager


def _check_supported(module: nn.Module, mask, kwargs: dict) -> None:
    for name, what in REFUSED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{type(module).__name__} passes {name}= ({what}), which urpe.attention does "
                "not compute; URPE cannot be added to this model"
            )
    if mask is not None and not isinstance(mask, Tensor):
        raise TypeError(
            f"urpe.hf needs a tensor attention mask, got {type(mask).__name__} (a flex "
            "BlockMask?): load the model with attn_implementation='sdpa' or 'eager'"
        )


def urpe_attention_forward(
    base: str,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention call: q (B, H, Lq, D), k, v (B, Hkv, Lk, D) -> (B, Lq, H, Dv).

    attention_mask: None, a 4-D bool mask (True takes part; "sdpa" base) or a 4-D float mask
    added to the logits ("eager" base), as the base's mask builder made it.
    """
    gate_module = gate_of(module)
    if gate_module is None and forget_of(module) is None:
        return base_function(base, module)(module, query, key, value, attention_mask, **kwargs)
    _check_supported(module, attention_mask, kwargs)
    bias = kwargs.get("position_bias")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    lq, lk = query.shape[2], key.shape[2]
    # As in transformers' SDPA integration: without a mask, causality comes from the flag; a
    # longer key buffer then means an empty static cache's unused tail, which is cut off.
    causal = bool(is_causal) and attention_mask is None and lq > 1
    if causal and lk > lq:
        key, value = key[:, :, :lq], value[:, :, :lq]
        bias = None if bias is None else bias[..., :lq]
        lk = lq
    documents = document_ids_of(kwargs, lk, lq, module)
    positions = call_positions(module, lq, lk, query.device)
    gate = None if gate_module is None else gate_module(positions)
    bias = with_decay(bias, call_decay(module, lq, lk), lq, lk)
    calls = module.__dict__.get(CALLS, attention)  # the module's own prepared calls
    out = calls(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=float(kwargs.get("dropout", 0.0) or 0.0),
        is_causal=causal,
        scale=kwargs.get("scaling"),
        enable_gqa=key.shape[1] != query.shape[1],
        bias=bias,
        gate=gate,
        document_ids=documents,
    )  # (B, H, Lq, Dv)
    return out.transpose(1, 2).contiguous(), None


def _bound(base: str) -> Callable:
    def forward(module, query, key, value, attention_mask, **kwargs):
        return urpe_attention_forward(base, module, query, key, value, attention_mask, **kwargs)

    forward.__name__ = f"{PREFIX}{base}_attention_forward"
    return forward


def register() -> None:
    """Register "urpe_eager" and "urpe_sdpa" with transformers (idempotent)."""
    for base, mask in MASKS.items():
        AttentionInterface.register(PREFIX + base, _bound(base))
        AttentionMaskInterface.register(PREFIX + base, mask)


def implementation_name(base: str) -> str:
    return PREFIX + base


def base_of(implementation: str | None) -> str | None:
    """ "sdpa" for "urpe_sdpa"; None for a name urpe did not register."""
    if implementation and implementation.startswith(PREFIX):
        return implementation[len(PREFIX) :]
    return None
