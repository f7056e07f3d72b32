"""Argument types and the usage error shared by the `urpe` subcommands.

Each type turns bad input into one argparse error line naming the value; checks that need
several arguments raise `UsageError(argument, message)`, which `urpe.cli.main` prints as one
line (exit status 2, no traceback).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path


class UsageError(Exception):
    """A bad command-line value found after parsing; `argument` is the flag to name."""

    def __init__(self, argument: str, message: str):
        self.argument, self.message = argument, message
        super().__init__(f"argument {argument}: {message}")


def _integer(text: str, least: int, expected: str, must: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {must}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer", "a positive integer")


def non_negative_int(text: str) -> int:
    return _integer(text, 0, "an integer >= 0", ">= 0")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _unique(values: tuple, text: str) -> tuple:
    repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
    if repeated:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(str, repeated))} given more than once in {text!r}"
        )
    return values


def _number_list(text: str, number: type, one: str, expected: str) -> tuple:
    """Comma-separated distinct numbers of type `number`; `one` and `expected` name them."""
    try:
        values = tuple(number(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {expected}, comma-separated: {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one {one}")
    return _unique(values, text)


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated distinct integers: "10,1000" -> (10, 1000)."""
    return _number_list(text, int, "integer", "integers")


def fraction_list(text: str) -> tuple[float, ...]:
    """Comma-separated distinct numbers in [0, 1]: "0,0.5,1" -> (0.0, 0.5, 1.0)."""
    values = _number_list(text, float, "number", "numbers in [0, 1]")
    bad = [v for v in values if not 0.0 <= v <= 1.0]  # NaN too
    if bad:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {bad[0]}")
    return values


def positive_int_list(text: str) -> tuple[int, ...]:
    values = int_list(text)
    bad = [v for v in values if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"must be positive integers, got {bad[0]}")
    return values


def seed_list(text: str) -> tuple[int, ...]:
    """Comma-separated distinct seeds in [0, 2**32) (what every RNG in the stack accepts)."""
    values = int_list(text)
    bad = [v for v in values if not 0 <= v < 2**32]
    if bad:
        raise argparse.ArgumentTypeError(f"seeds must lie in [0, 2^32), got {bad[0]}")
    return values


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated distinct names (checked against a registry by the command)."""
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise argparse.ArgumentTypeError("expected at least one name")
    return _unique(values, text)


def describe(parser: argparse.ArgumentParser, docstring: str) -> None:
    """`--help` shows the command module's docstring after its first paragraph, as written."""
    parser.description = docstring.split("\n\n", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def check_writable_directory(path: Path, argument: str = "--out") -> None:
    """Raise UsageError unless `path` is, or can be created as, a writable directory. Creates
    nothing that stays: writability is tested with a temporary directory, removed at once."""
    path = Path(path)
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise UsageError(argument, f"{path}: {existing} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".urpe-write-test-", dir=existing))
    except OSError as error:
        raise UsageError(
            argument, f"{path}: cannot write in {existing} ({error.strerror or error})"
        ) from None


def output_file(text: str | Path, default_name: str, argument: str = "--output") -> Path:
    """Where a command writes its output: the path `text`, or `text/default_name` when it is an
    existing folder or ends with "/" (as `cp FILE FOLDER/` does). Checked before any work:
    UsageError when the file cannot be written there. Creates nothing; the writer makes the
    missing folders."""
    path = Path(text).expanduser()
    if str(text).endswith(("/", os.sep)) or path.is_dir():
        path = path / default_name
        if path.is_dir():
            raise UsageError(argument, f"{path} is a folder; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(argument, f"{path}: cannot write to this file (permission denied)")
    check_writable_directory(path.parent, argument)
    return path


def existing_file(text: str) -> Path | None:
    """`text` as the path of an existing file, else None: a SMILES or a name, including text
    too long to be a file name (a peptide's SMILES), which `stat` refuses with an OSError."""
    try:
        path = Path(text).expanduser()
        return path if path.is_file() else None
    except (OSError, ValueError):  # ENAMETOOLONG; a NUL byte
        return None
