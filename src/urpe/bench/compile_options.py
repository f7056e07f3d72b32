"""The command line of `urpe bench compile`: its flags, declared without importing torch (or
Triton) so that `--help` answers at once; the compiling (`compile`) is imported when it runs."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

DTYPES = ("float16", "bfloat16", "float32", "float64")
STRENGTH = 2  # every pair of features' values is compiled together (see `covering`)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch",
        default="80,90",
        help="compute capabilities to compile for, comma-separated (default 80,90)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a representative subset (about 25 compilations) instead of all",
    )
    parser.add_argument(
        "--strength",
        type=int,
        default=STRENGTH,
        help=f"compile every combination of this many features' values (default {STRENGTH}: "
        "every pair; 3 compiles about four times as many programs)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument(
        "--dtypes", default=",".join(DTYPES), help="dtypes of the full matrix, comma-separated"
    )


def run(args: argparse.Namespace) -> int:
    # Imported by name, as a reproduction's Experiment is: `compile` imports this module.
    return importlib.import_module("urpe.bench.compile").run(args)
