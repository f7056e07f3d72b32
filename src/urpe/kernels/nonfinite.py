"""Non-finite numbers in q, k, v: one rule for every backend, applied around it by dispatch.

Inside a matrix product a hidden pair still meets its key and value with weight 0, and
0 * NaN = NaN: so a NaN in a padded key would spread to every query (and into every gradient).
urpe's rule is instead:

- A query, key or value *row* (one position of one head) holding any NaN or inf is replaced by
  zeros before the backend runs, and gets zero gradient.
- Output row i of a head is NaN exactly when it could have seen such a row: its own query row is
  non-finite and it sees at least one key, or it sees a key whose key or value row is
  non-finite. "Sees" is decided by the hiding masks only (key_padding_mask, is_causal,
  document_ids and a boolean attn_mask; see `masks`). A row that sees no key stays 0.
- NaN output rows pass no gradient back; every other row is exactly what it would be if the
  non-finite rows held any finite value.

Hence a NaN in a padded, causally hidden or masked-out key or value never reaches a visible
output, and a NaN query gives a NaN output row (or 0 if it sees nothing) on every backend.
NaN/inf inside bias, gate or a float attn_mask are not rewritten: they act through the ordinary
arithmetic on the pairs where they sit (a hidden pair is never read).

Whether anything is non-finite is asked once per call, on the CPU in eager code only: by the
compiled kernel's `urpe_cpp::all_finite` (one vectorised pass, a plain bool: no tensor is read)
where it is loaded, else by one reduction per tensor. A backend whose table says
`finds_nonfinite` is not asked: it runs a call that needs no gradient, and in plain eager mode
one with gradients too, at once and finds NaN/inf itself (the C++ kernel, in the rows its tiles
read and the logits and outputs it computes: a decoding step's cache is not read twice, and a
padded tail the tiles skip is not read at all), returning None where it met one; the rule then
runs. The usual
all-finite call pays nothing else: no masked copies of q, k, v, no visibility counts, no
masked_fill. Elsewhere (CUDA, `torch.compile`, `vmap`, CUDA graph capture) no value is ever
read on the host: the rule is applied as tensor ops, without branching, so a call never waits
for the device (issue 28); a `finds_nonfinite` backend may apply it itself there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .dtypes import HALF
from .host import compiling, may_read, plain_eager, plain_tensors, transforms_active
from .masks import visible_key_counts
from .spec import AttentionSpec

# device type -> a check of q, k, v that answers without reading a tensor on the host (True,
# False), or None where it cannot (the C++ kernel registers the CPU's; see `urpe.kernels.cpp`)
FINITE_CHECKS: dict[str, Callable[[tuple[Tensor, ...]], bool | None]] = {}


def all_finite_now(*tensors: Tensor) -> bool | None:
    """True/False if it can be known here and now; None where reading a value would wait for
    the device or cannot be done (CUDA, compile, vmap, CUDA graph capture, tensor subclasses).

    Conservative: the fallback reads a finite tensor whose sum overflows as non-finite (the
    exact path then runs, which gives the same result more slowly).
    """
    if not plain_tensors(*tensors) or not may_read(
        tensors[0]
    ):  # (resolve checked that q, k, v share a device)
        return None
    fast = FINITE_CHECKS.get(tensors[0].device.type)
    if fast is not None:
        known = fast(tensors)
        if known is not None:
            return known
    with torch.no_grad():
        # accumulate half precision in float32: an fp16 sum of many O(1) values overflows
        wide = [t.detach().sum(dtype=torch.float32 if t.dtype in HALF else None) for t in tensors]
        return bool(torch.isfinite(sum(wide)))


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
    ids = spec.document_ids
    sees_bad = visible_key_counts(*masks, key_flags=bad_keys, device=device, document_ids=ids) > 0
    sees_any = visible_key_counts(*masks, device=device, document_ids=ids) > 0
    return sees_bad | (~q_ok & sees_any)


def guarded(
    run: Callable[[AttentionSpec], Tensor | None], spec: AttentionSpec, finds_nonfinite: bool
) -> tuple[Tensor, Tensor | None]:
    """run(spec) under the rule above. Returns (output, NaN rows (B, H, Lq, 1) or None).

    finds_nonfinite: the backend's table says so: a call that needs no gradient, or one with
    gradients in plain eager mode (`host.plain_eager`), runs at once with `spec.finite` None,
    and the backend returns None where it met NaN/inf (in q, k or v, or anywhere in its logits:
    then q, k and v are asked). Under torch.compile a call without gradients applies the rule
    itself, except ahead of an overflow check (which needs the rule's NaN rows).
    """
    if finds_nonfinite and _finds_here(spec):
        out = run(spec)  # (spec.finite is None: not known yet)
        if out is not None:
            return out, None
    known = all_finite_now(spec.q, spec.k, spec.v)
    if known:
        return run(spec.replace(finite=True)), None
    q_ok = row_is_finite(spec.q)  # (B, H, Lq)
    kv_ok = row_is_finite(spec.k) & row_is_finite(spec.v)  # (B, Hkv, Lk)
    zero = torch.zeros((), dtype=spec.q.dtype, device=spec.q.device)
    clean = spec.replace(
        q=torch.where(q_ok[..., None], spec.q, zero),
        k=torch.where(kv_ok[..., None], spec.k, zero),
        v=torch.where(kv_ok[..., None], spec.v, zero),
        finite=True,
    )
    poison = poisoned_rows(spec, q_ok, kv_ok)[..., None]  # (B, H, Lq, 1)
    return run(clean).masked_fill(poison, float("nan")), poison


def _finds_here(spec: AttentionSpec) -> bool:
    """Whether a `finds_nonfinite` backend is asked to find NaN/inf itself in this call."""
    if spec.records_grad:  # (its own check: a forward in plain eager mode)
        return plain_eager(spec.q, spec.k, spec.v)
    if transforms_active():
        return False
    return not (spec.norm.overflows and compiling())
