"""URPE through PyTorch's FlexAttention, exactly, with no kernel of our own (backend "flex").

FlexAttention edits scores before the softmax and can return the row log-sum-exp (lse), but it
has no hook after the softmax. URPE's gate still fits, through the lse. With S the scaled
logits, B the bias and a gate C > 0,

    softmax(S + B) ⊙ C · V = flex(S + B + log C) · exp(lse(S + B + log C) - lse(S + B)),

because softmax(S + B + log C)_ij = e^(S+B)_ij C_ij / Σ_j e^(S+B)_ij C_ij and the exp of the
lse difference swaps that denominator for the plain softmax sum.

A gate with entries <= 0 is shifted, not split: with t = 1 - min C (t = 0 when C > 0),

    softmax(S + B) ⊙ C · V = softmax(S + B) ⊙ (C + t) · V - t · softmax(S + B) · V,

where C + t >= 1 > 0 goes through the identity above and the last term is the plain call, which
is needed for its lse anyway. Two FlexAttention calls in every case instead of the three of a
C = C⁺ - C⁻ split, and every entry of C, zeros included, keeps its gradient (log C⁺ would cut
the gradient of entries that are exactly 0). t carries no gradient: the result does not depend
on it. The other exponential normalisations fit the same way, dividing by exp(h) with
h = lse(S + B) for softmax, 0 for "exp" and lse(2 (S + B)) / 2 for "l2" (a third call).

Gradients of q, k, v and of the tables come from FlexAttention's own backward (captured tensors
receive gradients). Key padding, causal masking, documents and a boolean attn_mask become a
`BlockMask`, so masked tiles are skipped; a float attn_mask is added in score_mod, like the bias;
a `Decay` bias is read in score_mod from its cumulative sums (O(L) captured numbers). FlexAttention
has no dropout, and relu2 is not an exponential, so neither is supported.
On CUDA the calls are compiled (`torch.compile(flex_attention)`); on the CPU FlexAttention runs
eagerly and forward only (PyTorch has no CPU backward for it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from .capabilities import Capabilities, built_in
from .dtypes import compute_dtype
from .spec import AttentionSpec, resolve
from .terms import Decay, Dense, PositionTerm, Relation, Toeplitz

# The exponential normalisations (relu2 is not one), no dropout; on the CPU FlexAttention runs
# eagerly and forward only (PyTorch has no CPU backward for it).
FLEX_CAPABILITIES = Capabilities(
    "FlexAttention",
    normalizations=built_in("softmax", "exp", "l2"),
    devices=("cuda",),
    emulated=("cpu",),
    gradients=("cuda",),
    dropout="none",
)


def flex_spec_unsupported(spec: AttentionSpec, cpu_backward: bool = True) -> str | None:
    """Why the FlexAttention route cannot run this resolved call, or None when it can
    (cpu_backward: refuse CPU calls that need gradients, which PyTorch's FlexAttention cannot
    give)."""
    table = FLEX_CAPABILITIES if cpu_backward else replace(FLEX_CAPABILITIES, gradients=None)
    return table.refuses(spec) or _nothing_to_compute(spec)


def _nothing_to_compute(spec: AttentionSpec) -> str | None:
    return "an empty dimension" if spec.is_empty or spec.head_dim == 0 else None


def flex_unsupported(q: Tensor, k: Tensor, v: Tensor, cpu_backward: bool = True, **kwargs):
    """Why the FlexAttention route cannot run `urpe.attention(q, k, v, **kwargs)`, or None when
    it can (k and v may have fewer heads than q)."""
    try:
        spec = resolve(q, k, v, enable_gqa=True, **kwargs)
    except (TypeError, ValueError) as error:
        return str(error)
    return flex_spec_unsupported(spec, cpu_backward)


def _lookup(term: PositionTerm, shape: tuple[int, int, int, int], transform) -> Callable:
    """A function (b, h, q_idx, kv_idx) -> transform(term)[b, h, q_idx, kv_idx] for score_mod.

    Tables are transformed (e.g. log) before lookup, so a Toeplitz or Relation term costs
    O(table) to transform, never O(L^2)."""
    batch, heads, lq, lk = shape
    if isinstance(term, Toeplitz):
        table = transform(term.table)  # (H or 1, 2K+1)
        k_max, shift, shared = term.max_offset, lk - lq, table.shape[0] == 1

        def toeplitz(b, h, q_idx, kv_idx):
            column = torch.clamp(kv_idx - q_idx - shift, -k_max, k_max) + k_max
            return table[0 if shared else h, column]

        return toeplitz
    if isinstance(term, Relation):
        table = transform(term.table)  # (H or 1, R)
        index = term.index.long()  # (B or 1, Lq, Lk)
        shared_heads, shared_batch = table.shape[0] == 1, index.shape[0] == 1

        def relation(b, h, q_idx, kv_idx):
            r = index[0 if shared_batch else b, q_idx, kv_idx]
            return table[0 if shared_heads else h, r]

        return relation
    if isinstance(term, Decay):  # bias only: -|c_pos(i) - c_j|, c = cumsum(log_forget)
        c = term.log_forget.to(compute_dtype(term.log_forget.dtype)).cumsum(-1)  # (B|1, H|1, Lk)
        if lq > lk:  # queries before the first key read c = 0 (they see no key)
            c_query = torch.cat([c.new_zeros(*c.shape[:-1], lq - lk), c], -1)
        else:
            c_query = c[..., lk - lq :]
        shared_batch, shared_heads = c.shape[0] == 1, c.shape[1] == 1

        def decay(b, h, q_idx, kv_idx):
            bb, hh = 0 if shared_batch else b, 0 if shared_heads else h
            return -torch.abs(c_query[bb, hh, q_idx] - c[bb, hh, kv_idx])

        return decay
    dense = transform(term.tensor if isinstance(term, Dense) else term)
    dense = dense.reshape((1,) * (4 - dense.dim()) + tuple(dense.shape)).expand(shape)

    def dense_lookup(b, h, q_idx, kv_idx):
        return dense[b, h, q_idx, kv_idx]

    return dense_lookup


def _gate_shift(gate: PositionTerm) -> Tensor:
    """t = 0 when every gate entry is > 0, else 1 - min C (so C + t >= 1). No host sync.
    Non-finite entries are left out: they can only sit at masked keys, which the BlockMask
    hides whatever the score."""
    values = gate.raw()[0]  # a table, or a dense tensor
    values = values.detach()
    low = torch.where(torch.isfinite(values), values, torch.full_like(values, math.inf)).min()
    return torch.where(low > 0, torch.zeros_like(low), 1.0 - low)


def _block_mask(key_padding_mask, attn_mask, is_causal, shape, device, document_ids=None):
    """FlexAttention's BlockMask for urpe's causal rule (key j <= i + Lk - Lq), key padding
    (B|1, Lk), documents (B|1, Lk) and a boolean attn_mask (B|1, H|1, Lq|1, Lk|1, True takes
    part); None when nothing is masked. A causal-only mask depends on the lengths alone:
    cached."""
    batch, heads, lq, lk = shape
    tensors = [t for t in (key_padding_mask, attn_mask, document_ids) if t is not None]
    if not tensors and not is_causal:
        return None
    if not tensors:
        return _causal_block_mask(lq, lk, str(device))
    # the mask varies over the batch / heads only where one of its inputs does (None: broadcast)
    per_batch = any(t.shape[0] > 1 for t in tensors)
    per_head = attn_mask is not None and attn_mask.shape[1] > 1
    return _make_block_mask(
        key_padding_mask,
        attn_mask,
        is_causal,
        batch if per_batch else None,
        heads if per_head else None,
        lq,
        lk,
        device,
        document_ids,
    )


@functools.lru_cache(maxsize=16)
def _causal_block_mask(lq: int, lk: int, device: str):
    return _make_block_mask(None, None, True, None, None, lq, lk, device)


def _make_block_mask(
    key_padding_mask, attn_mask, is_causal, batch, heads, lq, lk, device, document_ids=None
):
    from torch.nn.attention.flex_attention import create_block_mask

    shift = lk - lq
    if document_ids is not None:  # (B|1, Lk) -> (B or 1, Lk)
        document_ids = document_ids.expand(batch or 1, lk)
    if key_padding_mask is not None:  # (B|1, Lk) -> (B or 1, Lk), indexed by b (0 if shared)
        key_padding_mask = key_padding_mask.expand(batch or 1, lk)
    if attn_mask is not None:  # (B|1, H|1, Lq|1, Lk|1) -> (B or 1, H or 1, Lq, Lk), no copy
        attn_mask = attn_mask.expand(batch or 1, heads or 1, lq, lk)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx >= 0
        if is_causal:
            keep = keep & (kv_idx <= q_idx + shift)
        if key_padding_mask is not None:
            keep = keep & ~key_padding_mask[b if batch else 0, kv_idx]
        if attn_mask is not None:
            keep = keep & attn_mask[b if batch else 0, h if heads else 0, q_idx, kv_idx]
        if document_ids is not None:  # query i's document: the key at i + shift, if any
            row = b if batch else 0
            own = document_ids[row, torch.clamp(q_idx + shift, min=0)]
            keep = keep & (q_idx + shift >= 0) & (document_ids[row, kv_idx] == own)
        return keep

    return create_block_mask(mask_mod, batch, heads, lq, lk, device=device)


_compiled: dict[str, Callable] = {}


def default_flex() -> Callable:
    """FlexAttention as the route calls it: compiled on CUDA (one graph per shape and variant),
    eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if not torch.cuda.is_available():
        return flex_attention
    if "flex" not in _compiled:
        # torch.compile's default: static shapes first, one dynamic-shape graph on a new length
        _compiled["flex"] = torch.compile(flex_attention)
    return _compiled["flex"]


