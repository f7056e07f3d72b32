"""`urpe reproduce NAME`: one command for every `Experiment` (the functions take it as the
`experiment` argument; its class's methods call them, so this module does not import it).

argv -> flags (the experiment's options, the model choices it takes, the sweep flags) -> the
preset with every given flag applied (`resolve`) -> `Execution` and precision checked against
the machine -> `experiment.plan` (one `RunSpec` per run, its config the identity) -> the runner
(records in OUT/records) -> `experiment.report` from every record of this experiment in OUT.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..cli_types import UsageError, check_writable_directory
from .options import (
    add_sweep_arguments,
    require_training_extra,
    resolve_execution,
    resolve_precision,
)
from .settings import Option


def _preset_values(experiment: Any, name: str) -> str:
    def fmt(value: Any) -> str:
        return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

    return "; ".join(
        f"{preset}: {fmt(getattr(settings, name))}"
        for preset, settings in experiment.presets.items()
    )


def _add(parser: argparse.ArgumentParser, experiment: Any, option: Option) -> None:
    kwargs: dict[str, Any] = {"dest": option.field, "default": option.default}
    if option.type is not None:
        kwargs["type"] = option.type
    if option.choices is not None:
        choices = option.choices() if callable(option.choices) else option.choices
        kwargs["choices"] = list(choices)
    if option.metavar is not None:
        kwargs["metavar"] = option.metavar
    if option.action is not None:
        kwargs["action"] = option.action
    help_text = option.help
    if "{presets}" in help_text:
        help_text = help_text.replace("{presets}", _preset_values(experiment, option.field))
    parser.add_argument(*option.flags, help=help_text, **kwargs)


def add_arguments(experiment: Any, parser: argparse.ArgumentParser) -> None:
    if experiment.description is not None:
        parser.description = experiment.description
    parser.add_argument(
        "--preset",
        choices=sorted(experiment.presets),
        default="quick",
        help=f"{experiment.preset_help} (default: quick)",
    )
    for option in (experiment.variants, *experiment.options):
        _add(parser, experiment, option)
    add_sweep_arguments(
        parser,
        out=experiment.out,
        precision_help=_preset_values(experiment, "precision") + "; half precision falls back "
        "to 32-true without a GPU",
        splits_sequences=experiment.splits_sequences,
    )


def resolve(experiment: Any, args: argparse.Namespace) -> Any:
    """The preset with every explicitly given flag applied; UsageError names a bad flag."""
    base = experiment.presets[args.preset]
    changes = {}
    for option in (experiment.variants, *experiment.options):
        value = getattr(args, option.field, None)
        if value is not None and option.names is not None:
            value = option.names.check(value, option.flags[0])
        changes[option.field] = value
    known = {f.name for f in fields(base)}
    if {"steps", "warmup"} <= known and changes.get("steps") and changes.get("warmup") is None:
        # The warm-up keeps its share of training when only --steps changes.
        changes["warmup"] = round(base.warmup * changes["steps"] / base.steps)
    settings = base.override(**changes)
    experiment.check(settings)
    if {"dim", "num_heads"} <= known and settings.dim % settings.num_heads:
        raise UsageError(
            "--dim", f"{settings.dim} is not divisible by --heads {settings.num_heads}"
        )
    if {"steps", "warmup"} <= known and settings.warmup > settings.steps:
        raise UsageError("--warmup", f"{settings.warmup} exceeds --steps {settings.steps}")
    return settings


def run(experiment: Any, args: argparse.Namespace) -> int:
    from .records import RecordStore
    from .runner import sweep_command

    prog = getattr(args, "prog", None) or f"urpe reproduce {experiment.name}"
    settings = resolve(experiment, args)
    require_training_extra()
    out: Path = args.out
    wall = time.perf_counter()
    warn = lambda message: print(f"{prog}: {message}", file=sys.stderr, flush=True)  # noqa: E731
    outcome = None
    if args.report_only:
        if not (out / "records").is_dir():
            raise UsageError("--out", f"{out}: no records/ folder to report from")
    else:
        execution = resolve_execution(args, experiment.runs(settings), settings.batch_size)
        experiment.check_execution(settings, execution)
        precision = resolve_precision(args.precision, settings.precision, execution.accelerator)
        check_writable_directory(out)
        specs = experiment.plan(settings, precision, execution.progress)
        outcome = sweep_command(
            prog, experiment.run_one, specs, out, execution, args.resume, experiment.describe, warn
        )
        if isinstance(outcome, int):
            return outcome
    records = [
        r
        for r in RecordStore(out).load_all(warn)
        if r["config"].get("experiment") == experiment.name
    ]
    if not records:
        warn(f"error: no readable {experiment.name} records in {out / 'records'}")
        return 1
    text, figures = experiment.report(records, out, time.perf_counter() - wall)
    print(text)
    print(
        "\nwrote " + ", ".join(str(p) for p in [out / "results.json", out / "results.md", *figures])
    )
    return 1 if outcome is not None and outcome.failed else 0
