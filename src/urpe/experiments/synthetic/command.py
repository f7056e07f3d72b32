"""`urpe reproduce synthetic`: train every (task, variant, vocabulary, seed) and report.

Each run writes DIR/records/<run>.json (and the learned B and C of its first attention layer
to DIR/records/<run>.pt) as it finishes; the report is rebuilt from all records in DIR, so
an interrupted sweep can be continued with --resume and several sweeps may share one DIR.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from argparse import SUPPRESS
from pathlib import Path

import torch

from ...cli_types import int_list, non_negative_int, positive_float, positive_int
from ...encodings import Positions
from ...kernels import dense_term
from ...models import TransformerConfig
from ...tasks import TASKS, get_task
from .presets import PRESETS, Preset
from .variants import VARIANTS, parse_variants, variant_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    q, p = PRESETS["quick"], PRESETS["paper"]

    def option(*names: str, **kwargs) -> None:
        # Unset flags stay absent (not None), so the preset fills them and --help shows no
        # misleading "(default: None)".
        parser.add_argument(*names, default=SUPPRESS, **kwargs)

    def both(field: str) -> str:
        fmt = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else v  # noqa: E731
        return f"quick: {fmt(getattr(q, field))}; paper: {fmt(getattr(p, field))}"

    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="quick",
        help="base settings; any flag given below overrides them",
    )
    option("--tasks", help=f"comma-separated from {','.join(TASKS)} ({both('tasks')})")
    option(
        "--variants",
        help=f"comma-separated from {','.join(VARIANTS)}, or 'all' ({both('variants')})",
    )
    option("--seq-len", type=positive_int, help=f"sequence length ({both('seq_len')})")
    option(
        "--vocab-size",
        type=int_list,
        dest="vocab_sizes",
        help=f"vocabulary size(s), comma-separated ({both('vocab_sizes')})",
    )
    option("--steps", type=positive_int, help=f"optimizer updates ({both('steps')})")
    option("--seeds", type=int_list, help=f"seeds, comma-separated ({both('seeds')})")
    option("--batch-size", type=positive_int, help=f"sequences per update ({both('batch_size')})")
    option("--lr", type=positive_float, help=f"peak learning rate ({both('lr')})")
    option(
        "--warmup",
        type=non_negative_int,
        help=f"warm-up steps ({both('warmup')}; scaled with --steps when not given)",
    )
    option(
        "--layers",
        type=positive_int,
        dest="num_layers",
        help=f"encoder layers ({both('num_layers')})",
    )
    option("--dim", type=positive_int, help=f"model width ({both('dim')})")
    option(
        "--heads",
        type=positive_int,
        dest="num_heads",
        help=f"attention heads ({both('num_heads')})",
    )
    option("--ffn-dim", type=positive_int, help=f"feed-forward width ({both('ffn_dim')})")
    option(
        "--eval-sequences",
        type=positive_int,
        help=f"held-out sequences for the accuracy ({both('eval_sequences')})",
    )
    option(
        "--precision",
        help=f"Lightning precision ({both('precision')}; "
        "16-mixed falls back to 32-true without a GPU)",
    )
    parser.add_argument(
        "--out",
        default="runs/synthetic",
        type=Path,
        help="output directory (results.json, results.md, PNGs, logs/)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip runs whose record already exists in --out"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing; rebuild the table and plots from --out's records",
    )
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator")
    parser.add_argument("--devices", default="auto", help="Lightning devices (e.g. 1, 4, auto)")
    parser.add_argument("--strategy", default="auto", help="Lightning strategy (e.g. ddp)")
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="torch CPU threads (0: torch's default). The quick models are so "
        "small that 1 thread is fastest, and much faster on a busy machine",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def resolve(args: argparse.Namespace) -> Preset:
    """The preset with every explicitly given flag applied; raises ValueError on bad values."""
    changes = {
        name: getattr(args, name, None)
        for name in ("seq_len", "vocab_sizes", "steps", "seeds", "batch_size", "lr", "warmup",
                     "num_layers", "dim", "num_heads", "ffn_dim", "eval_sequences", "precision")
    }  # fmt: skip
    if getattr(args, "tasks", None) is not None:
        tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise ValueError(
                f"unknown task {', '.join(unknown) or '(none given)'}; choose from "
                f"{', '.join(TASKS)}"
            )
        changes["tasks"] = tasks
    if getattr(args, "variants", None) is not None:
        changes["variants"] = tuple(parse_variants(args.variants))
    base = PRESETS[args.preset]
    if getattr(args, "steps", None) is not None and getattr(args, "warmup", None) is None:
        # The warm-up keeps its share of training when only --steps changes.
        changes["warmup"] = round(base.warmup * args.steps / base.steps)
    preset = base.override(**changes)
    if any(v < 1 for v in preset.vocab_sizes):
        raise ValueError(f"vocabulary sizes must be positive, got {preset.vocab_sizes}")
    if "etp" in preset.tasks and preset.seq_len < 2:
        raise ValueError("etp needs --seq-len >= 2")
    if preset.dim % preset.num_heads:
        raise ValueError(f"--dim {preset.dim} must be divisible by --heads {preset.num_heads}")
    if preset.warmup > preset.steps:
        raise ValueError(f"--warmup {preset.warmup} exceeds --steps {preset.steps}")
    return preset


def run_name(task: str, variant: str, vocab: int, seed: int, preset: Preset) -> str:
    return f"{task}-{variant}-V{vocab}-L{preset.seq_len}-S{preset.steps}-seed{seed}"


def _sample(task: str, length: int, vocab: int, batch_size: int, generator: torch.Generator):
    return get_task(task)(batch_size, length, vocab, generator)


def learned_matrices(model, length: int) -> dict[str, torch.Tensor | None]:
    """Dense B and C, (H, n, n), of the first attention layer (n: length plus markers)."""
    encoder = model.encoder
    n = length + (encoder.markers.count if encoder.markers is not None else 0)
    mixer = encoder.layers[0].mixer
    out: dict[str, torch.Tensor | None] = {"B": None, "C": None}
    with torch.no_grad():
        position = getattr(mixer, "position", None)
        if position is not None:
            h, d = mixer.num_heads, mixer.head_dim
            q = torch.zeros(1, h, n, d)
            term = dense_term(position.bias(q, Positions.sequence(n), d**-0.5), n, n)
            if term is not None:
                out["B"] = term.expand(1, h, n, n)[0].detach().float().cpu().clone()
        gate = getattr(mixer, "gate", None)
        if gate is not None:
            out["C"] = gate(Positions.sequence(n)).dense(n, n)[0].detach().float().cpu().clone()
    return out


def train_one(task_name: str, variant: str, vocab: int, seed: int, preset: Preset,
              args: argparse.Namespace) -> tuple[dict, dict]:  # fmt: skip
    """One run: returns its record and its learned matrices."""
    import lightning as L

    from ...training import (
        GeneratedDataModule,
        OptimConfig,
        TokenClassifier,
        TrainConfig,
        build_trainer,
    )

    task = get_task(task_name)
    name = run_name(task_name, variant, vocab, seed, preset)
    L.seed_everything(seed, verbose=False)
    base = TransformerConfig(
        vocab_size=vocab, max_len=preset.seq_len, num_layers=preset.num_layers, dim=preset.dim,
        num_heads=preset.num_heads, ffn_dim=preset.ffn_dim, dropout=0.0, norm_first=False,
    )  # fmt: skip
    config = variant_config(variant, base)
    optim = OptimConfig(lr=preset.lr, warmup_steps=preset.warmup, total_steps=preset.steps)
    model = TokenClassifier(config, task.num_classes(preset.seq_len, vocab), optim)
    eval_batch = min(preset.eval_sequences, 256)
    data = GeneratedDataModule(
        functools.partial(_sample, task_name, preset.seq_len, vocab),
        batch_size=preset.batch_size, seed=seed,
        eval_batches=max(1, preset.eval_sequences // eval_batch), eval_batch_size=eval_batch,
    )  # fmt: skip
    precision = preset.precision
    if precision.startswith("16") and not torch.cuda.is_available():
        precision = "32-true"
    train = TrainConfig(
        max_steps=preset.steps, val_every=max(1, preset.steps // 4),
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
        precision=precision, progress=not args.no_progress,
    )  # fmt: skip
    trainer = build_trainer(train, args.out / "logs", name=name, progress_description=name)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    # A fresh evaluation of the final weights on the held-out set (never trained on).
    metrics = trainer.validate(model, datamodule=data, verbose=False)[0]
    seconds = time.perf_counter() - start
    record = dict(
        task=task_name, variant=variant, seed=seed, vocab_size=vocab, seq_len=preset.seq_len,
        steps=preset.steps, params=sum(p.numel() for p in model.parameters()),
        accuracy=float(metrics["val/acc"]), loss=float(metrics["val/loss"]),
        chance=task.chance(preset.seq_len, vocab), seconds=round(seconds, 2),
        batch_size=preset.batch_size, lr=preset.lr, warmup=preset.warmup,
        num_layers=preset.num_layers, dim=preset.dim, num_heads=preset.num_heads,
        eval_sequences=len(data.held_out()), threads=torch.get_num_threads(),
    )  # fmt: skip
    return record, learned_matrices(model, preset.seq_len)


def _is_rank_zero() -> bool:
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _figures(records: list[dict], out: Path) -> list[Path]:
    from .plots import accuracy_chart, learned_matrices_chart

    written = [out / "accuracy.png"]
    accuracy_chart(records, written[0])
    # Figure 2 of the paper shows URPE's B and C: take urpe (else any gated variant), lowest
    # seed, first vocabulary, per task.
    for task in dict.fromkeys(r["task"] for r in records):
        candidates = [r for r in records if r["task"] == task]
        order = ["urpe"] + [v for v in VARIANTS if v != "urpe"]
        for variant in order:
            runs = sorted((r for r in candidates if r["variant"] == variant),
                          key=lambda r: (r["vocab_size"], r["seed"]))  # fmt: skip
            path = out / "records" / f"{runs[0]['run']}.pt" if runs else None
            if path is None or not path.exists():
                continue
            matrices = torch.load(path)
            if matrices.get("C") is None:
                continue
            r = runs[0]
            title = (f"learned B (before softmax) and C (after softmax), shared by all layers: "
                     f"{task}, {variant}, V={r['vocab_size']}, L={r['seq_len']}, seed {r['seed']}, "
                     f"accuracy {r['accuracy']:.3f}")  # fmt: skip
            written.append(out / f"learned_BC_{task}.png")
            learned_matrices_chart(matrices, title, written[-1])
            break
    return written


def run(args: argparse.Namespace) -> int:
    try:
        preset = resolve(args)
    except ValueError as error:
        print(f"urpe reproduce synthetic: error: {error}", file=sys.stderr)
        return 2
    out: Path = args.out
    records_dir = out / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    if not args.report_only:
        from tqdm.auto import tqdm

        from ...training import quiet_lightning

        quiet_lightning()
        plan = [(t, v, vocab, s) for t in preset.tasks for v in preset.variants
                for vocab in preset.vocab_sizes for s in preset.seeds]  # fmt: skip
        bar = tqdm(plan, desc="runs", position=0, disable=args.no_progress, unit="run",
                   dynamic_ncols=True)  # fmt: skip
        for task, variant, vocab, seed in bar:
            name = run_name(task, variant, vocab, seed, preset)
            if args.resume and (records_dir / f"{name}.json").exists():
                continue
            bar.set_postfix_str(name)
            record, matrices = train_one(task, variant, vocab, seed, preset, args)
            if not _is_rank_zero():  # with several devices, every process runs the sweep
                continue
            record["run"] = name
            torch.save(matrices, records_dir / f"{name}.pt")
            (records_dir / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
            bar.write(f"{name}: accuracy {record['accuracy']:.3f} "
                      f"(chance {record['chance']:.3f}) in {record['seconds']:.0f} s")  # fmt: skip
    from .report import load_records, write_report

    if not args.report_only and not _is_rank_zero():
        return 0
    records = load_records(out)
    if not records:
        print(f"urpe reproduce synthetic: error: no records in {records_dir}", file=sys.stderr)
        return 1
    settings = {
        k: getattr(preset, k)
        for k in (
            "batch_size",
            "lr",
            "warmup",
            "num_layers",
            "dim",
            "num_heads",
            "ffn_dim",
            "eval_sequences",
        )
    }
    settings = {"preset": args.preset, **settings}
    text = write_report(records, out, settings, time.perf_counter() - wall)
    figures = _figures(records, out)
    print(text)
    print("\nwrote " + ", ".join(str(p) for p in [out / "results.json", out / "results.md",
                                                     *figures]))  # fmt: skip
    return 0
