"""The command line of `urpe bench model`: its flags, declared without importing torch so that
`--help` answers at once; the measurement (`model`) is imported when the command runs."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from ..cli_types import non_negative_int, positive_int

CONDITIONS = ("idle", "busy")
# The groups of `model_groups`, in run and report order (tests/test_cli_startup.py checks them).
GROUP_NAMES = (
    "calls",
    "short",
    "bf16",
    "decoder",
    "hf_generate",
    "hf_compiled",
    "hf_train",
    "end_to_end",
    "lm_speed",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--quick",
        action="store_true",
        help="tiny sizes and few repeats: a smoke run of every group in seconds (plus the "
        "compile of hf_compiled; see --compile-backend); its numbers mean nothing",
    )
    add(
        "--groups",
        nargs="+",
        choices=GROUP_NAMES,
        default=list(GROUP_NAMES),
        metavar="GROUP",
        help=f"what to measure (default: all): {', '.join(GROUP_NAMES)}",
    )
    add(
        "--conditions",
        nargs="+",
        choices=CONDITIONS,
        default=list(CONDITIONS),
        help="idle, and/or with a child process spinning on one core (default: both)",
    )
    add(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed repeats per row, median (default: 9, with --quick 2)",
    )
    add(
        "--threads",
        type=non_negative_int,
        default=0,
        help="torch threads (default 0: torch's default)",
    )
    add(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of hf_compiled (default inductor: what transformers "
        "uses; 'eager' traces without generating code, for a fast smoke run)",
    )
    add("--json", type=Path, help="write every record, the sizes and the targets here")
    add(
        "--markdown",
        type=Path,
        help="write the model section into this file (BENCHMARKS.md), "
        "between its markers; the rest of the file stays",
    )


def run(args: argparse.Namespace) -> int:
    # Imported by name, as a reproduction's Experiment is: `model` imports this module.
    return importlib.import_module("urpe.bench.model").run(args)
