"""The resolved attention call that every backend receives, and the checks that build it.

`resolve` turns `urpe.attention`'s arguments into one `AttentionSpec`: every argument checked (one
clear error naming it), SDPA's leading batch dims flattened into one, masks and terms brought to
4-D, `Relation` indices range-checked, and the defaults filled in. Backends then read a small
object instead of a list of keyword arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .checks import checked_relation_index
from .dtypes import HALF, compute_dtype
from .host import may_read
from .normalization import NORMALIZATIONS, Normalization
from .tables import Decay, PositionTerm, Relation, Toeplitz


@dataclass(slots=True, eq=False)  # not frozen: a frozen init costs 1 us more per call
class AttentionSpec:
    """One attention call, resolved (treat it as immutable: `replace` makes a changed copy).
    Shapes use B for the flattened leading dims.

    q: (B, H, Lq, D). k: (B, Hkv, Lk, D). v: (B, Hkv, Lk, Dv). H is a multiple of Hkv (grouped
    queries: query head h uses key/value head h // (H / Hkv)).
    bias, gate: None, a dense tensor (B|1, H|1, Lq|1, Lk|1), a `Toeplitz`, or a `Relation` whose
    index is (B|1, Lq, Lk) int64 and already range-checked; bias may also be a `Decay` whose
    log_forget is (B|1, H|1, Lk).
    attn_mask: None or 4-D (B|1, H|1, Lq|1, Lk|1): bool (True takes part) or float (added to the
    logits). key_padding_mask: None or (B|1, Lk) bool, True marks a padded key.
    dropout_seed: None (the backend draws one) or an int64 scalar tensor.
    batch_shape: the caller's leading dims, restored on the output.
    document_ids: None or (B|1, Lk) integer: query i sees key j only if
    ids[pos(i)] == ids[j], pos(i) = i + Lk - Lq (a query with pos(i) < 0 sees no key).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    bias: PositionTerm | None = None
    gate: PositionTerm | None = None
    attn_mask: Tensor | None = None
    key_padding_mask: Tensor | None = None
    is_causal: bool = False
    normalization: str = "softmax"
    scale: float = 1.0
    dropout_p: float = 0.0
    dropout_seed: Tensor | None = None
    batch_shape: tuple[int, ...] = ()
    document_ids: Tensor | None = None

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
        return compute_dtype(self.q.dtype)

    @property
    def norm(self) -> Normalization:
        return NORMALIZATIONS[self.normalization]

    @property
    def is_empty(self) -> bool:
        """Nothing to compute: the output is empty, or no query has any key (then all 0)."""
        b, h, lq, _ = self.q.shape
        return b * h * lq == 0 or self.v.shape[3] == 0 or self.k.shape[2] == 0

    def replace(self, **changes) -> AttentionSpec:
        return replace(self, **changes)


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


def _broadcasts(name: str, shape: tuple[int, ...], full: tuple[int, ...], what: str) -> None:
    """shape broadcasts to full (its dims, right-aligned, are 1 or full's)."""
    if len(shape) > len(full):
        raise ValueError(f"{name} must broadcast to {what} = {full}, got rank {len(shape)}")
    for n, m in zip(reversed(shape), reversed(full), strict=False):  # len(shape) <= len(full)
        if n != m and n != 1:
            reason = "is larger than" if m == 1 else "does not broadcast to"
            raise ValueError(f"{name} of shape {tuple(shape)} {reason} {what} = {full}")


def _check_device(name: str, t: Tensor, q: Tensor) -> None:
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _check_term(name: str, term, q: Tensor, full: tuple[int, ...]) -> None:
    """full: (*batch, H, Lq, Lk)."""
    if term is None:
        return
    if isinstance(term, Tensor):
        if not term.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {term.dtype}")
        _broadcasts(name, tuple(term.shape), full, "(..., H, Lq, Lk)")
        _check_device(name, term, q)
        return
    if isinstance(term, Decay):
        _check_decay(name, term, q, full)
        return
    if isinstance(term, (Toeplitz, Relation)):
        heads = full[-3]
        if term.num_heads not in (1, heads):
            raise ValueError(
                f"{name} table has {term.num_heads} heads, expected 1 or {heads} (q's heads)"
            )
        if term.table.dtype != q.dtype and q.dtype not in HALF:
            raise TypeError(
                f"{name} table dtype {term.table.dtype} does not match q dtype {q.dtype}"
            )
        _check_device(f"{name} table", term.table, q)
        if isinstance(term, Relation):
            want = (*full[:-3], full[-2], full[-1])
            if term.index.shape[-2:] != want[-2:]:
                raise ValueError(
                    f"{name} index has shape {tuple(term.index.shape)}, expected (..., "
                    f"{want[-2]}, {want[-1]}) with leading dims broadcastable to {want[:-2]}"
                )
            _broadcasts(f"{name} index", tuple(term.index.shape), want, "(..., Lq, Lk)")
            _check_device(f"{name} index", term.index, q)
        return
    kinds = "urpe.Toeplitz, urpe.Relation or urpe.Decay"
    if name != "bias":
        kinds = "urpe.Toeplitz or urpe.Relation"
    raise TypeError(f"{name} must be a Tensor, {kinds}, got {type(term).__name__}")


def _check_decay(name: str, term: Decay, q: Tensor, full: tuple[int, ...]) -> None:
    """full: (*batch, H, Lq, Lk)."""
    if name != "bias":
        raise TypeError(
            f"urpe.Decay is a bias (added to the logits), not a {name}: pass it as bias="
        )
    lf = term.log_forget
    *batch, heads, _, lk = full
    if lf.shape[-1] != lk or lf.shape[-2] not in (1, heads):
        raise ValueError(
            f"Decay log_forget must have shape (..., H|1, Lk) = (..., {heads}, {lk}), got "
            f"{tuple(lf.shape)}"
        )
    _broadcasts("Decay log_forget", tuple(lf.shape), (*batch, heads, lk), "(..., H, Lk)")
    if lf.dtype != q.dtype and q.dtype not in HALF:
        raise TypeError(f"Decay log_forget dtype {lf.dtype} does not match q dtype {q.dtype}")
    _check_device("Decay log_forget", lf, q)
    checked_log_forget(lf)


def checked_log_forget(log_forget: Tensor) -> None:
    """ValueError unless every value is <= 0 and finite; only where values may be read (on an
    accelerator the check would make the host wait for the device: it is skipped there)."""
    if not may_read(log_forget) or log_forget.numel() == 0:
        return
    with torch.no_grad():
        # One pass over the values (a decoding step checks every cached key's log f per layer);
        # NaN propagates into both ends, and fails "<= 0" below.
        low, high = (x.item() for x in torch.aminmax(log_forget))
        if not high <= 0:
            bad = ~(log_forget <= 0)
            value = log_forget[bad].flatten()[0].item()
            raise ValueError(
                f"Decay log_forget must be <= 0 and finite (log of a forget gate in (0, 1], "
                f"e.g. F.logsigmoid(x)), got {value}"
            )
        if low == float("-inf"):
            raise ValueError(
                "Decay log_forget must be finite (-inf would forget everything before it): "
                "clamp it, e.g. log_forget.clamp_min(-1e4)"
            )


def _check_document_ids(ids, q: Tensor, batch_shape: tuple[int, ...], lk: int) -> None:
    integer = isinstance(ids, Tensor) and not (
        ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
    )
    if not integer:
        raise TypeError(
            "document_ids must be an integer Tensor (..., Lk): the document of each key"
        )
    _broadcasts("document_ids", tuple(ids.shape), (*batch_shape, lk), "(..., Lk)")
    _check_device("document_ids", ids, q)


def flatten_leading(t: Tensor, batch_shape: tuple[int, ...], trailing: int) -> Tensor:
    """(..., *trailing dims) broadcastable over batch_shape -> (B|1, *trailing dims).

    No copy when the leading dims are all 1 or all of batch_shape; a partial broadcast expands.
    """
    if len(batch_shape) == 1 and t.dim() == trailing + 1:  # (B|1, ...): already the form
        return t
    t = t.reshape((1,) * (len(batch_shape) + trailing - t.dim()) + tuple(t.shape))
    lead, rest = tuple(t.shape[: len(batch_shape)]), tuple(t.shape[len(batch_shape) :])
    if all(n == 1 for n in lead):
        return t.reshape(1, *rest)
    if lead != batch_shape:
        t = t.expand(*batch_shape, *rest)
    return t.reshape(math.prod(batch_shape), *rest)


def _flatten_term(name: str, term, batch_shape: tuple[int, ...]):
    if term is None or isinstance(term, Toeplitz):
        return term
    if isinstance(term, Decay):
        return Decay(flatten_leading(term.log_forget, batch_shape, 2))  # (B|1, H|1, Lk)
    if isinstance(term, Relation):
        index = flatten_leading(term.index, batch_shape, 2)  # (B|1, Lq, Lk)
        if term.in_range:  # built in range, or checked once already
            return Relation(term.table, index if index.dtype == torch.int64 else index.long(), True)
        return Relation(term.table, checked_relation_index(index, term.num_relations, name), True)
    return flatten_leading(term, batch_shape, 3)  # (B|1, H|1, Lq|1, Lk|1)


def resolve(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    bias: PositionTerm | None = None,
    gate: PositionTerm | None = None,
    key_padding_mask: Tensor | None = None,
    normalization: str = "softmax",
    dropout_seed: int | Tensor | None = None,
    document_ids: Tensor | None = None,
) -> AttentionSpec:
    """Check `urpe.attention`'s arguments and build the spec (see `urpe.attention`)."""
    _check_qkv(q, k, v, enable_gqa)
    *batch, h, lq, d = q.shape
    batch_shape = tuple(batch)
    lk = k.shape[-2]
    full = (*batch_shape, h, lq, lk)
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {tuple(NORMALIZATIONS)}, got {normalization!r}"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    _check_term("bias", bias, q, full)
    _check_term("gate", gate, q, full)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a Tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(
                f"attn_mask must be bool (True takes part) or floating point (added to the "
                f"logits), got {attn_mask.dtype}"
            )
        _broadcasts("attn_mask", tuple(attn_mask.shape), full, "(..., H, Lq, Lk)")
        _check_device("attn_mask", attn_mask, q)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool Tensor (True marks a padded key)")
        _broadcasts(
            "key_padding_mask", tuple(key_padding_mask.shape), (*batch_shape, lk), "(..., Lk)"
        )
        _check_device("key_padding_mask", key_padding_mask, q)
    if document_ids is not None:
        _check_document_ids(document_ids, q, batch_shape, lk)
    if dropout_seed is not None:
        if isinstance(dropout_seed, Tensor):
            if (
                dropout_seed.dim() != 0
                or dropout_seed.is_floating_point()
                or (dropout_seed.dtype == torch.bool)
            ):
                raise ValueError("dropout_seed must be an int or a 0-dim integer tensor")
            dropout_seed = dropout_seed.to(device=q.device, dtype=torch.int64)
        elif isinstance(dropout_seed, int) and not isinstance(dropout_seed, bool):
            dropout_seed = torch.tensor(dropout_seed % 2**62, dtype=torch.int64, device=q.device)
        else:
            raise TypeError(f"dropout_seed must be an int or a tensor, got {dropout_seed!r}")
    if len(batch_shape) != 1:  # (..., H, L, D) -> (B, H, L, D)
        b = math.prod(batch_shape)
        q = q.reshape(b, h, lq, d)
        k = k.reshape(b, k.shape[-3], lk, d)
        v = v.reshape(b, v.shape[-3], lk, v.shape[-1])
    return AttentionSpec(
        q=q,
        k=k,
        v=v,
        bias=_flatten_term("bias", bias, batch_shape),
        gate=_flatten_term("gate", gate, batch_shape),
        attn_mask=None if attn_mask is None else flatten_leading(attn_mask, batch_shape, 3),
        key_padding_mask=(
            None if key_padding_mask is None else flatten_leading(key_padding_mask, batch_shape, 1)
        ),
        # one query is aligned with the last key: causality hides nothing from it
        is_causal=is_causal and lq > 1,
        normalization=normalization,
        scale=float(scale),
        dropout_p=float(dropout_p),
        dropout_seed=dropout_seed,
        batch_shape=batch_shape,
        document_ids=(
            None if document_ids is None else flatten_leading(document_ids, batch_shape, 1)
        ),
    )
