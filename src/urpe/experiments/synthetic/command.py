"""`urpe reproduce synthetic`: train every (task, variant, vocabulary, seed) and report.

A preset (presets.py) plus flags resolve to one full configuration per run (experiment.py);
the shared runner (../runner.py) trains them, in parallel where the machine allows, and writes
one record per run to OUT/records/. The report (report.py, plots.py) is rebuilt from every
record in OUT, so an interrupted sweep continues with --resume and sweeps may share one OUT.
"""

from __future__ import annotations

import argparse
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
    positive_int_list,
    seed_list,
)
from ...tasks import TASKS
from ..options import (
    add_sweep_arguments,
    require_training_extra,
    resolve_execution,
    resolve_precision,
)
from .presets import PRESETS, Preset
from .variants import VARIANTS

PROG = "urpe reproduce synthetic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    q, p = PRESETS["quick"], PRESETS["paper"]
    v = PRESETS["vocab"]

    def option(*names: str, **kwargs) -> None:
        # Unset flags stay absent (not None), so the preset fills them and --help shows no
        # misleading "(default: None)".
        parser.add_argument(*names, default=SUPPRESS, **kwargs)

    def both(field: str) -> str:
        fmt = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else v  # noqa: E731
        return (f"quick: {fmt(getattr(q, field))}; vocab: {fmt(getattr(v, field))}; "
                f"paper: {fmt(getattr(p, field))}")  # fmt: skip

    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="quick",
        help="base settings; any flag given below overrides them. quick: V=10 at length 24, "
        "minutes on a CPU; vocab: the paper's V=10,1000,10000 at length 32 on the quick model, "
        "3 seeds, hours on a CPU; paper: the paper's model and schedule, for a GPU "
        "(default: quick)",
    )  # fmt: skip
    option("--tasks", type=name_list,
           help=f"comma-separated from {','.join(TASKS)} ({both('tasks')})")  # fmt: skip
    option(
        "--variants",
        type=name_list,
        help=f"comma-separated from {','.join(VARIANTS)}, or 'all' ({both('variants')})",
    )
    option("--seq-len", type=positive_int, help=f"sequence length ({both('seq_len')})")
    option("--vocab-size", type=positive_int_list, dest="vocab_sizes",
           help=f"vocabulary size(s), comma-separated ({both('vocab_sizes')})")  # fmt: skip
    option("--steps", type=positive_int, help=f"optimiser updates ({both('steps')})")
    option("--seeds", type=seed_list, help=f"seeds, comma-separated ({both('seeds')})")
    option("--batch-size", type=positive_int,
           help=f"sequences per update, over all devices ({both('batch_size')})")  # fmt: skip
    option("--lr", type=positive_float, help=f"peak learning rate ({both('lr')})")
    option(
        "--warmup",
        type=non_negative_int,
        help=f"warm-up steps ({both('warmup')}; scaled with --steps when not given)",
    )
    option("--layers", type=positive_int, dest="num_layers",
           help=f"encoder layers ({both('num_layers')})")  # fmt: skip
    option("--dim", type=positive_int, help=f"model width ({both('dim')})")
    option("--heads", type=positive_int, dest="num_heads",
           help=f"attention heads ({both('num_heads')})")  # fmt: skip
    option("--ffn-dim", type=positive_int, help=f"feed-forward width ({both('ffn_dim')})")
    option("--eval-sequences", type=positive_int,
           help=f"held-out sequences for the accuracy ({both('eval_sequences')})")  # fmt: skip
    add_sweep_arguments(
        parser, out="runs/synthetic",
        precision_help=f"quick: {q.precision}; paper: {p.precision}, which falls back to "
        "32-true without a GPU",
    )  # fmt: skip


def _names(values: tuple[str, ...], registry, argument: str, allow_all: bool) -> tuple[str, ...]:
    if allow_all and values == ("all",):
        return tuple(registry)
    unknown = [v for v in values if v not in registry]
    if unknown:
        kind = argument.lstrip("-").rstrip("s")
        raise UsageError(
            argument,
            f"unknown {kind} {', '.join(unknown)}; choose from "
            f"{', '.join(registry)}" + (" or 'all'" if allow_all else ""),
        )
    return values


