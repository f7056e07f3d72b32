"""What every script of benchmarks/ shares: a bad argument is one line naming it (exit status
2), as `urpe`'s own commands do, never a usage block or a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from urpe.cli import OneLineParser
from urpe.cli_types import UsageError


class _StatedDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already states it or it is a switch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A script's parser: defaults shown in --help, errors on one line."""
    return OneLineParser(prog=prog, description=description, formatter_class=_StatedDefaults)


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
