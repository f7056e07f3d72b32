"""Prepared calls: an attention call checked and its backend chosen once, then run many times.

    prepared = urpe.kernels.prepare(q, k, v, gate=gate, is_causal=True)  # checks, chooses
    out = prepared(q2, k2, v2, gate=gate2)       # other tensors of the same kind: runs at once

What `resolve` checks and "auto" chooses depends only on a call's *kind* (`call_kind`): the
shapes, dtypes and devices of its tensors, the kinds of its terms (`Term.signature`) and its
scalar arguments, never on tensor values. The keys' length Lk is not part of a kind (each
tensor's last dim, where it is Lk, reads `ANY_LENGTH`), so one prepared call serves a KV cache
that grows by a key per decoding step; backends may not decide on Lk alone (`backends`).
Values that must be read (a `Relation`'s range, a `Decay`'s sign) are checked on every call.

The route from a call to a kernel, the same for a first call and every later one:

    urpe.attention(...)                      dispatch.py: autocast, then the memo below
      AttentionCalls(...)                    the call's kind -> its PreparedAttention
        PreparedAttention.run(tensors)       build_spec: the call's spec (spec.py)
          PreparedAttention.execute(spec)    the chosen backend and its run for this kind,
                                             `backend.runner(spec)` (chosen again after a
                                             registry change or a backend failure)
            execute(run, spec)               empty calls, the non-finite rule, overflow, batch
              run(spec)                      the backend's layers: one route per mode (no
                                             gradient, gradient, compiled), see its module

`urpe.attention` keeps the prepared calls of the last `CAPACITY` kinds in one such memo; the
library's owners of repeated calls hold their own (`AttentionCalls(capacity)`): a forward
pass's `AttentionContext`, a `KVCache` while decoding, each module `urpe.hf` patches. A memo is
safe to share between threads, holds no tensors, and its prepared calls choose their backend
again when a watched registry changes (`watched.generation`).

Never kept (prepared anew on every call): calls while torch.compile traces or a torch.func
transform or forward-mode AD is active, tensor subclasses, and arguments of unusual types
(`scale=1`, `is_causal=0`, ...: the full checks accept or refuse those).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .backends import BackendFailure, choose_backend, current_backend_name, mark_broken
from .execute import execute
from .host import PLAIN, compiling, plain_tensors, transforms_active
from .spec import Arguments, AttentionSpec, build_spec
from .term_shapes import ANY_LENGTH, tensor_signature
from .terms import PositionTerm, Term
from .watched import generation

CAPACITY = 64  # urpe.attention's memo: a model's calls are of a few kinds
# Held while a memo changes (lookups take none): one for every memo, made at import, so that a
# memo made where torch.compile traces (a KV cache of segment memory) makes no lock
_KEEPING = threading.Lock()
_UNKEYED = object()  # a part of a call no kind can stand for: the call is not kept


def _tensor_kind(t, lk: int):
    if not isinstance(t, Tensor) or not plain_tensors(t):
        return _UNKEYED
    return tensor_signature(t, lk)


def _term_kind(term, lk: int):
    if isinstance(term, Term):
        return term.signature(lk)
    if isinstance(term, Tensor) and plain_tensors(term):
        return ("dense", tensor_signature(term, lk))
    return _UNKEYED


def _seed_kind(seed):
    if type(seed) is int:
        return int
    if isinstance(seed, Tensor) and plain_tensors(seed) and seed.dim() == 0:
        return tensor_signature(seed, -1)
    return _UNKEYED


def _keys_shape(shape: torch.Size) -> tuple:
    """A (..., Hkv, Lk, E) shape without Lk."""
    return (*shape[:-2], ANY_LENGTH, shape[-1])


def call_kind(a: Arguments) -> tuple | None:
    """The kind of a call (module docstring): equal for two calls whose checks and backend
    choice come out the same at any Lk; None where the call is never kept. (Run on every
    call: written for speed, by local names and without helper calls on the common path.)"""
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = a[:8]
    bias, gate, key_padding_mask, normalization, dropout_seed, document_ids, backend = a[8:]
    if type(q) not in PLAIN or type(k) not in PLAIN or type(v) not in PLAIN:
        return None  # not tensors, or subclasses
    # scalars of the types the checks expect (others, `scale=1`, `is_causal=0` or a tensor, go
    # through the full checks every time)
    if (
        not (
            type(dropout_p) is float
            and (is_causal is True or is_causal is False)
            and (scale is None or type(scale) is float)
            and (enable_gqa is True or enable_gqa is False)
            and type(normalization) is str
            and type(backend) is str
        )
        or compiling()
        or transforms_active()
        or forward_ad._current_level >= 0  # forward-mode AD (`host.forward_ad_active`)
    ):
        return None
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if len(k_shape) == 4 and len(v_shape) == 4:  # (B, Hkv, Lk, E): read by index
        lk = k_shape[2]
        keys = (k_shape[0], k_shape[1], k_shape[3], v_shape[0], v_shape[1], v_shape[3])
        values_length = v_shape[2] == lk
    elif len(k_shape) < 3 or len(v_shape) < 3 or len(q_shape) < 3:
        return None
    else:
        lk = k_shape[-2]
        keys = (_keys_shape(k_shape), _keys_shape(v_shape))
        values_length = v_shape[-2] == lk
    if (
        attn_mask is None
        and key_padding_mask is None
        and document_ids is None
        and dropout_seed is None
    ):  # (most calls pass none of these: by identity, never a term's own __eq__)
        if bias is None and gate is None:
            optional = None
        else:  # (a decoding step with position terms)
            optional = (
                None if bias is None else _term_kind(bias, lk),
                None if gate is None else _term_kind(gate, lk),
            )
            if _UNKEYED in optional:
                return None
    else:
        optional = (
            None if attn_mask is None else _tensor_kind(attn_mask, lk),
            None if key_padding_mask is None else _tensor_kind(key_padding_mask, lk),
            None if bias is None else _term_kind(bias, lk),
            None if gate is None else _term_kind(gate, lk),
            None if document_ids is None else _tensor_kind(document_ids, lk),
            None if dropout_seed is None else _seed_kind(dropout_seed),
        )
        if _UNKEYED in optional:
            return None
    return (
        q_shape,
        keys,
        values_length,  # (v's length differing from k's is an error the checks name)
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        optional,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        normalization,
        backend,
        # Lk itself where something may weigh it: no key at all (an empty call), and dropout
        # (a kernel's counter covers Lq * Lk entries)
        lk if dropout_p != 0.0 or lk == 0 else ANY_LENGTH,
    )


class PreparedAttention:
    """An attention call checked and its backend chosen once (module docstring).

    Made by `prepare(q, k, v, **kwargs)` with `urpe.attention`'s arguments; calling it runs
    `urpe.attention` on new tensors of the same kind with the scalar arguments it was prepared
    with (any number of keys Lk). A call of another kind raises ValueError. Holds no tensors.
    """

    def __init__(self, arguments: Arguments, spec: AttentionSpec, kind: tuple | None):
        self.kind = kind
        # the scalar arguments as given (the tensors dropped: none is kept alive)
        self._scalars = arguments._replace(
            q=None,
            k=None,
            v=None,
            attn_mask=None,
            bias=None,
            gate=None,
            key_padding_mask=None,
            dropout_seed=None,
            document_ids=None,
        )
        # build_spec's arguments that the kind fixes
        self._fixed = (
            spec.batch_shape,
            spec.is_causal,
            spec.normalization,
            spec.scale,
            spec.dropout_p,
        )
        self._choose(spec)

    @property
    def backend(self):
        """The backend it runs on (`urpe.kernels.Backend`)."""
        return self._choice[0]

    def _choose(self, spec: AttentionSpec) -> tuple:
        now = generation()  # read first: a registry change while choosing makes it stale
        backend = choose_backend(self._scalars.backend, spec)
        # the backend's run for this kind (`Backend.runner`); one assignment: another thread
        # sees the old choice or the new one
        self._choice = (backend, backend.runner(spec), backend.capabilities.finds_nonfinite, now)
        return self._choice

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None = None,
        *,
        bias: PositionTerm | None = None,
        gate: PositionTerm | None = None,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        dropout_seed: int | Tensor | None = None,
    ) -> Tensor:
        """(..., H, Lq, Dv): `urpe.attention` on these tensors with the prepared arguments."""
        a = self._scalars._replace(
            q=q,
            k=k,
            v=v,
            attn_mask=attn_mask,
            bias=bias,
            gate=gate,
            key_padding_mask=key_padding_mask,
            document_ids=document_ids,
            dropout_seed=dropout_seed,
        )
        cast = a.autocast()
        if cast is not None:
            with torch.autocast(q.device.type, enabled=False):
                return self(
                    cast.q,
                    cast.k,
                    cast.v,
                    cast.attn_mask,
                    bias=bias,
                    gate=gate,
                    key_padding_mask=key_padding_mask,
                    document_ids=document_ids,
                    dropout_seed=dropout_seed,
                )
        kind = call_kind(a)
        if kind is None:  # not a kind that can be compared (tracing, unusual types): in full
            return PreparedAttention(a, a.spec(), None).run(a)
        if kind != self.kind:
            raise ValueError(
                "this prepared attention call was made for other shapes, dtypes, devices or "
                "term kinds than these tensors (only the number of keys may change; under "
                "autocast the dtype is autocast's): prepare one for them with "
                "urpe.kernels.prepare, or call urpe.attention"
            )
        return self.run(a)

    def run(self, a: Arguments) -> Tensor:
        """The call on arguments whose kind is this call's (the caller knows: a memo found it by
        that kind); unchecked otherwise."""
        spec = build_spec(
            a.q,
            a.k,
            a.v,
            a.attn_mask,
            a.bias,
            a.gate,
            a.key_padding_mask,
            a.document_ids,
            a.dropout_seed,
            *self._fixed,
        )
        return self.execute(spec)

    def execute(self, spec: AttentionSpec) -> Tensor:
        """The spec on the chosen backend (chosen again where a registry changed since)."""
        backend, run, finds_nonfinite, chosen_at = self._choice
        if chosen_at != generation():
            backend, run, finds_nonfinite, _ = self._choose(spec)
        try:
            return execute(run, spec, finds_nonfinite)
        except BackendFailure as failure:
            if self._scalars.backend != "auto":
                raise
            mark_broken(backend, spec, failure)  # a registry change: the next try chooses again
            return self.execute(spec)


def prepare(q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> PreparedAttention:
    """Check `urpe.attention(q, k, v, *args, **kwargs)`'s arguments once and choose the
    backend: a `PreparedAttention` that runs calls of this kind (the same scalar arguments,
    other tensors of the same shapes, dtypes and term kinds, any number of keys) without doing
    either again."""
    a = Arguments.of((q, k, v, *args), kwargs)
    a = a._replace(backend=current_backend_name(a.backend))
    cast = a.autocast()  # under autocast: the kind of the tensors the kernels will see
    if cast is not None:
        with torch.autocast(q.device.type, enabled=False):
            return PreparedAttention(cast, cast.spec(), call_kind(cast))
    return PreparedAttention(a, a.spec(), call_kind(a))


class AttentionCalls:
    """Prepared calls kept by kind: calling it is calling `urpe.attention` (same arguments),
    preparing a call the first time its kind is met and keeping the last `capacity` kinds.
    Safe to share between threads; holds no tensors."""

    def __init__(self, capacity: int = 4) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._prepared: dict[tuple, PreparedAttention] = {}

    def __len__(self) -> int:
        return len(self._prepared)

    def __reduce__(self):
        # A copy (copy.deepcopy of a model or a cache, pickling) starts empty: prepared calls
        # are cheap to make again.
        return (type(self), (self.capacity,))

    def clear(self) -> None:
        with _KEEPING:
            self._prepared.clear()

    def __call__(self, *args, **kwargs) -> Tensor:
        """`urpe.attention(*args, **kwargs)` through the prepared calls kept here."""
        return self.call(Arguments.of(args, kwargs))

    def call(self, a: Arguments) -> Tensor:
        cast = a.autocast() if torch._C._is_any_autocast_enabled() else None
        if cast is not None:  # SDPA's autocast policy, then the kernels with autocast off
            with torch.autocast(a.q.device.type, enabled=False):
                return self.call(cast)
        kind = call_kind(a)
        prepared = None if kind is None else self._prepared.get(kind)
        if prepared is not None:
            return prepared.run(a)
        a = a._replace(backend=current_backend_name(a.backend))  # (an old name: warned once)
        prepared = PreparedAttention(a, a.spec(), kind)
        if kind is not None:
            self._keep(kind, prepared)
        return prepared.run(a)  # the route every later call of this kind takes

    def _keep(self, kind: tuple, prepared: PreparedAttention) -> None:
        with _KEEPING:
            if kind not in self._prepared and len(self._prepared) >= self.capacity:
                del self._prepared[next(iter(self._prepared))]  # the oldest kind
            self._prepared[kind] = prepared
