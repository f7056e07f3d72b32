"""The rows of `urpe bench attention`: what is timed, each a no-argument call on shared inputs.

Every backend registered in `urpe.kernels.BACKENDS` for the device (but SDPA, which cannot take
the gate) gives two rows, so a kernel registered later is benchmarked with no edit here:

    <backend>_urpe   urpe.attention(backend=<backend>) with Toeplitz B and C (URPE)
    <backend>_rpe    the same without the gate (Toeplitz B only: what the gate costs)

Beside them stand the external baselines, which are not urpe's kernels:

    sdpa             F.scaled_dot_product_attention without a bias (CPU): every CPU ratio's base
    sdpa_flash       the same on the FlashAttention backend (CUDA): every GPU ratio's base
    sdpa_dense_bias  SDPA with the Toeplitz bias written out as a (B, H, L, L) tensor
    flex_rpe         compiled FlexAttention, Toeplitz bias as score_mod (it cannot express C;
                     forward only on the CPU, where PyTorch has no backward for it)

A baseline keeps its name where a derived row would take it (flex_rpe is FlexAttention's own
route, not urpe's "flex" backend without the gate). Packed sequences and the decay bias have
rows of their own beside their dense routes (`packing_rows`).

Importing this module imports no torch (what a row times is imported when it is built), so
that `urpe bench attention --help` answers at once: until `urpe.kernels` is loaded the flags
offer the rows of urpe's own backends (`BUILT_IN_BACKENDS`); a run checks what it is asked for
against the backends registered and available then (`rows_for`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from .row_kinds import BACKEND_LENGTH_LIMITS, Build, Inputs, Row

# Row names of earlier versions (results files, scripts) -> today's.
RENAMED = {
    "reference": "reference_urpe",
    "fused_urpe": "blockwise_urpe",
    "fused_rpe": "blockwise_rpe",
}
# The backends urpe registers for each device, in the registry's order, available or not: the
# rows offered before `urpe.kernels` is imported (tests/test_cli_startup.py checks the list).
BUILT_IN_BACKENDS = {
    "cpu": ("reference", "sdpa", "blockwise", "cpp"),
    "cuda": ("reference", "sdpa", "blockwise", "triton", "flex"),
}


def current_names(records: list[dict]) -> list[dict]:
    """Records (results of any version) with today's row names."""
    return [dict(r, name=RENAMED[r["name"]]) if r.get("name") in RENAMED else r for r in records]


