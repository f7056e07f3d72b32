"""`urpe bench attention`: time and peak memory of the attention kernels against PyTorch SDPA,
at the shapes a user asks for.

The rows (`rows`) are every registered backend with and without URPE's gate plus the external
baselines (SDPA, SDPA with a dense bias, FlexAttention); one pipeline (`measure`) times them on
the CPU (`cpu`: interleaved wall-clock medians) or on CUDA (`cuda`: `triton.testing.do_bench`).
Each record is printed as it is measured; --json keeps them all.

The flags (`options`) are declared without torch, so that `--help` answers at once; the
measuring modules are imported when the command runs. The repository's benchmarks/ builds
BENCHMARKS.md (targets, contention, end-to-end steps, the report) on the same functions.
"""

from __future__ import annotations

import argparse
import json
import sys

from .options import add_arguments, fill_defaults


def command_line() -> str:
    """The command as typed, for the results (`urpe bench attention ...`)."""
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "attention"]:
        argv = argv[2:]
    return " ".join(["urpe bench attention", *argv])


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, command: str) -> dict:
    """One run's results on --device (defaults filled in, the rows checked first)."""
    from . import cpu, cuda

    fill_defaults(args)
    device = cuda if args.device == "cuda" else cpu
    return device.measure(args, progress, command)


def run(args: argparse.Namespace) -> int:
    results = measure(args, command_line())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


__all__ = ["add_arguments", "measure", "run"]
