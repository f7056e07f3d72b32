"""Resolved calls, remembered: the checks and the backend choice made once per kind of call.

A model calls `urpe.attention` with the same kind of arguments in every layer and, while
decoding, in every step. What `resolve` checks and "auto" decides depends only on the call's
*signature*: the shapes, dtypes, devices and types of q, k, v, of the masks and of the terms,
and the scalar arguments, never on tensor values. A call whose signature was seen before skips
both: its `Plan` (the backend, and the spec's scalar fields) builds the spec from the new tensors
and runs the backend. That is most of a decoding call's cost outside the kernel (issue 28).

A growing KV cache gives every decoding step a new number of keys, so a signature seen before
would miss once per step (the first layer's call: ~190 us of checks and choice at a model's
decoding shape, measured). A call with more keys than queries and no dropout is therefore also
remembered under its *kin* signature (`kin`): the same with the keys' length Lk left out,
wherever it appears (k's and v's shapes, a mask's or a term's last dim). A later call whose
signature misses but whose kin signature hits takes that plan. This holds only where nothing
decided depends on Lk: every backend that decided the call (for "auto", those asked before the
chosen one too) says so (`Backend.keys_length_free`), and the plan's one-call forward reads its
Toeplitz columns per call.

Plans hold no tensors (nothing is kept alive) and are kept for the last `CAPACITY` signatures.
Every registry change clears them: `BACKENDS`, `AUTO_ORDER` and `NORMALIZATIONS` are watched
(`watched`), and the signature holds the identity and size of `BROKEN` (backends found broken).

Never remembered, so always on the full path: calls under torch.compile or a torch.func
transform (they trace it), tensor subclasses, `Relation` terms (the index is range-checked on
each call), an explicit `dropout_seed`, and arguments of unusual types (`scale=1`,
`is_causal=0`, ...: the full path accepts or refuses those).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .spec import AttentionSpec, checked_log_forget, flatten_leading
from .tables import Decay, Toeplitz
from .watched import LISTENERS

CAPACITY = 64
_PLAIN = (Tensor, torch.nn.Parameter)
_NOT_CACHED = object()


@dataclass(slots=True, frozen=True)
class Plan:
    """What a resolved call of one signature keeps: the backend that runs it and the spec's
    fields that are not the call's tensors."""

    backend: object  # dispatch.Backend (not imported here: dispatch imports this module)
    is_causal: bool
    normalization: str
    scale: float
    dropout_p: float
    batch_shape: tuple[int, ...]
    # spec -> output in one call, or None (non-finite inputs: take the general path); for calls
    # that need no gradient, where the backend offers one (`Backend.direct`)
    direct: Callable[[AttentionSpec], Tensor | None] | None = None
    # The same from the call's own (q, k, v, bias, gate), without building a spec: for calls
    # with one batch dim, no masks and no documents whose direct forward offers it (the usual
    # decoding step; a spec costs about a microsecond)
    direct_from_arguments: Callable[..., Tensor | None] | None = None

    @classmethod
    def of(cls, backend, spec: AttentionSpec) -> Plan:
        direct = backend.direct(spec) if backend.direct is not None else None
        from_arguments = None
        if len(spec.batch_shape) == 1:  # (the signature fixes masks and documents as absent)
            from_arguments = getattr(direct, "from_arguments", None)
        return cls(
            backend,
            spec.is_causal,
            spec.normalization,
            spec.scale,
            spec.dropout_p,
            spec.batch_shape,
            direct,
            from_arguments,
        )

    def spec(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask,
        key_padding_mask,
        bias,
        gate,
        document_ids=None,
    ):
        """The spec `resolve` would build for these tensors (their signature is this plan's)."""
        shape = self.batch_shape
        if type(bias) is Decay:  # its values are checked on every call (where they can be read)
            checked_log_forget(bias.log_forget)
            bias = Decay(flatten_leading(bias.log_forget, shape, 2))
        if len(shape) != 1:  # (..., H, L, D) -> (B, H, L, D)
            b = q.shape[:-3].numel()
            q = q.reshape(b, *q.shape[-3:])
            k = k.reshape(b, *k.shape[-3:])
            v = v.reshape(b, *v.shape[-3:])
        return AttentionSpec(
            q,
            k,
            v,
            bias
            if bias is None or type(bias) in (Toeplitz, Decay)
            else flatten_leading(bias, shape, 3),
            gate if gate is None or type(gate) is Toeplitz else flatten_leading(gate, shape, 3),
            None if attn_mask is None else flatten_leading(attn_mask, shape, 3),
            None if key_padding_mask is None else flatten_leading(key_padding_mask, shape, 1),
            self.is_causal,
            self.normalization,
            self.scale,
            self.dropout_p,
            None,
            shape,
            None if document_ids is None else flatten_leading(document_ids, shape, 1),
        )


