"""`urpe reproduce graph`: Graphormer and Graphormer + URPE, identical settings, L1 loss, on real
molecules; test MAE mean ± sd over seeds, parameters, curves and the learned gate.

A preset (presets.py) plus flags resolve to one full configuration per run (experiment.py); the
shared runner (../runner.py) trains them, in parallel where the machine allows, and writes one
record per run to OUT/records/. The report (report.py, plots.py) is rebuilt from every record in
OUT, so an interrupted sweep continues with --resume.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from argparse import SUPPRESS
from pathlib import Path

from ...cli_types import (
    UsageError,
    check_writable_directory,
    name_list,
    non_negative_int,
    positive_float,
    positive_int,
    seed_list,
)
from ..options import (
    add_sweep_arguments,
    require_training_extra,
    resolve_execution,
    resolve_precision,
)
from .presets import PRESETS, VARIANTS, Preset

PROG = "urpe reproduce graph"
DATASETS = ("moses-plogp", "qm9", "zinc", "zinc-full")
ZINC_ENV_VAR = "URPE_ZINC_DIR"


def _sizes(text: str) -> tuple[int, int, int]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected three positive counts train,val,test like 2000,500,500; got {text!r}"
        )
    return values  # type: ignore[return-value]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    q, p = PRESETS["quick"], PRESETS["paper"]

    def option(*names: str, **kwargs) -> None:
        # Unset flags stay absent, so the preset fills them.
        parser.add_argument(*names, default=SUPPRESS, **kwargs)

    def both(field: str) -> str:
        fmt = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else v  # noqa: E731
        return f"quick: {fmt(getattr(q, field))}; paper: {fmt(getattr(p, field))}"

    parser.description = (
        "Train Graphormer and Graphormer + URPE (a gate C indexed by shortest-path distance, "
        "ones at init) with identical settings and the L1 loss; report test and validation MAE "
        "(mean ± sd over seeds), parameter counts and their difference, the paper's ZINC numbers "
        "beside ZINC, learning curves (curves.png) and the learned C against distance (gate.png)."
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="moses-plogp",
        help="moses-plogp: MOSES molecules (ZINC-derived, not ZINC), penalised logP by RDKit; "
        "qm9: QM9 HOMO-LUMO gap (eV); zinc / zinc-full: the real ZINC benchmark from PyG's "
        f"raw files in --zinc-dir or ${ZINC_ENV_VAR} (default: %(default)s)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="quick",
        help="quick: the 'tiny' Graphormer (4 layers, width 64) on capped splits, for 2 CPU "
        "cores; paper: Graphormer's ZINC settings ('slim', 400k updates) for a GPU "
        "(default: quick)",
    )
    option(
        "--target",
        help="regression target (qm9: gap, homo, lumo, mu, alpha, ... ; "
        "moses-plogp: plogp or plogp-normalized; default: the dataset's)",
    )
    option(
        "--sizes",
        type=_sizes,
        help="train,val,test caps (quick: 10000,1000,1000 for moses-plogp and qm9, all of "
        "zinc; paper: the full splits)",
    )
    option(
        "--variants",
        type=name_list,
        help=f"comma-separated from {','.join(VARIANTS)} (default: both)",
    )
    option("--seeds", type=seed_list, help=f"seeds, comma-separated ({both('seeds')})")
    option("--steps", type=positive_int, help=f"optimiser updates ({both('steps')})")
    option("--batch-size", type=positive_int, help=f"graphs per update ({both('batch_size')})")
    option("--lr", type=positive_float, help=f"peak learning rate ({both('lr')})")
    option(
        "--warmup",
        type=non_negative_int,
        help=f"warm-up updates ({both('warmup')}; scaled with --steps when not given)",
    )
    option(
        "--eval-every",
        type=positive_int,
        help=f"updates between validations, the learning curves ({both('eval_every')})",
    )
    parser.add_argument(
        "--zinc-dir",
        type=Path,
        default=None,
        help=f"folder of PyG's raw ZINC files (default: ${ZINC_ENV_VAR})",
    )
    add_sweep_arguments(
        parser,
        out="runs/graph",
        precision_help=f"quick: {q.precision}; paper: {p.precision}, which falls back to "
        "32-true without a GPU",
    )


def resolve(args: argparse.Namespace) -> tuple[Preset, tuple[str, ...]]:
    """The preset with every given flag applied, and the variants; UsageError names a bad flag."""
    base = PRESETS[args.preset]
    changes = {
        name: getattr(args, name, None)
        for name in ("seeds", "steps", "batch_size", "lr", "warmup", "eval_every")
    }
    if getattr(args, "steps", None) is not None and getattr(args, "warmup", None) is None:
        # The warm-up keeps its share of training when only --steps changes.
        changes["warmup"] = round(base.warmup * args.steps / base.steps)
    if getattr(args, "sizes", None) is not None:
        changes["sizes"] = {**base.sizes, args.dataset: args.sizes}
    preset = base.override(**changes)
    if preset.warmup > preset.steps:
        raise UsageError("--warmup", f"{preset.warmup} exceeds --steps {preset.steps}")
    variants = getattr(args, "variants", None) or VARIANTS
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UsageError(
            "--variants", f"unknown variant {', '.join(unknown)}; choose from {', '.join(VARIANTS)}"
        )
    if args.dataset.startswith("zinc"):
        zinc_dir = args.zinc_dir or os.environ.get(ZINC_ENV_VAR)
        if not zinc_dir:
            raise UsageError(
                "--dataset",
                f"{args.dataset} needs PyG's raw ZINC files (train/val/test .pickle and, for the "
                f"subset, .index) in --zinc-dir DIR or ${ZINC_ENV_VAR}; nothing is downloaded",
            )
        if not Path(zinc_dir).is_dir():
            raise UsageError("--zinc-dir", f"{zinc_dir} is not a folder")
    return preset, variants


def _prepare_data(args: argparse.Namespace, config: dict) -> None:
    """Build (or check) the dataset's cache once, here, before any run starts: parallel runs
    then read the same cache instead of each building it."""
    from .experiment import load_data

    if args.zinc_dir is not None:
        # Spawned runs inherit the environment: the folder is not part of any run's identity.
        os.environ[ZINC_ENV_VAR] = str(args.zinc_dir)
    try:
        load_data(config, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as error:
        raise UsageError("--dataset", str(error).splitlines()[0]) from None


def _figures(records: list[dict], table: list[dict], out: Path) -> list[Path]:
    from safetensors.torch import load_file

    from .plots import curves_chart, gate_chart

    written = [out / "curves.png"]
    curves_chart(table, written[0])
    urpe_runs = sorted(
        (r for r in table if r["variant"] == "graphormer-urpe"),
        key=lambda r: (r["dataset"], r["seed"]),
    )
    for row in urpe_runs[:1]:
        path = out / "records" / f"{row['id']}.safetensors"
        try:
            gates = load_file(str(path))["C"]
        except Exception as error:  # a missing or damaged file costs the figure, not the report
            print(f"{PROG}: no gate figure from {path}: {error}", file=sys.stderr)
            continue
        title = (
            f"learned C (after softmax) per layer and head, against shortest-path distance: "
            f"{row['dataset']}, seed {row['seed']}, test MAE {row['test_mae']:.4f}"
        )
        written.append(out / "gate.png")
        gate_chart(gates.float(), title, written[-1])
    return written


def run(args: argparse.Namespace) -> int:
    from ..runner import RecordStore, sweep_command
    from .experiment import describe, plan, run_one

    preset, variants = resolve(args)
    require_training_extra()
    out: Path = args.out
    wall = time.perf_counter()
    warn = lambda message: print(f"{PROG}: {message}", file=sys.stderr, flush=True)  # noqa: E731
    if args.report_only:
        if not (out / "records").is_dir():
            raise UsageError("--out", f"{out}: no records/ folder to report from")
    else:
        runs = len(variants) * len(preset.seeds)
        execution = resolve_execution(args, runs, preset.batch_size)
        precision = resolve_precision(args.precision, preset.precision, execution.accelerator)
        check_writable_directory(out)
        specs = plan(args.dataset, getattr(args, "target", None), preset, precision, variants)
        _prepare_data(args, specs[0].config)
        outcome = sweep_command(PROG, run_one, specs, out, execution, args.resume, describe,
                                warn)  # fmt: skip
        if isinstance(outcome, int):
            return outcome
    from .report import rows, write_report

    records = RecordStore(out).load_all(warn)
    records = [r for r in records if r["config"].get("experiment") == "graph"]
    if not records:
        warn(f"error: no readable graph records in {out / 'records'}")
        return 1
    text = write_report(records, out, time.perf_counter() - wall)
    figures = _figures(records, rows(records), out)
    print(text)
    print(
        "\nwrote " + ", ".join(str(p) for p in [out / "results.json", out / "results.md", *figures])
    )
    return 1 if not args.report_only and outcome.failed else 0
