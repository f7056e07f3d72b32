"""Non-finite numbers in q, k, v: one rule for every backend, applied around it by dispatch.

Inside a matrix product a hidden pair still meets its key and value with weight 0, and
0 * NaN = NaN: so a NaN in a padded key would spread to every query (and into every gradient).
urpe's rule is instead:

- A query, key or value *row* (one position of one head) holding any NaN or inf is replaced by
  zeros before the backend runs, and gets zero gradient.
- Output row i of a head is NaN exactly when it could have seen such a row: its own query row is
  non-finite and it sees at least one key, or it sees a key whose key or value row is
  non-finite. "Sees" is decided by the hiding masks only (key_padding_mask, is_causal and a
  boolean attn_mask; see `masks`). A row that sees no key stays 0.
- NaN output rows pass no gradient back; every other row is exactly what it would be if the
  non-finite rows held any finite value.

Hence a NaN in a padded, causally hidden or masked-out key or value never reaches a visible
output, and a NaN query gives a NaN output row (or 0 if it sees nothing) on every backend.
NaN/inf inside bias, gate or a float attn_mask are not rewritten: they act through the ordinary
arithmetic on the pairs where they sit (a hidden pair is never read).

In eager code one reduction per tensor (no copy) tells whether anything is non-finite, and the
usual all-finite call pays nothing else: no masked copies of q, k, v, no visibility counts, no
masked_fill. On CUDA reading that flag is one host sync per call (measured against the copies it
replaces in the closing note of issue 17); where a sync is impossible (`torch.compile`, `vmap`,
CUDA graph capture) the same rule is applied without branching.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dtypes import HALF
from .masks import visible_key_counts
from .spec import AttentionSpec


def all_finite_now(*tensors: Tensor) -> bool | None:
    """True/False if it can be known here and now; None under compile, vmap or CUDA graph
    capture (where reading a device value is impossible).

    Conservative: a finite tensor whose sum overflows reads as non-finite (the exact path then
    runs, which gives the same result more slowly).
    """
    if torch.compiler.is_compiling():
        return None
    devices = {t.device.type for t in tensors}
    if devices - {"cpu", "cuda"}:
        return None
    if "cuda" in devices and torch.cuda.is_current_stream_capturing():
        return None
    with torch.no_grad():
        # accumulate half precision in float32: an fp16 sum of many O(1) values overflows
        wide = [t.detach().sum(dtype=torch.float32 if t.dtype in HALF else None) for t in tensors]
        total = sum(wide)
        try:
            return bool(torch.isfinite(total))
        except RuntimeError:  # a batched tensor under vmap cannot be read
            return None


def row_is_finite(x: Tensor) -> Tensor:
    """(..., L, D) -> (..., L) bool: the row holds no NaN or inf."""
    return torch.isfinite(x).all(-1)


def poisoned_rows(spec: AttentionSpec, q_ok: Tensor, kv_ok: Tensor) -> Tensor:
    """(B, H, Lq) bool: the output rows the rule makes NaN. q_ok (B, H, Lq), kv_ok (B, Hkv, Lk)."""
    bad_keys = ~kv_ok
    if spec.groups > 1:
        bad_keys = bad_keys.repeat_interleave(spec.groups, dim=1)  # (B, H, Lk)
    masks = (spec.key_padding_mask, spec.attn_mask, spec.is_causal, spec.lq, spec.lk)
    device = spec.q.device
    sees_bad = visible_key_counts(*masks, key_flags=bad_keys, device=device) > 0
    sees_any = visible_key_counts(*masks, device=device) > 0
    return sees_bad | (~q_ok & sees_any)


def guarded(run, spec: AttentionSpec) -> tuple[Tensor, Tensor | None]:
    """run(spec) under the rule above. Returns (output, NaN rows (B, H, Lq, 1) or None)."""
    if all_finite_now(spec.q, spec.k, spec.v):
        return run(spec), None
    q_ok = row_is_finite(spec.q)  # (B, H, Lq)
    kv_ok = row_is_finite(spec.k) & row_is_finite(spec.v)  # (B, Hkv, Lk)
    zero = torch.zeros((), dtype=spec.q.dtype, device=spec.q.device)
    clean = spec.replace(
        q=torch.where(q_ok[..., None], spec.q, zero),
        k=torch.where(kv_ok[..., None], spec.k, zero),
        v=torch.where(kv_ok[..., None], spec.v, zero),
    )
    poison = poisoned_rows(spec, q_ok, kv_ok)[..., None]  # (B, H, Lq, 1)
    return run(clean).masked_fill(poison, float("nan")), poison
