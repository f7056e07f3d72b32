"""`urpe bench attention` on the CPU: the rows timed at every length and dtype (interleaved
medians), peak memory per call in subprocesses, and a profile of one row."""

from __future__ import annotations

import os
from datetime import datetime, timezone

import torch

from .inputs import make_inputs
from .machine import StolenTime, cpu_info, keep_freed_memory
from .measure import Method, measure_setting
from .memory import memory_curves
from .profiling import profile_row
from .rows import rows_for


def time_block(args, length: int, dtype: str, progress, fields: dict | None = None) -> list[dict]:
    """Every --rows row at one length and dtype; `fields` (a condition such as threads and
    load, set by the caller around the call) go into every record and its progress lines."""
    rows = [rows_for("cpu")[name] for name in args.rows]
    inputs = make_inputs(args.batch, args.heads, length, args.head_dim, getattr(torch, dtype))
    setting = dict(length=length, dtype=dtype, **(fields or {}))
    label = ", ".join(f"{key} {value}" for key, value in (fields or {}).items())
    where = f"  L={length} {dtype}" + (f" ({label})" if label else "") + ": "
    method = Method("cpu", args, args.warmup, args.repeats, lambda line: progress(where + line))
    return measure_setting(rows, inputs, setting, method)


def print_times(records: list[dict], prefix: str = "") -> None:
    for r in records:
        where = f"{prefix}{r['dtype']} L={r['length']} {r['name']:16s} {r['mode']:7s}"
        if "time_ms" in r:
            print(f"{where} {r['time_ms']:9.1f} ms  x{r.get('ratio_to_sdpa', float('nan')):.2f}")
        else:
            print(f"{where} skipped: {r['skipped']}")


def measure(args, progress, command: str) -> dict:
    """The results of one CPU run (what --json writes): times, memory, profile, machine."""
    if args.threads:
        torch.set_num_threads(args.threads)
    progress(f"allocator: {keep_freed_memory()}")
    shape = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim)
    results = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command,
        shape=shape,
        repeats=args.repeats,
        dtypes=args.dtypes,
        load_start=os.getloadavg(),
        times=[],
        memory=[],
    )
    with StolenTime() as stolen:  # (a VM's host taking CPU time moves every timing)
        for dtype in args.dtypes:
            for length in args.lengths:
                progress(f"timing L={length} {dtype}")
                block = time_block(args, length, dtype, progress)
                results["times"] += block
                print_times(block)
    results["stolen"] = stolen.fraction
    if stolen.fraction is not None:
        progress(f"the host took {100 * stolen.fraction:.1f}% of the CPU time while timing")
    if args.memory_lengths:
        progress("peak memory (one subprocess per point)")
        results["memory"] = memory_curves(args, progress)
    if args.profile:
        row = args.profile_row or (
            "cpp_urpe" if "cpp_urpe" in rows_for("cpu") else "blockwise_urpe"
        )
        progress(f"profile {row} at L={args.profile}")
        results["profile"] = dict(
            length=args.profile, row=row, ops=profile_row(row, shape, args.profile)
        )
    results["machine"] = cpu_info()
    return results
