"""BENCHMARKS.md's attention report (`make bench`, benchmarks/bench_attention.py): a run of
`urpe bench attention` (urpe.bench), plus what only the project's report needs: the rows under
contention (threads, a busy core), end-to-end training steps, the targets judged, the Markdown
report and the memory plot; and the GPU section from saved `--device cuda` results."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from urpe.bench import cpu, cuda
from urpe.bench.options import add_arguments as add_measure_arguments
from urpe.bench.options import fill_defaults
from urpe.cli_types import positive_int

from . import gpu_section
from .contention import conditions
from .end_to_end import end_to_end
from .plots import plot_memory
from .report import markdown
from .sections import keep_sections
from .targets import cpu_targets, gpu_targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`urpe bench attention`'s flags and the report's own."""
    add_measure_arguments(parser)
    add = parser.add_argument
    add(
        "--contention",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CPU: also time the rows at --contention-lengths under each --contention-threads "
        "count, idle and with a child process spinning on one core (started before each "
        "block of measurements, stopped after); reported beside the idle ratios",
    )
    for flag, default, what in (
        ("--contention-threads", [1, 2], "torch thread counts for --contention"),
        ("--contention-lengths", [2048], "sequence lengths for --contention (each dtype)"),
    ):
        add(flag, type=positive_int, nargs="+", default=default, help=what)
    add(
        "--end-to-end",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time one training step of small encoders: URPE, RPE, no positions on SDPA "
        "and x-transformers' T5 bias (if installed); on CUDA the paper-sized model",
    )
    add(
        "--train-steps",
        type=positive_int,
        default=10,
        help="--device cuda: timed training steps of the paper-sized model (median)",
    )
    add(
        "--gpu-report",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="write the GPU section of --markdown from these results of --device cuda runs "
        "(merged; no GPU needed), print the targets, and stop",
    )
    add("--markdown", type=Path, help="write the report here (BENCHMARKS.md)")
    add("--plot", type=Path, help="write the memory curves here (PNG)")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def command_line() -> str:
    return " ".join(["python benchmarks/bench_attention.py", *sys.argv[1:]])


def contention_blocks(args, say) -> list[dict]:
    """The rows at --contention-lengths under every thread count, idle and with one core
    busy; the conditions of one setting follow each other, so drift in the machine's load
    hits them alike, and the busy process lives for one block at a time."""
    records = []
    for dtype in args.dtypes:
        for length in args.contention_lengths:
            for condition in conditions(args.contention_threads):
                say(f"timing L={length} {dtype}, {condition.label}")
                with condition.applied():
                    block = cpu.time_block(args, length, dtype, say, condition.fields)
                records += block
                cpu.print_times(block, f"{condition.label}: ")
    return records


def cpu_report(args) -> dict:
    results = cpu.measure(args, progress, command_line())
    if args.contention:
        results["contention"] = contention_blocks(args, progress)
    results["end_to_end"] = []
    if args.end_to_end:
        progress("end to end")
        results["end_to_end"] = end_to_end("cpu", args.repeats, args.warmup, progress)
    results["targets"] = cpu_targets(
        results["times"], results["memory"], results["end_to_end"], results.get("contention", [])
    )
    if args.plot and any("peak_mb" in r for r in results["memory"]):
        plot_memory(results["memory"], args.plot, results["shape"])
        if args.markdown:
            results["plot"] = os.path.relpath(args.plot, args.markdown.parent)
    if args.markdown:  # the GPU and model sections already in the file are carried over
        args.markdown.write_text(keep_sections(args.markdown, markdown(results)))
    return results


def cuda_report(args) -> dict:
    results = cuda.measure(args, progress, command_line())
    results["training"] = []
    if args.end_to_end:
        progress("training step, paper-sized model")
        results["training"] = end_to_end("cuda", args.train_steps, 3, progress)
    results["targets"] = gpu_targets(results["times"])
    if args.markdown:
        gpu_section.write_section(args.markdown, gpu_section.section_markdown([results]))
    return results


def run(args: argparse.Namespace) -> int:
    if args.gpu_report:
        return gpu_section.report(args.gpu_report, args.markdown)
    fill_defaults(args)
    results = cuda_report(args) if args.device == "cuda" else cpu_report(args)
    gpu_section.print_targets(results["targets"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0
