"""What one reproduction is: an `Experiment`, which the one `urpe reproduce NAME` command
(`command.py`) drives on the shared runner.

    EXPERIMENT = Experiment(
        name="synthetic", presets=PRESETS, variants=VARIANTS_OPTION, options=OPTIONS,
        plan=plan, run_one=run_one, describe=describe, report=report,
        sweep=("tasks", "variants", "vocab_sizes", "seeds"),
    )

- `presets`: named `Preset`s, frozen dataclasses of everything a sweep needs. Every `Option`
  sets one preset field; a flag left out keeps the preset's value, so `--help` shows the
  presets' values instead of a misleading default.
- `plan(settings, precision, progress) -> [RunSpec]`: one spec per run, each with its full
  resolved config (its identity); it may build the data caches once, before any run starts.
- `run_one(config, context) -> RunResult`: a module-level function (spawned workers import it).
- `report(records, out, seconds) -> (markdown, figure paths)`: writes results.json, results.md
  and the figures from every record of this experiment in OUT.

A new reproduction is a presets module (settings and their flags, from `settings.py`), `run_one`
with its configs, and a report; the command, the runner, the checks of shared flags and resume
come with it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .execution import RunOne
from .records import RunSpec
from .settings import Names, Option, Preset, variants_option

__all__ = ["Experiment", "Names", "Option", "Preset", "variants_option"]  # the settings' parts too


@dataclass(frozen=True)
class Experiment:
    name: str  # `urpe reproduce NAME`, and the "experiment" of its records' configs
    presets: Mapping[str, Preset]
    variants: Option
    options: tuple[Option, ...]
    plan: Callable[[Any, str, bool], list[RunSpec]]
    run_one: RunOne
    describe: Callable[[dict], str]  # the line printed when a run finishes
    report: Callable[[list[dict], Path, float], tuple[str, list[Path]]]
    sweep: tuple[str, ...]  # preset fields whose lengths multiply to the number of runs
    check: Callable[[Any], None] = lambda settings: None  # raises UsageError
    description: str | None = None  # the --help text, when longer than the command's help
    preset_help: str = "base settings; any flag given below overrides them"

    @property
    def out(self) -> str:
        return f"runs/{self.name}"

    def runs(self, settings: Any) -> int:
        count = 1
        for name in self.sweep:
            count *= len(getattr(settings, name) or (None,))  # an unset field: one value
        return count

    # `urpe.cli` calls these two (see command.py).
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from .command import add_arguments

        add_arguments(self, parser)

    def run(self, args: argparse.Namespace) -> int:
        from .command import run

        return run(self, args)
