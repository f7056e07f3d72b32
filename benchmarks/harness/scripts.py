"""What every script of benchmarks/ shares: a bad argument is one line naming it (exit status
2), as `urpe`'s own commands do, never a usage block or a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from urpe.cli import OneLineParser
from urpe.cli_types import UsageError


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A script's parser: defaults shown in --help, errors on one line."""
    return OneLineParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


def main(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """Parse `argv` (default: the command line) and run; the exit status."""
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as error:
        print(f"{parser.prog}: error: {error} (see {parser.prog} --help)", file=sys.stderr)
        return 2
