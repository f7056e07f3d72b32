"""`urpe bench attention` on the CPU: times (idle, and under contention when asked), peak
memory, a profile, end-to-end steps, targets; JSON, BENCHMARKS.md and the memory plot."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import torch

from .contention import Condition, conditions
from .end_to_end import end_to_end
from .gpu_section import print_targets
from .inputs import make_inputs
from .machine import cpu_info
from .measure import Method, measure_setting
from .memory import memory_curves
from .plots import plot_memory
from .profiling import profile_row
from .report import markdown
from .rows import rows_for
from .sections import keep_sections
from .targets import cpu_targets


def time_block(args, length: int, dtype: str, progress, condition: Condition | None = None):
    """Every --rows row at one length and dtype (under `condition` when given)."""
    rows = [rows_for("cpu")[name] for name in args.rows]
    inputs = make_inputs(args.batch, args.heads, length, args.head_dim, getattr(torch, dtype))
    setting = dict(length=length, dtype=dtype, **(condition.fields if condition else {}))
    where = f"  L={length} {dtype}" + (f" ({condition.label})" if condition else "") + ": "
    method = Method("cpu", args, args.warmup, args.repeats, lambda line: progress(where + line))
    return measure_setting(rows, inputs, setting, method)


def contention_blocks(args, progress) -> list[dict]:
    """The rows at --contention-lengths under every thread count, idle and with one core
    busy; the conditions of one setting follow each other, so drift in the machine's load
    hits them alike, and the busy process lives for one block at a time."""
    records = []
    for dtype in args.dtypes:
        for length in args.contention_lengths:
            for condition in conditions(args.contention_threads):
                progress(f"timing L={length} {dtype}, {condition.label}")
                with condition.applied():
                    block = time_block(args, length, dtype, progress, condition)
                records += block
                print_times(block, f"{condition.label}: ")
    return records


def print_times(records: list[dict], prefix: str = "") -> None:
    for r in records:
        where = f"{prefix}{r['dtype']} L={r['length']} {r['name']:16s} {r['mode']:7s}"
        if "time_ms" in r:
            print(f"{where} {r['time_ms']:9.1f} ms  x{r.get('ratio_to_sdpa', float('nan')):.2f}")
        else:
            print(f"{where} skipped: {r['skipped']}")


def run(args, progress, command: str) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
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
        end_to_end=[],
    )
    for dtype in args.dtypes:
        for length in args.lengths:
            progress(f"timing L={length} {dtype}")
            block = time_block(args, length, dtype, progress)
            results["times"] += block
            print_times(block)
    if args.contention:
        results["contention"] = contention_blocks(args, progress)
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
    if args.end_to_end:
        progress("end to end")
        results["end_to_end"] = end_to_end("cpu", args.repeats, args.warmup, progress)
    results["machine"] = cpu_info()
    results["targets"] = cpu_targets(
        results["times"], results["memory"], results["end_to_end"], results.get("contention", [])
    )
    if args.plot and any("peak_mb" in r for r in results["memory"]):
        plot_memory(results["memory"], args.plot, shape)
        if args.markdown:
            results["plot"] = os.path.relpath(args.plot, args.markdown.parent)
    print_targets(results["targets"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:  # the GPU and model sections already in the file are carried over
        args.markdown.write_text(keep_sections(args.markdown, markdown(results)))
    return 0
