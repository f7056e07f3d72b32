"""A data-dependent decay inside the softmax of a transformers model: `add_urpe(decay="fox")`.

Each gated self-attention module gets `urpe_forget`, the Forgetting Transformer's forget gates
(FoX: Lin, Nikishin, He and Courville, ICLR 2025; `urpe.encodings.ForgetGate`) computed from the
module's own input x_t (its hidden states, after the layer's norm):

    log f_t = logsigmoid(w_h . x_t + b_h),    logits_ij += sum_{t = j+1 .. i} log f_t

beside the model's own positions (RoPE, learned embeddings, T5's bias stay) and the URPE gate C
after the softmax, if there is one. A forward pre-hook computes log f of the call's tokens; with
a KV cache they are kept beside it (`forget_history`), so a query also discounts cached keys.

At init every f_t is sigmoid(init_bias) with init_bias = 10 here (not the library's 5): f =
0.99995, so a pretrained model's weights are discounted by e^-0.045 across 1,000 tokens and it
starts close to where it was; Adam moves the bias at its learning rate despite the small
gradient (1 - f).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..encodings import (
    POSITION_REGISTRY,
    EncodingSettings,
    EncodingSpec,
    ForgetGate,
    build_encoding,
    check_runs,
    resolve,
)
from ..kernels import CrossDecay, Decay, Term, dense_term
from ..kernels.dtypes import HALF, compute_dtype
from .cache_argument import cache_argument
from .forget_history import Cumulative, ForgetHistory
from .positions import LAYOUT, cache_layout

FORGET = "urpe_forget"
# Where the pre-hook leaves log f for the attention call (dropped when the call ends).
LOG_FORGET = "_urpe_call_log_forget"
# f = sigmoid(10) = 0.99995 at init (see the module docstring).
PRETRAINED_INIT_BIAS = 10.0


def decay_entry(spec: EncodingSpec, settings: EncodingSettings):
    """The registry entry of a decay spec: a position encoding computed from the layer's input
    as log forget gates (a `ForgetGate`, as "fox") that this door can run; anything else is
    refused in one line."""
    usable = [n for n, e in POSITION_REGISTRY.items() if _from_input(e)]
    _, entry = resolve(POSITION_REGISTRY, spec, "add_urpe decay", allowed=usable)
    if not _from_input(entry):
        raise ValueError(
            f"add_urpe decay must be an encoding computed from the layer's input "
            f"({', '.join(usable)}), got {spec.name!r}: the model keeps its own positions"
        )
    check_runs(POSITION_REGISTRY, entry, settings)
    return entry


def _from_input(entry) -> bool:
    # The call's term is Decay(key_state): encodings whose key state is a log forget gate.
    return isinstance(entry.cls, type) and issubclass(entry.cls, ForgetGate)


def new_forget(spec: EncodingSpec, settings: EncodingSettings, dtype, device) -> nn.Module:
    forget = build_encoding(POSITION_REGISTRY, spec, settings, "add_urpe decay")
    return forget.to(device=device, dtype=dtype)


def forget_of(module: nn.Module) -> nn.Module | None:
    return module._modules.get(FORGET)


def record_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a module with a decay, in place of `record_cache_layout`: the call's
    layout as that records it, then log f of the call's tokens, (B, L, H), and, with a cache,
    what is kept of every token before them (see `forget_history`). One hook, which finds the
    cache once: it runs in every layer of every decoding step."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    cache = cache_argument(args, kwargs)
    layer = getattr(module, "layer_idx", None)
    state = module.__dict__
    state[LAYOUT] = layout = cache_layout(cache, layer, hidden)
    forget = state["_modules"].get(FORGET)
    if forget is None:  # a wrapper replaced or removed it
        state[LOG_FORGET] = None
        return
    history = None
    if cache is not None and layer is not None:
        history = ForgetHistory.of(cache)
        projection = forget.plain_projection() if isinstance(forget, ForgetGate) else None
        if projection is not None:  # a growing cache's decoding step: gates and sums at once
            stepped = history.decoding_step(layer, hidden, projection)  # (None: not such a step)
            if stepped is not None:
                state[LOG_FORGET] = stepped
                return
    if getattr(type(forget), "key_state", None) is ForgetGate.key_state:
        rows = forget.log_forget_rows(hidden)  # (B, L, H)
    else:  # a subclass's own gates, or a wrapper's (PEFT's modules_to_save)
        rows = forget.key_state(hidden).mT
    if rows.dtype in HALF:  # a cumulative sum of ~1e-4 steps in bfloat16 would lose them
        rows = rows.float()
    kept = None
    if history is not None:
        query_start = 0 if layout is None else layout[0]
        kept = history.extend(layer, rows, query_start)
    state[LOG_FORGET] = (rows, kept)


def call_decay(module: nn.Module, query_length: int, key_length: int) -> Term | Tensor | None:
    """The decay term of this call: `Decay` over the call's keys where they are the call's own
    tokens, `CrossDecay` from the sums a growing cache keeps (a decoding step reads them, it
    sums nothing again), else the dense (B, H, Lq, Lk) bias at the queries' slots (a static
    buffer, whose queries sit inside it at a tensor offset)."""
    state = module.__dict__.get(LOG_FORGET)
    if state is None:
        return None
    rows, kept = state  # log f (B, L, H) of this call's tokens; what a cache keeps, or None
    layout = module.__dict__.get(LAYOUT)
    if kept is None:  # no cache: keys and queries are the call's tokens
        return Decay(rows.mT[..., :key_length])
    if isinstance(kept, Cumulative):
        return _growing_decay(kept, rows, layout, query_length, key_length)
    if layout is None:  # keys are positions 0 .. Lk - 1, the queries the last Lq of them
        return Decay(kept[..., :key_length])
    query_start, key_start = layout
    window = _keys(kept, key_start, key_length)  # (B, H, Lk)
    if isinstance(query_start, int) and isinstance(key_start, int):
        if query_start + query_length == key_start + key_length:
            return Decay(window)
    slots = torch.arange(query_length, device=kept.device) + (query_start - key_start)
    c = window.cumsum(-1)  # (B, H, Lk)
    return _dense(c, c.index_select(-1, slots))


def _growing_decay(kept: Cumulative, rows: Tensor, layout, lq: int, lk: int) -> Term:
    """The term of a call whose layer keeps `Cumulative` sums c by absolute position; rows:
    log f (B, L, H) of the call's tokens."""
    dtype = rows.dtype
    total = kept.length
    if layout is None:  # keys 0 .. Lk - 1 (all tokens seen), the queries the last Lq of them
        if lk == total:
            if lq == total:  # the cache's first call: its tokens alone, as without a cache
                return Decay(rows.mT[..., :lk])
            if lq == 1:  # a decoding step
                return CrossDecay(kept.decoding_term(dtype))
        query_start, key_start = lk - lq, 0
    else:
        query_start, key_start = layout
    c = kept.values  # (B, H, T)
    keys = _keys(c, key_start, lk)  # (B, H, Lk)
    if isinstance(query_start, int):
        queries = c[..., query_start : query_start + lq]  # (B, H, Lq)
        return CrossDecay(torch.cat([queries, keys], -1).to(dtype))
    slots = torch.arange(lq, device=c.device) + query_start
    return _dense(keys, c.index_select(-1, slots)).to(dtype)


def _keys(log_forget: Tensor, start, length: int) -> Tensor:
    """Values at key positions start .. start + length - 1; positions no token has reached yet
    (a static window not yet full) read 0: they are masked, and never between two tokens."""
    window = log_forget[..., start : start + length]
    missing = length - window.shape[-1]
    return window if missing <= 0 else torch.nn.functional.pad(window, (0, missing))


def _dense(c_keys: Tensor, c_queries: Tensor) -> Tensor:
    """-|c_q - c_j| from cumulative sums at the keys (B, H, Lk) and at the queries (B, H, Lq):
    (B, H, Lq, Lk)."""
    return -(c_queries[..., :, None] - c_keys[..., None, :]).abs()


def with_decay(bias: Tensor | None, decay, lq: int, lk: int):
    """The call's bias: the model's own (T5's position_bias) plus the decay."""
    if decay is None:
        return bias
    if bias is None:
        return decay
    if isinstance(decay, Term):  # (a cache's float64 sums read in the bias's compute dtype)
        decay = dense_term(decay, lq, lk, compute_dtype(bias.dtype))
    return bias + decay.to(bias.dtype)