_PLANS: OrderedDict[tuple, Plan] = OrderedDict()


def _tensor_key(t: Tensor | None):
    if t is None:
        return None
    if type(t) not in _PLAIN:
        return _NOT_CACHED
    return (t.shape, t.dtype, t.device)


def _term_key(term):
    if term is None:
        return None
    if type(term) is Toeplitz:
        table = term.table
        if type(table) not in _PLAIN:
            return _NOT_CACHED
        return ("toeplitz", table.shape, table.dtype, table.device)
    if type(term) is Decay:
        lf = term.log_forget
        return _NOT_CACHED if type(lf) not in _PLAIN else ("decay", lf.shape, lf.dtype, lf.device)
    if isinstance(term, Tensor):
        return _tensor_key(term)
    return _NOT_CACHED  # Relation (its index is checked per call), or not a term at all


def signature(
    q,
    k,
    v,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    bias,
    gate,
    key_padding_mask,
    normalization,
    dropout_seed,
    backend,
    broken: dict,
    document_ids=None,
) -> tuple | None:
    """The call's signature, or None when the call is not remembered (module docstring).
    `broken`: dispatch's BROKEN (a backend found broken changes what "auto" chooses)."""
    if (
        dropout_seed is not None
        or type(q) not in _PLAIN
        or type(k) not in _PLAIN
        or type(v) not in _PLAIN
        or (is_causal is not True and is_causal is not False)
        or (enable_gqa is not True and enable_gqa is not False)
        or (scale is not None and type(scale) is not float)
        or type(dropout_p) is not float
        or type(normalization) is not str
        or type(backend) is not str
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
    ):
        return None
    key = (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        _tensor_key(attn_mask),
        _tensor_key(key_padding_mask),
        _term_key(bias),
        _term_key(gate),
        _tensor_key(document_ids),
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        normalization,
        backend,
        id(broken),
        len(broken),
    )
    return None if _NOT_CACHED in key[9:14] else key


# Stands for the keys' length in a kin signature (no shape holds it: no exact key can equal one)
_ANY_LENGTH = object()
_DROPOUT_P = 14  # the signature's entries, as `signature` lays them out
_TENSOR_ENTRIES = range(9, 14)  # attn_mask, key_padding_mask, bias, gate, document_ids


def kin(key: tuple) -> tuple | None:
    """The signature of the calls that differ from this one only in their number of keys Lk
    (module docstring), or None where the call has no dropout-free kin: dropout (a backend
    may weigh Lq * Lk), Lk <= Lq or Lk < 2 (a last dim of 1 would be ambiguous)."""
    q_shape, k_shape, v_shape = key[:3]
    lk = k_shape[-2]
    if key[_DROPOUT_P] != 0.0 or lk <= max(q_shape[-2], 1) or v_shape[-2] != lk:
        return None
    masks_and_terms = tuple(_without_length(key[i], lk) for i in _TENSOR_ENTRIES)
    return (
        q_shape,
        (*k_shape[:-2], _ANY_LENGTH, k_shape[-1]),
        (*v_shape[:-2], _ANY_LENGTH, v_shape[-1]),
        *key[3:9],
        *masks_and_terms,
        *key[_DROPOUT_P:],
    )


def _without_length(entry, lk: int):
    """A mask's or term's signature entry with a last dim of Lk left out (a Toeplitz table's
    width is not a number of keys)."""
    if entry is None or entry[0] == "toeplitz":
        return entry
    return tuple(
        (*part[:-1], _ANY_LENGTH) if type(part) is torch.Size and part and part[-1] == lk else part
        for part in entry
    )


def find(key: tuple) -> Plan | None:
    return _PLANS.get(key)


def find_kin(key: tuple) -> Plan | None:
    """The plan remembered for this call's kin (a decoding step with one more key), remembered
    for the call's own signature too (the step's other layers then hit it directly)."""
    family = kin(key)
    plan = None if family is None else _PLANS.get(family)
    if plan is not None:
        _PLANS.move_to_end(family)  # kept while the cache grows: the oldest goes first
        remember(key, plan)
    return plan


def remember(key: tuple, plan: Plan, keys_length_free: bool = False) -> None:
    """keys_length_free: nothing decided depends on Lk; remembered for the call's kin too."""
    family = kin(key) if keys_length_free else None
    for entry in (key,) if family is None else (key, family):
        if entry not in _PLANS and len(_PLANS) >= CAPACITY:
            _PLANS.popitem(last=False)  # the oldest: a decoding step's signatures come and go
        _PLANS[entry] = plan


def forget() -> None:
    """Drop every plan (a registry changed: a later call resolves and chooses anew)."""
    _PLANS.clear()


LISTENERS.append(forget)
