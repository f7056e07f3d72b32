"""`urpe bench attention --device cuda`: the rows on one CUDA device over a grid of lengths,
head dims and causal settings (within a time budget), the forward outputs checked against the
reference.

TFLOP/s count the two matrix products of attention, 4 B H Lq Lk D per forward (half of it when
causal), and 2.5 times that for the backward (FlashAttention's convention).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

import torch

from ..cli_types import UsageError
from .inputs import make_inputs
from .machine import gpu_info
from .measure import Method, measure_setting
from .rows import Row, rows_for


def attention_flops(batch, heads, lq, lk, head_dim, causal: bool, mode: str) -> float:
    """Matrix-product FLOPs: 4 B H Lq Lk D forward, halved when causal; forward+backward is
    3.5 times the forward."""
    flops = 4.0 * batch * heads * lq * lk * head_dim / (2 if causal else 1)
    return flops * (3.5 if mode == "fwdbwd" else 1.0)


def check_outputs(rows: list[Row], inputs, causal: bool, records: list[dict]) -> None:
    """Set `error_vs_reference` (relative, forward) on the timed URPE rows' records, where the
    reference was timed at this setting."""
    timed = {r["name"]: r for r in records if r["mode"] == "fwd" and "time_ms" in r}
    if "reference_urpe" not in timed:
        return
    with torch.no_grad():
        by_name = {row.name: row for row in rows}
        want = by_name["reference_urpe"].build(inputs, causal)().float()
        for name, record in timed.items():
            if name.endswith("_urpe") and name != "reference_urpe":
                got = by_name[name].build(inputs, causal)().float()
                record["error_vs_reference"] = float((got - want).norm() / want.norm())


def time_setting(args, rows, length, head_dim, causal, dtype, progress) -> list[dict]:
    inputs = make_inputs(args.batch, args.heads, length, head_dim, getattr(torch, dtype), "cuda")
    shape = dict(batch=args.batch, heads=args.heads)
    setting = dict(length=length, head_dim=head_dim, causal=causal, dtype=dtype, **shape)
    records = measure_setting(rows, inputs, setting, Method("cuda", args, progress=progress))
    for r in records:
        if "time_ms" in r:
            flops = attention_flops(
                args.batch, args.heads, length, length, head_dim, causal, r["mode"]
            )
            r["tflops"] = flops / (r["time_ms"] * 1e-3) / 1e12
        progress(_progress_line(r))
    check_outputs(rows, inputs, causal, records)
    del inputs
    torch.cuda.empty_cache()
    return records


def _progress_line(r: dict) -> str:
    where = f"L={r['length']} D={r['head_dim']} causal={r['causal']} {r['name']} {r['mode']}"
    if "time_ms" in r:
        return f"  {where}: {r['time_ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s, {r['peak_mb']:.0f} MB"
    return f"  {where}: skipped ({r['skipped']})"


def measure(args, progress, command: str) -> dict:
    """The results of one CUDA run (what --json writes)."""
    rows = [rows_for("cuda")[name] for name in args.gpu_rows]  # built before the check: names
    if not torch.cuda.is_available():
        raise UsageError("--device", "cuda: no CUDA device is visible (torch sees none)")
    started = time.monotonic()
    # FlexAttention compiles per shape and variant: room for the whole grid, so that no row
    # silently falls back to eager (materialising) execution after the default 8 recompiles
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 64))
    results = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command,
        device=gpu_info(),
        times=[],
    )
    causal_settings = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    grid = [
        (dtype, head_dim, causal, length)
        for dtype in args.dtypes
        for head_dim in args.head_dims
        for causal in causal_settings
        for length in args.lengths
    ]
    for dtype, head_dim, causal, length in grid:
        setting = dict(length=length, head_dim=head_dim, causal=causal, dtype=dtype)
        if time.monotonic() - started > args.time_budget:
            progress(f"time budget spent: {setting} not measured")
            results["times"].append(dict(name="*", mode="*", **setting, skipped="time budget"))
            continue
        progress(f"timing {setting}")
        results["times"] += time_setting(args, rows, length, head_dim, causal, dtype, progress)
    return results
