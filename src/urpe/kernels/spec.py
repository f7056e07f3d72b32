"""The resolved attention call that every backend receives, and the checks that build it.

`resolve` checks `urpe.attention`'s arguments (one clear error naming the argument) and builds
one `AttentionSpec` with `build_spec`: SDPA's leading batch dims flattened into one, masks
brought to 4-D, bias and gate as `Term`s (a plain tensor becomes `Dense`), documents as
(B|1, Lk) ids, and the values that must be read checked (a `Relation`'s range, a `Decay`'s
sign). A prepared call (`urpe.kernels.prepared`) builds its specs with the same `build_spec`,
without the shape checks its kind already guarantees. Backends then read a small object
instead of a list of keyword arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from .documents import Documents
from .dtypes import compute_dtype
from .host import records_grad
from .normalization import NORMALIZATIONS, Normalization
from .term_shapes import CallShape, broadcasts, check_device, flatten_leading
from .terms import PositionTerm, Term, as_term


@dataclass(slots=True, eq=False)  # not frozen: a frozen init costs 1 us more per call
class AttentionSpec:
    """One attention call, resolved; treat it as immutable (`replace` makes a changed copy).
    Shapes use B for the flattened leading dims.

    Attributes:
        q: queries (B, H, Lq, D).
        k: keys (B, Hkv, Lk, D); H is a multiple of Hkv (grouped queries: query head h uses
            key/value head h // (H / Hkv)).
        v: values (B, Hkv, Lk, Dv).
        bias: None or a `Term` added to the logits: `Dense` (B|1, H|1, Lq|1, Lk|1),
            `Toeplitz`, `Relation` (its index (B|1, Lq, Lk) int64, range-checked), `Decay`
            (log_forget (B|1, H|1, Lk)) or a kind registered later.
        gate: None or a `Term` multiplied into the weights after normalisation (not `Decay`).
        attn_mask: None or 4-D (B|1, H|1, Lq|1, Lk|1): bool (True takes part) or float (added to
            the logits).
        key_padding_mask: None or (B|1, Lk) bool, True marks a padded key.
        is_causal: query i sees keys j <= i + Lk - Lq (False where Lq is 1: nothing is hidden).
        normalization: the name of an entry of `NORMALIZATIONS` (`norm` is the entry).
        scale: the logit scale.
        dropout_p: dropout on the weights, after the gate.
        dropout_seed: None (the backend draws one) or an int64 scalar tensor.
        batch_shape: the caller's leading dims, restored on the output.
        document_ids: None or (B|1, Lk) integer: query i sees key j only if
            ids[pos(i)] == ids[j], pos(i) = i + Lk - Lq (a query with pos(i) < 0 sees no key).
        finite: True where q, k and v are known to hold no NaN/inf (`nonfinite.guarded` sets
            it before a backend runs), None where not known: a backend whose table says
            `finds_nonfinite` then finds out itself.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    bias: Term | None = None
    gate: Term | None = None
    attn_mask: Tensor | None = None
    key_padding_mask: Tensor | None = None
    is_causal: bool = False
    normalization: str = "softmax"
    scale: float = 1.0
    dropout_p: float = 0.0
    dropout_seed: Tensor | None = None
    batch_shape: tuple[int, ...] = ()
    document_ids: Tensor | None = None
    finite: bool | None = None

    # Sizes read off the tensors: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv).
    batch = property(lambda self: self.q.shape[0])
    heads = property(lambda self: self.q.shape[1])
    kv_heads = property(lambda self: self.k.shape[1])
    lq = property(lambda self: self.q.shape[2])
    lk = property(lambda self: self.k.shape[2])
    head_dim = property(lambda self: self.q.shape[3])
    value_dim = property(lambda self: self.v.shape[3])

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.heads // max(self.kv_heads, 1)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the kernels compute in (float32 for half precision)."""
        return compute_dtype(self.q.dtype)

    @property
    def norm(self) -> Normalization:
        """The normalisation's registry entry."""
        return NORMALIZATIONS[self.normalization]

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to compute (an empty output, or no key at all: all 0)."""
        if self.q.numel() and self.v.numel():  # (most calls: both hold numbers)
            return False
        b, h, lq, _ = self.q.shape
        return b * h * lq == 0 or self.v.shape[3] == 0 or self.k.shape[2] == 0

    @property
    def differentiable(self) -> tuple[Tensor | None, ...]:
        """The tensors a gradient or a tangent may reach: q, k, v, the bias's and the gate's raw
        tensors and attn_mask (None where absent)."""
        bias = None if self.bias is None else self.bias.raw()[0]
        gate = None if self.gate is None else self.gate.raw()[0]
        return self.q, self.k, self.v, bias, gate, self.attn_mask

    @property
    def records_grad(self) -> bool:
        """Whether autograd records this call (grad mode on and some input requires grad)."""
        return torch.is_grad_enabled() and records_grad(*self.differentiable)

    def replace(self, **changes) -> AttentionSpec:
        return replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# Building a spec from a call's tensors (its arguments already checked)


def build_spec(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    bias: PositionTerm | None,
    gate: PositionTerm | None,
    key_padding_mask: Tensor | None,
    document_ids: Tensor | None,
    dropout_seed: int | Tensor | None,
    batch_shape: tuple[int, ...],
    is_causal: bool,
    normalization: str,
    scale: float,
    dropout_p: float,
) -> AttentionSpec:
    """The spec of a call whose shapes were checked (`resolve`, or a prepared call's kind): the
    batch flattened, the terms as `Term`s with their values checked, the documents expanded."""
    if len(batch_shape) != 1:  # (..., H, L, D) -> (B, H, L, D)
        b = math.prod(batch_shape)
        q = q.reshape(b, *q.shape[-3:])
        k = k.reshape(b, *k.shape[-3:])
        v = v.reshape(b, *v.shape[-3:])
    if bias is not None:
        bias = as_term(bias).flattened(batch_shape).checked_values("bias")
    if gate is not None:
        gate = as_term(gate).flattened(batch_shape).checked_values("gate")
    if attn_mask is not None:
        attn_mask = flatten_leading(attn_mask, batch_shape, 3)  # (B|1, H|1, Lq|1, Lk|1)
    if key_padding_mask is not None:
        key_padding_mask = flatten_leading(key_padding_mask, batch_shape, 1)  # (B|1, Lk|1)
    if document_ids is not None:
        document_ids = Documents(document_ids).flattened(batch_shape).expanded(k.shape[-2]).ids
    if dropout_seed is not None and not isinstance(dropout_seed, Tensor):
        dropout_seed = torch.tensor(dropout_seed % 2**62, dtype=torch.int64, device=q.device)
    elif dropout_seed is not None and (
        dropout_seed.dtype != torch.int64 or dropout_seed.device != q.device
    ):
        dropout_seed = dropout_seed.to(device=q.device, dtype=torch.int64)
    return AttentionSpec(
        q,
        k,
        v,
        bias,
        gate,
        attn_mask,
        key_padding_mask,
        is_causal,
        normalization,
        scale,
        dropout_p,
        dropout_seed,
        batch_shape,
        document_ids,
    )


# ---------------------------------------------------------------------------------------------
# Checks


def _check_qkv(q, k, v, enable_gqa: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(
                f"{name} must have shape (..., H, L, D), got rank {t.dim()}: {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == len(ks) == len(vs)) or (
        not (qs[0] == ks[0] == vs[0]) if len(qs) == 4 else not (qs[:-3] == ks[:-3] == vs[:-3])
    ):
        raise ValueError(
            f"q, k, v must share their leading (batch) dims before (H, L, D): got q "
            f"{tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    if k.device != device or v.device != device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    h, hkv = qs[-3], ks[-3]
    if hkv != h:
        if not enable_gqa:
            raise ValueError(
                f"q has {h} heads but k, v have {hkv}: q, k, v must agree in batch and heads, "
                "or pass enable_gqa=True for grouped-query attention"
            )
        if hkv == 0 or h % hkv:
            raise ValueError(
                f"enable_gqa needs q's heads ({h}) to be a multiple of k's and v's ({hkv})"
            )
    if vs[-3] != hkv:
        raise ValueError(f"k and v must have the same heads, got {hkv} and {vs[-3]}")
    if ks[-1] != qs[-1]:
        raise ValueError(f"k head dim {ks[-1]} does not match q head dim {qs[-1]}")
    if vs[-2] != ks[-2]:
        raise ValueError(f"v length {vs[-2]} does not match k length {ks[-2]}")


def _check_term(role: str, term, call: CallShape) -> None:
    if term is None:
        return
    term = as_term(term)
    if not isinstance(term, Term):
        kinds = (
            "urpe.Toeplitz, urpe.Relation or urpe.Decay"
            if role == "bias"
            else ("urpe.Toeplitz or urpe.Relation")
        )
        raise TypeError(
            f"{role} must be a Tensor, {kinds} (or another urpe.kernels.Term), got "
            f"{type(term).__name__}"
        )
    if role not in term.roles:
        name = type(term).__name__
        if term.roles == ("bias",):
            raise TypeError(
                f"urpe.{name} is a bias (added to the logits), not a {role}: pass it as bias="
            )
        raise TypeError(f"a {name} term is a {' or '.join(term.roles)}, not a {role}")
    term.check(role, call)


def _check_seed(dropout_seed) -> None:
    if dropout_seed is None:
        return
    if isinstance(dropout_seed, Tensor):
        if (
            dropout_seed.dim() != 0
            or dropout_seed.is_floating_point()
            or dropout_seed.dtype == torch.bool
        ):
            raise ValueError("dropout_seed must be an int or a 0-dim integer tensor")
    elif not isinstance(dropout_seed, int) or isinstance(dropout_seed, bool):
        raise TypeError(f"dropout_seed must be an int or a tensor, got {dropout_seed!r}")


def checked_scale(scale, head_dim: int) -> float:
    """The logit scale: 1 / sqrt(D) by default, else a finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


class Arguments(NamedTuple):
    """`urpe.attention`'s arguments, as given, in its order (the one place they are listed)."""

    q: Tensor
    k: Tensor
    v: Tensor
    attn_mask: Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    bias: PositionTerm | None = None
    gate: PositionTerm | None = None
    key_padding_mask: Tensor | None = None
    normalization: str = "softmax"
    dropout_seed: int | Tensor | None = None
    document_ids: Tensor | None = None
    backend: str = "auto"

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> Arguments:
        """`urpe.attention(*args, **kwargs)`'s arguments (its first eight may be positional)."""
        if len(args) > 8:
            raise TypeError(
                f"attention takes 8 positional arguments (SDPA's), got {len(args)}: pass bias, "
                "gate and the others by name"
            )
        try:
            return cls(*args, **kwargs)
        except TypeError as error:  # (an unknown or repeated name: said as attention says it)
            raise TypeError(str(error).replace("Arguments.__new__()", "attention()")) from None

    def spec(self) -> AttentionSpec:
        """Check every argument (one clear error naming it) and build the spec."""
        return resolved(self)

    def autocast(self) -> Arguments | None:
        """These arguments under autocast (SDPA's policy: q, k, v and a float attn_mask in the
        autocast dtype; float64 stays), or None where autocast is off for q's device. The
        kernels then run with autocast off: they choose their own precision."""
        q = self.q
        if not isinstance(q, Tensor) or not torch.is_autocast_enabled(q.device.type):
            return None
        dtype = torch.get_autocast_dtype(q.device.type)

        def cast(t):
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                return t.to(dtype)
            return t

        return self._replace(
            q=cast(q), k=cast(self.k), v=cast(self.v), attn_mask=cast(self.attn_mask)
        )


def resolve(q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> AttentionSpec:
    """Check `urpe.attention(q, k, v, *args, **kwargs)`'s arguments (one clear error naming the
    argument) and build the spec; `backend` is not read here."""
    return resolved(Arguments.of((q, k, v, *args), kwargs))


def resolved(a: Arguments) -> AttentionSpec:
    """`resolve` on arguments already gathered."""
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = a[:8]
    bias, gate, key_padding_mask = a.bias, a.gate, a.key_padding_mask
    normalization, dropout_seed, document_ids = a.normalization, a.dropout_seed, a.document_ids
    _check_qkv(q, k, v, enable_gqa)
    *batch, h, lq, d = q.shape
    batch_shape = tuple(batch)
    lk = k.shape[-2]
    call = CallShape(batch_shape, h, lq, lk, q.dtype, q.device)
    full = call.full
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {tuple(NORMALIZATIONS)}, got {normalization!r}"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:  # (1 drops every weight, as in SDPA: see `execute`)
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    scale = checked_scale(scale, d)
    _check_term("bias", bias, call)
    _check_term("gate", gate, call)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a Tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(
                f"attn_mask must be bool (True takes part) or floating point (added to the "
                f"logits), got {attn_mask.dtype}"
            )
        broadcasts("attn_mask", tuple(attn_mask.shape), full, "(..., H, Lq, Lk)")
        check_device("attn_mask", attn_mask, call)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool Tensor (True marks a padded key)")
        broadcasts(
            "key_padding_mask", tuple(key_padding_mask.shape), (*batch_shape, lk), "(..., Lk)"
        )
        check_device("key_padding_mask", key_padding_mask, call)
    if document_ids is not None:
        Documents(document_ids).check("document_ids", call)
    _check_seed(dropout_seed)
    return build_spec(
        q,
        k,
        v,
        attn_mask,
        bias,
        gate,
        key_padding_mask,
        document_ids,
        dropout_seed,
        batch_shape=batch_shape,
        # one query is aligned with the last key: causality hides nothing from it
        is_causal=is_causal and lq > 1,
        normalization=normalization,
        scale=scale,
        dropout_p=float(dropout_p),
    )
