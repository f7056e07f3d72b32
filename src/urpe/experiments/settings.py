"""The parts an experiment's settings are made of: a `Preset` (a frozen dataclass of everything a
sweep needs), the `Option`s (flags) that set its fields, and the `Names` a comma-separated flag
accepts. The command (`command.py`), the shared flags (`options.py`) and every experiment's
presets module build on these; none of them needs the `Experiment` itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from ..cli_types import UsageError, name_list


@dataclass(frozen=True)
class Preset:
    """Base of an experiment's settings (subclasses are frozen dataclasses)."""

    def override(self, **changes: Any) -> Preset:
        """These settings with every change that is not None applied."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown preset fields {sorted(unknown)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class Names:
    """The names a comma-separated option accepts: `known` (listed in errors; all of them for
    'all' when `allow_all`), or, with `parse`, a grammar that raises ValueError naming the
    choices (the LM's BASE[+urpe][+mem])."""

    kind: str
    known: Iterable[str]
    parse: Callable[[str], Any] | None = None
    allow_all: bool = False

    def check(self, values: tuple[str, ...], flag: str) -> tuple[str, ...]:
        known = tuple(self.known)
        if self.allow_all and values == ("all",):
            return known
        if self.parse is not None:
            for value in values:
                try:
                    self.parse(value)
                except ValueError as error:
                    raise UsageError(flag, str(error)) from None
            return values
        unknown = [v for v in values if v not in known]
        if unknown:
            also = " or 'all'" if self.allow_all else ""
            raise UsageError(
                flag,
                f"unknown {self.kind} {', '.join(unknown)}; choose from {', '.join(known)}{also}",
            )
        return values


@dataclass(frozen=True)
class Option:
    """A flag that sets the preset field `field`. In `help`, "{presets}" becomes the presets'
    values of that field. `choices` may be a function, read when the parser is built, so that
    names registered before then are accepted. `default` other than SUPPRESS: a value the flag
    always has (then it is the same for every preset). `action="store_true"`: a switch, True
    when given (the preset's value otherwise)."""

    flags: tuple[str, ...]
    field: str
    help: str
    type: Callable[[str], Any] | None = None
    names: Names | None = None
    choices: Callable[[], Iterable[str]] | Sequence[str] | None = None
    default: Any = argparse.SUPPRESS
    metavar: str | None = None
    action: str | None = None

    def with_help(self, help: str) -> Option:
        return replace(self, help=help)


def variants_option(names: Names, help: str | None = None) -> Option:
    """The `--variants` flag: comma-separated names that `names` checks; its help lists them
    unless `help` says otherwise."""
    if help is None:
        every = ", or 'all'" if names.allow_all else ""
        help = f"comma-separated, from {', '.join(names.known)}{every} ({{presets}})"
    return Option(("--variants",), "variants", help, name_list, names=names)
