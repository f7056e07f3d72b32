"""`urpe.attention`: one functional entry point, several interchangeable kernels (backends).

A call is checked and its backend chosen once per kind of call (`prepared`), then runs on the
chosen backend (`backends`; adding one: see there). Position terms are `Term`s (`terms`; adding
a kind: see there).
"""

from __future__ import annotations

from torch import Tensor

from .prepared import CAPACITY, AttentionCalls
from .spec import Arguments
from .terms import PositionTerm

# urpe.attention's own prepared calls, by kind (the library's owners of repeated calls hold
# theirs: see `prepared`)
CALLS = AttentionCalls(CAPACITY)
# `Arguments` from a tuple of all its fields: a NamedTuple's own __new__ is a Python function
# (about 0.5 us of a decoding step's call)
_arguments = tuple.__new__


def attention(
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
    backend: str = "auto",
) -> Tensor:
    """URPE attention: out = dropout(normalize(scale * q k^T + B + M) * C) @ v.

    The first eight arguments are `F.scaled_dot_product_attention`'s, with its meaning (except
    the causal alignment when Lq != Lk, below); the rest are urpe's.

    Args:
        q: queries (..., H, Lq, D), any number of leading (batch) dims.
        k: keys (..., Hkv, Lk, D), the same leading dims as q.
        v: values (..., Hkv, Lk, Dv), the same leading dims as q.
        attn_mask: broadcastable to (..., H, Lq, Lk). Bool: True takes part, False hides the pair.
            Float: added to the logits (M), like a bias (a -inf gives weight 0 but does not hide
            the key's contents; see below).
        dropout_p: dropout on the weights (after the gate), in [0, 1]; 1 drops every weight
            (zeros, as SDPA gives). Pass 0 at evaluation.
        is_causal: query i sees keys j <= i + Lk - Lq: the LAST query is aligned with the LAST
            key, as decoding with a KV cache needs. SDPA aligns the first with the first
            (j <= i); the two agree when Lq == Lk. For SDPA's rule with Lq != Lk pass
            attn_mask=torch.ones(Lq, Lk, dtype=torch.bool).tril() instead.
        scale: logit scale, default 1 / sqrt(D).
        enable_gqa: allow k, v with fewer heads than q (grouped-query attention): Hkv must
            divide H and query head h reads key/value head h // (H / Hkv). Bias and gate are per
            query head.
        bias: B, added to the logits before normalisation. A tensor broadcastable to
            (..., H, Lq, Lk), a `Toeplitz` table over offsets j - i, or a `Relation` (a table
            indexed by an integer (..., Lq, Lk) relation; indices out of range raise ValueError).
            Or a `urpe.Decay(log_forget)`: FoX's data-dependent decay -|c_pos(i) - c_j| with
            c = cumsum(log_forget) over the keys, computed from O(L) numbers (bias only). Or any
            other `urpe.kernels.Term`.
        gate: C, multiplied into the weights after normalisation (URPE). Same forms as bias
            (but not `Decay`).
        key_padding_mask: bool, broadcastable to (..., Lk); True marks a padded key (as in
            nn.MultiheadAttention: the opposite sense of a bool attn_mask).
        normalization: "softmax", "exp" (no denominator), "l2" (exp / l2 norm of the row),
            "relu2" (relu(s)^2 / n, n the number of keys the query sees), or any name
            registered in `urpe.kernels.NORMALIZATIONS`.
        dropout_seed: int or int64 scalar tensor fixing the dropout masks (every backend but
            SDPA, which draws its own). Default: drawn from torch's generator.
        document_ids: integer, broadcastable to (..., Lk): packed sequences. Query i belongs
            to the document of key i + Lk - Lq (the `is_causal` alignment, so a KV cache works)
            and sees only keys of its own document; combines with every other argument. The
            same as the dense bool mask ids[pos(i)] == ids[j], without building it on the
            native kernels (which skip tiles where no query and key share a document).
        backend: "auto" (fastest that applies), or a name from `urpe.kernels.BACKENDS`.

    Returns:
        (..., H, Lq, Dv) in q's dtype (half precision is computed in float32). Under
        `torch.autocast`, as SDPA: q, k, v and a float attn_mask are cast to the autocast dtype
        (float64 stays), and so is the result.

    Hidden pairs (key_padding_mask, is_causal, document_ids, bool attn_mask) get weight exactly
    0 under every normalisation, and a query with no visible key returns 0 with zero gradients;
    so does a query whose logits are all -inf. A query, key or value row holding NaN/inf is
    treated as zeros and makes exactly the output rows that see it NaN (a non-finite key or
    value that a query cannot see never reaches it); those rows pass no gradient. `exp` raises
    ValueError instead of overflowing. Every backend behaves the same way on all of this.

    Cost around the kernel: the checks and the backend choice are made once per kind of call
    (shapes except the number of keys, dtypes, devices, term kinds, scalar arguments) and
    remembered (`urpe.kernels.prepare` gives a caller its own prepared call). On a GPU no
    value is read on the host, forward or backward, so the call never waits for the device and
    a CUDA graph can capture it; the one exception is `normalization="exp"`, whose overflow
    check must read the result (see `urpe.kernels.host`).
    """
    return CALLS.call(
        _arguments(
            Arguments,
            (
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
                document_ids,
                backend,
            ),
        )
    )


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
    """`attention(..., backend="reference")`: the plain materialising specification."""
    return attention(q, k, v, *args, **kwargs, backend="reference")