def _sdpa(inputs: Inputs, causal: bool):
    import torch.nn.functional as F

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_flash(inputs: Inputs, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain = _sdpa(inputs, causal)

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return plain()

    return flash


def _sdpa_dense_bias(inputs: Inputs, causal: bool):
    import torch.nn.functional as F

    from .inputs import dense_bias

    if "dense_bias" not in inputs:  # kept in inputs, so that its gradient is reset per call
        inputs["dense_bias"] = dense_bias(inputs, causal)
    q, k, v, mask = inputs["q"], inputs["k"], inputs["v"], inputs["dense_bias"]
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


_compiled_flex: dict[str, Callable] = {}


def _flex_rpe(inputs: Inputs, causal: bool):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "flex" not in _compiled_flex:  # one compile per shape, shared by every length
        _compiled_flex["flex"] = torch.compile(flex_attention, dynamic=False)
    q, k, v, table = inputs["q"], inputs["k"], inputs["v"], inputs["table_b"]
    if q.device.type == "cpu":  # forward only there, and FlexAttention refuses leaves needing grad
        q, k, v, table = (t.detach() for t in (q, k, v, table))
    length = q.shape[-2]
    block_mask = None
    if causal:
        block_mask = create_block_mask(
            lambda b, h, i, j: j <= i, None, None, length, length, device=q.device
        )

    def score_mod(score, b, h, q_idx, kv_idx):
        # clamped: positions padded up to FlexAttention's block size would read out of range
        offset = (kv_idx - q_idx).clamp(-(length - 1), length - 1) + length - 1
        return score + table[h, offset].to(score.dtype)

    return lambda: _compiled_flex["flex"](q, k, v, score_mod=score_mod, block_mask=block_mask)


def backend_row(backend: str, gated: bool) -> Build:
    """urpe.attention(backend=...) with the Toeplitz bias B, and the gate C when `gated`."""

    def build(inputs: Inputs, causal: bool):
        from ..kernels import Toeplitz, attention

        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        bias = Toeplitz(inputs["table_b"])
        gate = Toeplitz(inputs["table_c"]) if gated else None
        return lambda: attention(q, k, v, bias=bias, gate=gate, is_causal=causal, backend=backend)

    return build


BASELINES = (
    Row(
        "sdpa",
        "F.scaled_dot_product_attention without a mask: the base of every CPU ratio",
        _sdpa,
        devices=("cpu",),
    ),
    Row(
        "sdpa_flash",
        "SDPA without a bias, FlashAttention backend: the base of every GPU ratio",
        _sdpa_flash,
        devices=("cuda",),
    ),
    Row(
        "sdpa_dense_bias",
        "SDPA with a dense (B, H, L, L) float bias that receives a gradient",
        _sdpa_dense_bias,
        length_limit="dense_max_length",
    ),
)
LAST_BASELINES = (
    Row(
        "flex_rpe",
        "compiled FlexAttention, Toeplitz bias as score_mod (forward only on CPU)",
        _flex_rpe,
        forward_only_on=("cpu",),
    ),
)


def backend_rows(device: str, backends: Sequence[str] | None = None) -> list[Row]:
    """A URPE row and an RPE row for every backend in `backends` (default: those registered
    for `device` and available here) but SDPA, but where a baseline has the name already."""
    if backends is None:
        from ..kernels import native_backends

        backends = native_backends(device)
    names = [name for name in backends if name != "sdpa"]
    kinds = (("urpe", True, "Toeplitz B and C (URPE)"), ("rpe", False, "Toeplitz B only (RPE)"))
    external = {row.name for row in (*BASELINES, *LAST_BASELINES)}
    rows = [
        Row(
            f"{name}_{kind}",
            f"urpe.attention(backend={name!r}), {terms}",
            backend_row(name, gated=gated),
            length_limit=BACKEND_LENGTH_LIMITS.get(name),
        )
        for kind, gated, terms in kinds
        for name in names
    ]
    return [row for row in rows if row.name not in external]


def rows_for(device: str) -> dict[str, Row]:
    """Every row that can be timed on `device`, in report order (name -> row)."""
    return rows_for_backends(device, None)


def rows_for_backends(device: str, backends: Sequence[str] | None) -> dict[str, Row]:
    """`rows_for` with the rows of these backends (None: the registered, available ones)."""
    from .packing_rows import packing_rows  # (imports torch when its rows are built)

    ordered = (
        *BASELINES,
        *backend_rows(device, backends),
        *LAST_BASELINES,
        *packing_rows(device, backends),
    )
    return {row.name: row for row in ordered if row.devices is None or device in row.devices}


def offered_rows(device: str) -> dict[str, Row]:
    """The rows the command line offers for `device`, without importing torch: `rows_for` once
    `urpe.kernels` is loaded (a script may have registered a backend), else those of
    `BUILT_IN_BACKENDS`."""
    loaded = "urpe.kernels" in sys.modules
    return rows_for_backends(device, None if loaded else BUILT_IN_BACKENDS[device])


# The RPE rows a run takes unless others are asked for: those of the kernels "auto" runs URPE on
# (the tiled ones), beside their URPE rows, so that a default run shows what the gate costs.
DEFAULT_RPE_ROWS = {"cpu": ("blockwise_rpe", "cpp_rpe"), "cuda": ("triton_rpe",)}


def default_rows(device: str) -> list[str]:
    """What runs when no rows are asked for: the baselines, every URPE row, and the RPE rows
    of `DEFAULT_RPE_ROWS`."""
    derived_rpe = {row.name for row in backend_rows(device) if row.name.endswith("_rpe")}
    wanted = DEFAULT_RPE_ROWS[device]
    return [name for name in rows_for(device) if name not in derived_rpe or name in wanted]


def skip_reason(row: Row, length: int, limits) -> str | None:
    """Why this row is not timed at this length (None: it is). `limits` holds the length caps
    (the parsed arguments); a missing cap or a cap of None is no cap."""
    cap = getattr(limits, row.length_limit, None) if row.length_limit else None
    if cap is not None and length > cap:
        return f"{row.name} skipped above L={cap}"
    return None


__all__ = ["Row", "backend_rows", "default_rows", "rows_for", "skip_reason"]
