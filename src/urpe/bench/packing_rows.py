"""Rows of `urpe bench attention` for packed sequences and the decay bias (issue 32), each beside
the dense route it replaces:

    packed_<backend>        urpe.attention(document_ids=ids) on a native backend: documents of
                            64 to 512 tokens packed into each row, no (L, L) mask built
    packed_sdpa_mask        SDPA with the same documents as a dense (B, 1, L, L) bool mask (the
                            route a user has without document_ids)
    decay_<backend>         urpe.attention(bias=urpe.Decay(log_forget)) (FoX's decay, read from
                            O(L) numbers), log_forget (B, H, L) receiving a gradient
    decay_sdpa_dense_bias   SDPA with that decay written out as a (B, H, L, L) bias leaf

The document lengths are drawn once per length (seeded), so every row of a setting sees the
same documents; causal settings fold causality into the dense mask and bias. Importing this
module imports no torch (a row's call imports what it times when it is built).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .row_kinds import BACKEND_LENGTH_LIMITS, Inputs, Row

if TYPE_CHECKING:
    import torch

DOCUMENT_LENGTHS = (64, 512)  # shortest and longest document, in tokens


def document_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(B, L) int64: each row cut into documents of 64 to 512 tokens (the last one shorter)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    low, high = DOCUMENT_LENGTHS
    rows = []
    for _ in range(batch):
        sizes = torch.randint(low, high + 1, (length // low + 1,), generator=gen)
        rows.append(torch.repeat_interleave(torch.arange(len(sizes)), sizes)[:length])
    return torch.stack(rows)


def _ids(inputs: Inputs) -> torch.Tensor:
    q = inputs["q"]
    if "document_ids" not in inputs:  # kept in inputs: one draw per setting, shared by rows
        inputs["document_ids"] = document_ids(q.shape[0], q.shape[-2]).to(q.device)
    return inputs["document_ids"]


def _log_forget(inputs: Inputs) -> torch.Tensor:
    """(B, H, L) leaf: log of forget gates mostly near 1 (FoX's init keeps them so)."""
    import torch
    import torch.nn.functional as F

    q = inputs["q"]
    if "log_forget" not in inputs:
        gen = torch.Generator(device=q.device).manual_seed(1)
        raw = torch.randn(q.shape[:3], generator=gen, device=q.device) + 3.0
        inputs["log_forget"] = F.logsigmoid(raw).requires_grad_()
    return inputs["log_forget"]


def _packed(backend: str):
    def build(inputs: Inputs, causal: bool):
        from ..kernels import attention

        q, k, v, ids = inputs["q"], inputs["k"], inputs["v"], _ids(inputs)
        return lambda: attention(q, k, v, document_ids=ids, is_causal=causal, backend=backend)

    return build


def _packed_sdpa_mask(inputs: Inputs, causal: bool):
    import torch.nn.functional as F

    from ..kernels.masks import keep_mask

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    length = q.shape[-2]
    mask = keep_mask(None, None, causal, length, length, q.device, _ids(inputs))  # (B, 1, L, L)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _decay(backend: str):
    def build(inputs: Inputs, causal: bool):
        from ..kernels import Decay, attention

        q, k, v, log_forget = inputs["q"], inputs["k"], inputs["v"], _log_forget(inputs)
        return lambda: attention(q, k, v, bias=Decay(log_forget), is_causal=causal, backend=backend)

    return build


def _decay_dense_bias(inputs: Inputs, causal: bool):
    import torch
    import torch.nn.functional as F

    from ..kernels import Decay
    from ..kernels.masks import keep_mask

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    length = q.shape[-2]
    if "decay_dense" not in inputs:  # a leaf of its own, as SDPA's users would hold it
        with torch.no_grad():
            dense = Decay(_log_forget(inputs)).dense(length, length).to(q.dtype)  # (B, H, L, L)
            if causal:
                dense = dense.masked_fill(~keep_mask(None, None, True, length, length), -torch.inf)
        inputs["decay_dense"] = dense.contiguous().requires_grad_()
    bias = inputs["decay_dense"]
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def packing_rows(device: str, backends: Sequence[str] | None = None) -> list[Row]:
    """The rows above for these backends (None: every backend registered for `device`) but
    SDPA (whose rows are the dense baselines)."""
    if backends is None:
        from ..kernels import native_backends

        backends = native_backends(device)
    names = [name for name in backends if name != "sdpa"]
    rows = []
    for kind, build, what in (
        ("packed", _packed, "document_ids, documents of 64-512 tokens"),
        ("decay", _decay, "bias=urpe.Decay(log_forget)"),
    ):
        rows += [
            Row(
                f"{kind}_{name}",
                f"urpe.attention(backend={name!r}), {what}",
                build(name),
                length_limit=BACKEND_LENGTH_LIMITS.get(name),
            )
            for name in names
        ]
        dense = _packed_sdpa_mask if kind == "packed" else _decay_dense_bias
        dense_name = "packed_sdpa_mask" if kind == "packed" else "decay_sdpa_dense_bias"
        dense_help = (
            "SDPA, the documents as a dense (B, 1, L, L) bool mask"
            if kind == "packed"
            else "SDPA, the decay as a dense (B, H, L, L) bias leaf"
        )
        rows.append(Row(dense_name, dense_help, dense, length_limit="dense_max_length"))
    return rows