def resolve(args: argparse.Namespace) -> Preset:
    """The preset with every explicitly given flag applied; UsageError names a bad flag."""
    changes = {
        name: getattr(args, name, None)
        for name in ("seq_len", "vocab_sizes", "steps", "seeds", "batch_size", "lr", "warmup",
                     "num_layers", "dim", "num_heads", "ffn_dim", "eval_sequences")
    }  # fmt: skip
    if getattr(args, "tasks", None) is not None:
        changes["tasks"] = _names(args.tasks, TASKS, "--tasks", allow_all=False)
    if getattr(args, "variants", None) is not None:
        changes["variants"] = _names(args.variants, VARIANTS, "--variants", allow_all=True)
    base = PRESETS[args.preset]
    if getattr(args, "steps", None) is not None and getattr(args, "warmup", None) is None:
        # The warm-up keeps its share of training when only --steps changes.
        changes["warmup"] = round(base.warmup * args.steps / base.steps)
    preset = base.override(**changes)
    if preset.seq_len < 2:
        # At length 1 every position task is trivially solved (one class) or undefined (etp).
        raise UsageError("--seq-len", f"{', '.join(preset.tasks)} need a length >= 2, got "
                                      f"{preset.seq_len}")  # fmt: skip
    if "etp" in preset.tasks and min(preset.vocab_sizes) < 2:
        raise UsageError("--vocab-size", "etp needs a vocabulary of at least 2 tokens (with one "
                                         "token there is nothing to copy)")  # fmt: skip
    if preset.dim % preset.num_heads:
        raise UsageError("--dim", f"{preset.dim} is not divisible by --heads {preset.num_heads}")
    if preset.warmup > preset.steps:
        raise UsageError("--warmup", f"{preset.warmup} exceeds --steps {preset.steps}")
    return preset


def _figures(records: list[dict], table: list[dict], out: Path) -> list[Path]:
    from safetensors.torch import load_file

    from .plots import accuracy_chart, learned_matrices_chart

    written = [out / "accuracy.png"]
    accuracy_chart(table, written[0])
    # Figure 2 of the paper shows URPE's B and C: take urpe (else any gated variant), lowest
    # seed, first vocabulary, per task.
    order = ["urpe"] + [v for v in VARIANTS if v != "urpe"]
    for task in dict.fromkeys(r["task"] for r in table):
        for variant in order:
            runs = sorted((r for r in table if r["task"] == task and r["variant"] == variant),
                          key=lambda r: (r["vocab_size"], r["seed"]))  # fmt: skip
            path = out / "records" / f"{runs[0]['id']}.safetensors" if runs else None
            if path is None or not path.exists():
                continue
            try:
                matrices = load_file(str(path))
            except Exception as error:  # a damaged file costs the figure, not the report
                print(f"{PROG}: skipping {path}: {error}", file=sys.stderr)
                continue
            if matrices.get("C") is None:
                continue
            r = runs[0]
            config = next(rec["config"] for rec in records if rec["id"] == r["id"])
            shared = config["model"]["transformer"].get("share_position", True)
            where = "shared by all layers" if shared else "of the first layer (one pair per layer)"
            title = (f"learned B (before softmax) and C (after softmax), {where}: "
                     f"{task}, {variant}, V={r['vocab_size']}, L={r['seq_len']}, seed {r['seed']}, "
                     f"accuracy {r['accuracy']:.3f}")  # fmt: skip
            written.append(out / f"learned_BC_{task}.png")
            learned_matrices_chart(matrices, title, written[-1])
            break
    return written


def run(args: argparse.Namespace) -> int:
    from ..runner import RecordStore, sweep_command
    from .experiment import describe, plan, run_one

    preset = resolve(args)
    require_training_extra()
    out: Path = args.out
    wall = time.perf_counter()
    warn = lambda message: print(f"{PROG}: {message}", file=sys.stderr, flush=True)  # noqa: E731
    if args.report_only:
        if not (out / "records").is_dir():
            raise UsageError("--out", f"{out}: no records/ folder to report from")
    else:
        specs_count = len(preset.tasks) * len(preset.variants) * len(preset.vocab_sizes) * \
            len(preset.seeds)  # fmt: skip
        execution = resolve_execution(args, specs_count, preset.batch_size)
        precision = resolve_precision(args.precision, preset.precision, execution.accelerator)
        check_writable_directory(out)
        specs = plan(preset, precision)
        outcome = sweep_command(PROG, run_one, specs, out, execution, args.resume, describe,
                                warn)  # fmt: skip
        if isinstance(outcome, int):
            return outcome
    from .report import rows, write_report

    records = RecordStore(out).load_all(warn)
    if not records:
        warn(f"error: no readable records in {out / 'records'}")
        return 1
    text = write_report(records, out, time.perf_counter() - wall)
    figures = _figures(records, rows(records), out)
    print(text)
    print("\nwrote " + ", ".join(str(p) for p in [out / "results.json", out / "results.md",
                                                     *figures]))  # fmt: skip
    return 1 if not args.report_only and outcome.failed else 0
