"""`urpe reproduce lm`: train every (variant, seed) on one corpus under identical budgets and
report loss (bits per character or perplexity), parameters, throughput and length extrapolation.

A preset (presets.py) plus flags resolve to one full configuration per run (experiment.py); the
shared runner trains them (in parallel where the machine allows) and writes one record per run
to OUT/records/; the report (report.py, plots.py) is rebuilt from every record in OUT.
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
    positive_int_list,
    seed_list,
)
from ..options import (
    add_sweep_arguments,
    require_training_extra,
    resolve_execution,
    resolve_precision,
)
from .presets import PRESETS, Preset
from .variants import BASES, parse_variant

PROG = "urpe reproduce lm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    q, p = PRESETS["quick"], PRESETS["paper"]

    def option(*names: str, **kwargs) -> None:
        parser.add_argument(*names, default=SUPPRESS, **kwargs)

    def both(field: str) -> str:
        fmt = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else v  # noqa: E731
        return f"quick: {fmt(getattr(q, field))}; paper: {fmt(getattr(p, field))}"

    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="quick",
        help="base settings; any flag below overrides them (default: quick)",
    )
    option("--dataset",
           help="shakespeare (char), enwiki-mini (byte), enwik8:PATH, wikitext-103:DIR, "
                f"text:PATH or a file path ({both('dataset')})")  # fmt: skip
    option("--tokenizer", choices=("char", "byte", "bpe", "word"),
           help="tokenisation (default: the corpus's own)")  # fmt: skip
    option("--vocab-size", type=positive_int, dest="vocab_size",
           help="BPE vocabulary size, or a cap on the word vocabulary")  # fmt: skip
    option("--variants", type=name_list,
           help=f"comma-separated BASE[+urpe][+mem], BASE one of {', '.join(BASES)}; 'urpe' = "
                f"rpe+urpe; txl carries memory by itself ({both('variants')})")  # fmt: skip
    option("--seeds", type=seed_list, help=f"seeds, comma-separated ({both('seeds')})")
    option("--segment-length", type=positive_int,
           help=f"training segment length L ({both('segment_length')})")  # fmt: skip
    option("--memory-length", type=positive_int,
           help=f"memory M of the recurrent variants ({both('memory_length')})")  # fmt: skip
    option("--steps", type=positive_int, help=f"optimiser updates ({both('steps')})")
    option("--batch-size", type=positive_int,
           help=f"segments per update, over all devices ({both('batch_size')})")  # fmt: skip
    option("--lr", type=positive_float, help=f"peak learning rate ({both('lr')})")
    option(
        "--warmup",
        type=non_negative_int,
        help=f"warm-up updates ({both('warmup')}; scaled with --steps when not given)",
    )
    option("--layers", type=positive_int, dest="num_layers", help=f"({both('num_layers')})")
    option("--dim", type=positive_int, help=f"model width ({both('dim')})")
    option("--heads", type=positive_int, dest="num_heads", help=f"({both('num_heads')})")
    option("--ffn-dim", type=positive_int, help=f"feed-forward width ({both('ffn_dim')})")
    option(
        "--eval-tokens",
        type=non_negative_int,
        help=f"tokens of the valid/test splits scored (0: all; {both('eval_tokens')})",
    )
    option("--factors", type=positive_int_list,
           help=f"extrapolation contexts, multiples of L ({both('factors')})")  # fmt: skip
    option("--val-every", type=positive_int,
           help=f"updates between validations for the curves ({both('val_every')})")  # fmt: skip
    add_sweep_arguments(
        parser, out="runs/lm",
        precision_help=f"quick: {q.precision}; paper: {p.precision}, which falls back to "
        "32-true without a GPU",
    )  # fmt: skip


def resolve(args: argparse.Namespace) -> Preset:
    """The preset with every given flag applied; UsageError names a bad flag."""
    names = ("dataset", "tokenizer", "vocab_size", "seeds", "segment_length", "memory_length",
             "steps", "batch_size", "lr", "warmup", "num_layers", "dim", "num_heads", "ffn_dim",
             "eval_tokens", "factors", "val_every")  # fmt: skip
    changes = {name: getattr(args, name, None) for name in names}
    if getattr(args, "variants", None) is not None:
        for name in args.variants:
            try:
                parse_variant(name)
            except ValueError as error:
                raise UsageError("--variants", str(error)) from None
        changes["variants"] = args.variants
    base = PRESETS[args.preset]
    if changes["steps"] is not None and changes["warmup"] is None:
        changes["warmup"] = round(base.warmup * args.steps / base.steps)
    preset = base.override(**changes)
    if preset.dim % preset.num_heads:
        raise UsageError("--dim", f"{preset.dim} is not divisible by --heads {preset.num_heads}")
    if preset.warmup > preset.steps:
        raise UsageError("--warmup", f"{preset.warmup} exceeds --steps {preset.steps}")
    if args.preset == "paper" and preset.dataset == "wikitext-103":
        raise UsageError("--dataset", "the paper preset trains on WikiText-103: give its folder, "
                                      "--dataset wikitext-103:DIR")  # fmt: skip
    return preset


def _corpus(preset: Preset):
    from ...data.text import DatasetError, load_corpus

    try:
        return load_corpus(preset.dataset, tokenizer=preset.tokenizer,
                           vocab_size=preset.vocab_size, progress=None)  # fmt: skip
    except DatasetError as error:
        raise UsageError("--dataset", str(error)) from None


def run(args: argparse.Namespace) -> int:
    from ..runner import RecordStore, sweep_command
    from .experiment import describe, plan

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are spawned after it
    preset = resolve(args)
    require_training_extra()
    out: Path = args.out
    wall = time.perf_counter()
    warn = lambda message: print(f"{PROG}: {message}", file=sys.stderr, flush=True)  # noqa: E731
    outcome = None
    if args.report_only:
        if not (out / "records").is_dir():
            raise UsageError("--out", f"{out}: no records/ folder to report from")
    else:
        from .experiment import run_one

        runs = len(preset.variants) * len(preset.seeds)
        execution = resolve_execution(args, runs, preset.batch_size)
        precision = resolve_precision(args.precision, preset.precision, execution.accelerator)
        check_writable_directory(out)
        corpus = _corpus(preset)  # built (and cached) once, before the workers start
        needed = (preset.batch_size * preset.segment_length) + 1
        if len(corpus.train) < needed:
            raise UsageError("--dataset", f"the training split has {len(corpus.train)} tokens, "
                                          f"fewer than one update needs ({needed})")  # fmt: skip
        specs = plan(preset, precision, corpus.vocab_size, corpus.metric)
        outcome = sweep_command(PROG, run_one, specs, out, execution, args.resume, describe,
                                warn)  # fmt: skip
        if isinstance(outcome, int):
            return outcome
    from .report import write_report

    records = [r for r in RecordStore(out).load_all(warn) if r["config"].get("experiment") == "lm"]
    if not records:
        warn(f"error: no readable LM records in {out / 'records'}")
        return 1
    text, figures = write_report(records, out, time.perf_counter() - wall)
    print(text)
    print("\nwrote " + ", ".join(str(p) for p in [out / "results.json", out / "results.md",
                                                     *figures]))  # fmt: skip
    return 1 if outcome is not None and outcome.failed else 0