def flex_urpe_attention(
    q: Tensor, k: Tensor, v: Tensor, *, flex: Callable | None = None, **kwargs
) -> Tensor:
    """URPE attention from FlexAttention calls; arguments (bias, gate, attn_mask,
    key_padding_mask, is_causal, normalization, scale) and result as in `urpe.attention`.

    k, v may have fewer heads than q. A bool attn_mask joins the BlockMask, a float one is added
    to the scores in score_mod (like the bias). `flex` replaces
    `torch.nn.attention.flex_attention.flex_attention` (default: `default_flex()`).
    """
    spec = resolve(q, k, v, enable_gqa=True, **kwargs)
    # A caller's own `flex` may differentiate on the CPU (the float64 identity test does).
    reason = flex_spec_unsupported(spec, cpu_backward=flex is None)
    if reason is not None:
        raise ValueError(f"backend 'flex' cannot run this call: {reason}")
    out = flex_run(spec, flex)
    return out.reshape(*spec.batch_shape, spec.heads, spec.lq, spec.value_dim)


def flex_run(spec: AttentionSpec, flex: Callable | None = None) -> Tensor:
    """The FlexAttention route on a resolved call: (B, H, Lq, Dv) in q's dtype."""
    from torch.nn.attention.flex_attention import AuxRequest

    q, k, v, bias, gate = spec.q, spec.k, spec.v, spec.bias, spec.gate
    attn_mask, normalization = spec.attn_mask, spec.normalization
    flex = default_flex() if flex is None else flex
    shape = (spec.batch, spec.heads, spec.lq, spec.lk)
    hiding, additive = None, None
    if attn_mask is not None:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        if attn_mask.dtype == torch.bool:
            hiding = attn_mask
        else:  # added in the dtype of the tables (float32 for half-precision inputs)
            additive = attn_mask.to(compute_dtype(q.dtype))
    block_mask = _block_mask(
        spec.key_padding_mask, hiding, spec.is_causal, shape, q.device, spec.document_ids
    )
    options = dict(
        block_mask=block_mask,
        scale=spec.scale,
        enable_gqa=spec.groups > 1,
        return_aux=AuxRequest(lse=True),
    )
    # B and a float attn_mask, each read where the score is: never summed into an (L, L) tensor
    added = [_lookup(t, shape, lambda x: x) for t in (bias, additive) if t is not None]

    def call(extra=None, double=False):
        """flex(S + B + extra), or flex(2 (S + B)) when double; (output, lse) in float32 or
        float64."""

        def score_mod(score, b, h, q_idx, kv_idx):
            for term_at in added:
                score = score + term_at(b, h, q_idx, kv_idx)
            if extra is not None:
                score = score + extra(b, h, q_idx, kv_idx)
            # written as a sum: a Python float captured by score_mod becomes a symbolic float
            # that FlexAttention's tracing cannot resolve
            return score + score if double else score

        out, aux = flex(q, k, v, score_mod=score_mod, **options)
        return out.to(aux.lse.dtype), aux.lse  # (B, H, Lq, Dv), (B, H, Lq)

    plain, lse = call()
    if normalization == "softmax":
        h = lse
    elif normalization == "exp":
        h = torch.zeros_like(lse)
    else:  # l2: sqrt(sum e^(2 s)) = exp(lse(2 s) / 2)
        h = 0.5 * call(double=True)[1]
    visible = torch.isfinite(lse)  # False: a row that sees no key (its output is 0)
    h = torch.where(visible, h, torch.zeros_like(h))

    def rescaled(out: Tensor, row_lse: Tensor) -> Tensor:
        safe = torch.where(visible, row_lse - h, torch.zeros_like(row_lse))
        factor = torch.where(visible, torch.exp(safe), torch.zeros_like(safe))
        return out * factor[..., None]

    if gate is None:
        result = rescaled(plain, lse)
    else:
        shift = _gate_shift(gate)
        gated, gated_lse = call(extra=_lookup(gate, shape, lambda c: torch.log(c + shift)))
        result = rescaled(gated, gated_lse) - shift * rescaled(plain, lse)
    return result.to(q.dtype)


def flex_backend():
    """The registry's entry: by name only (never chosen by "auto")."""
    from .backends import Backend

    return Backend("flex", flex_run, _nothing_to_compute, capabilities=FLEX_CAPABILITIES)
