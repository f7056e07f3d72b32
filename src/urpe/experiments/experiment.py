"""What one reproduction is: an `Experiment`, which the one `urpe reproduce NAME` command
(`command.py`) drives on the shared runner. Its command line is declared apart, in the
experiment's presets module, which imports no torch, so that `--help` starts at once:

    # presets.py: name, presets, the --variants flag, the other flags, what runs it
    IMPLEMENTATION = "urpe.experiments.synthetic.experiment:EXPERIMENT"
    COMMAND = CommandLine("synthetic", PRESETS, VARIANTS_OPTION, OPTIONS, IMPLEMENTATION)
    # experiment.py: the command line, plan, run_one, describe, report; what the runs sweep
    SWEEP = ("tasks", "variants", "vocab_sizes", "seeds")
    EXPERIMENT = Experiment.of(COMMAND, plan, run_one, describe, report, sweep=SWEEP)

- `presets`: named `Preset`s, frozen dataclasses of everything a sweep needs. Every `Option`
  sets one preset field; a flag left out keeps the preset's value, so `--help` shows the
  presets' values instead of a misleading default.
- `plan(settings, precision, progress) -> [RunSpec]`: one spec per run, each with its full
  resolved config (its identity); it may build the data caches once, before any run starts.
- `run_one(config, context) -> RunResult`: a module-level function (spawned workers import it).
- `report(records, out, seconds) -> (markdown, figure paths)`: writes results.json, results.md
  and the figures from every record of this experiment in OUT.

A new reproduction is a presets module (settings and their flags, from `settings.py`, and its
`CommandLine`), `run_one` with its configs, and a report; the command, the runner, the checks of
shared flags and resume come with it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..extras import require
from ..progress import on_terminal
from .execution import RunOne
from .options import TRAIN_MODULES
from .records import RunSpec
from .settings import Names, Option, Preset, variants_option

# the settings' parts too
__all__ = ["CommandLine", "Experiment", "Names", "Option", "Preset", "variants_option"]


@dataclass(frozen=True)
class CommandLine:
    """The command line of `urpe reproduce NAME`: its presets and flags, everything `--help`
    shows. It is declared in the experiment's presets module, which imports no torch, so that
    `--help` starts at once; `implementation` ("module:NAME") is the `Experiment` that runs it,
    imported only when the command runs."""

    name: str  # `urpe reproduce NAME`, and the "experiment" of its records' configs
    presets: Mapping[str, Preset]
    variants: Option
    options: tuple[Option, ...]
    implementation: str = ""
    description: str | None = None  # the --help text, when longer than the command's help
    preset_help: str = "base settings; any flag given below overrides them"
    # Modules it imports beyond the `train` extra's, checked with those before anything runs so
    # that one line names every missing extra.
    needs: tuple[str, ...] = ()
    # Whether its runs can split each sequence across processes (--context-parallel)
    splits_sequences: bool = False

    @property
    def out(self) -> str:
        return f"runs/{self.name}"

    # `urpe.cli` calls these two (see command.py).
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from .command import add_arguments

        add_arguments(self, parser)

    def run(self, args: argparse.Namespace) -> int:
        require(*TRAIN_MODULES, *self.needs)
        # Importing PyTorch and Lightning takes seconds (tens on a busy machine): on a terminal,
        # say so at once instead of leaving it blank. Not in a log or a pipe, where the command's
        # output stays as it was (a bad flag found later: one line).
        first = all(os.environ.get(name, "0") in ("", "0") for name in ("RANK", "SLURM_PROCID"))
        if first and on_terminal():
            prog = getattr(args, "prog", None) or f"urpe reproduce {self.name}"
            print(f"{prog}: starting (loading PyTorch and Lightning)", file=sys.stderr, flush=True)
        return self.load().run(args)

    def load(self) -> Experiment:
        """The `Experiment` that runs this command line (imported here)."""
        module, _, name = self.implementation.partition(":")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, kw_only=True)
class Experiment(CommandLine):
    """A reproduction: its command line and what runs it (see the module's docstring)."""

    plan: Callable[[Any, str, bool], list[RunSpec]]
    run_one: RunOne
    describe: Callable[[dict], str]  # the line printed when a run finishes
    report: Callable[[list[dict], Path, float], tuple[str, list[Path]]]
    sweep: tuple[str, ...]  # preset fields whose lengths multiply to the number of runs
    check: Callable[[Any], None] = lambda settings: None  # raises UsageError
    # (settings, Execution) -> None, raises UsageError: what the settings cannot run on
    check_execution: Callable[[Any, Any], None] = lambda settings, execution: None

    @classmethod
    def of(
        cls, command_line: CommandLine, plan, run_one, describe, report, **parts: Any
    ) -> Experiment:
        """The experiment that runs `command_line` with these parts (and sweep, check)."""
        shared = {f.name: getattr(command_line, f.name) for f in fields(CommandLine)}
        steps = dict(plan=plan, run_one=run_one, describe=describe, report=report)
        return cls(**shared, **steps, **parts)

    def runs(self, settings: Any) -> int:
        count = 1
        for name in self.sweep:
            count *= len(getattr(settings, name) or (None,))  # an unset field: one value
        return count

    def load(self) -> Experiment:
        return self

    def run(self, args: argparse.Namespace) -> int:
        from .command import run

        return run(self, args)
