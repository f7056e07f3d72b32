"""`urpe evaluate RUN DATA`: measure a trained model on data it was not trained on.

RUN is a sweep folder (its best run by validation result), a run folder (`OUT/runs/<id>`), a
checkpoint, or a folder written by `urpe.save_model`. What DATA is depends on the model:

- language model: a text file; reports bits per character (character or byte tokens) or
  perplexity (subword or word tokens), scored as `urpe reproduce lm` reports it: every token
  once, in windows of the training segment length advancing by half of it (--mode sliding), in
  consecutive chunks (chunks), or in chunks with the trained memory carried (memory);
- graph model: a CSV/TSV/SDF file with SMILES and the target; reports the mean absolute error
  in the target's units (rows RDKit cannot read, or without a number, are skipped and counted);
- synthetic model: a task name (pi, etp, probe; default: the run's own task); reports token
  accuracy on freshly drawn sequences (by default the run's own held-out set, so the number
  equals the recorded one).

One line of results, or JSON with --json. `urpe evaluate long-context MODEL` (its own --help)
measures a language model on long-context tasks and perplexity at many lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..cli_types import UsageError, describe, non_negative_int, positive_int

PROG = "urpe evaluate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    describe(parser, __doc__)
    parser.add_argument(
        "run",
        type=Path,
        metavar="RUN",
        help="a sweep folder (its best run), a run folder, or a checkpoint",
    )
    parser.add_argument(
        "data",
        nargs="?",
        default=None,
        metavar="DATA",
        help="a text file (LM), a labelled molecule file (graph), or a task name "
        "(synthetic; default: the run's task)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--batch-size", type=positive_int, help="sequences, windows or molecules per forward pass"
    )
    text = parser.add_argument_group("language models")
    text.add_argument(
        "--mode",
        choices=("sliding", "chunks", "memory"),
        default="sliding",
        help="how the text is cut into contexts (default: %(default)s)",
    )
    text.add_argument(
        "--context",
        type=positive_int,
        help="context length in tokens (default: the training length)",
    )
    graph = parser.add_argument_group("graph models")
    graph.add_argument(
        "--smiles-column",
        default="smiles",
        metavar="NAME",
        help="SMILES column, any case (default: %(default)s)",
    )
    graph.add_argument(
        "--target-column",
        default=None,
        metavar="NAME",
        help="column of true values (default: the model's target name)",
    )
    task = parser.add_argument_group("synthetic models")
    task.add_argument(
        "--sequences",
        type=positive_int,
        default=None,
        help="sequences to draw (default: the run's held-out size)",
    )
    task.add_argument(
        "--seed",
        type=non_negative_int,
        default=None,
        help="seed of the sequences (default: the run's held-out seed)",
    )


def _bundle(trained, reads: str, args: argparse.Namespace) -> Any:
    """The loaded model when it is the bundle of what it `reads` ("text" or "molecules") and
    DATA is given; else a UsageError saying which is missing."""
    from ..training.bundles import MoleculeModel, TextModel

    kind, problem, missing = {
        "text": (
            TextModel,
            f"no tokenizer.json beside {trained.checkpoint}",
            "give the text file to score",
        ),
        "molecules": (
            MoleculeModel,
            f"{trained.checkpoint} is not a model of molecules",
            "give a CSV/SDF file of SMILES with the true values",
        ),
    }[reads]
    if not isinstance(trained.model, kind):
        raise UsageError("RUN", problem)
    if args.data is None:
        raise UsageError("DATA", missing)
    return trained.model


def _text(trained, args: argparse.Namespace) -> dict[str, Any]:
    from ..data.text import DatasetError
    from ..data.text.corpora import read_text_file

    model = _bundle(trained, "text", args)
    path = Path(args.data).expanduser()
    if not path.is_file():
        raise UsageError("DATA", f"no such file: {path}")
    if args.mode == "memory" and model.memory_length == 0:
        raise UsageError("--mode", "this model has no memory; use sliding or chunks")
    try:  # as training reads it: bytes for a byte-level model, else UTF-8 text
        text = read_text_file(path, model.tokenizer.kind == "byte")
    except DatasetError as error:
        raise UsageError("DATA", str(error)) from None
    try:
        result = model.score(
            text,
            context=args.context,
            mode=args.mode,
            batch_size=args.batch_size or 8,
            progress=not args.no_progress,
        )
    except ValueError as error:
        raise UsageError("DATA", str(error).splitlines()[0]) from None
    metric = model.metric
    return {
        "kind": "lm",
        "data": str(path),
        "metric": metric,
        metric: result[metric],
        "loss_nats": result["loss"],
        "tokens": int(result["tokens"]),
        "mode": args.mode,
        "context": args.context or model.segment_length,
        "line": f"{metric} {result[metric]:.4f} over {int(result['tokens']):,} tokens of "
        f"{path.name} ({args.mode}, context {args.context or model.segment_length})",
    }


def _graph(trained, args: argparse.Namespace) -> dict[str, Any]:
    from ..data.molecules.tables import MoleculeFileError, finite_number, read_molecule_table

    model = _bundle(trained, "molecules", args)
    target = args.target_column or model.target
    try:
        rows, _ = read_molecule_table(Path(args.data).expanduser(), args.smiles_column, [target])
    except MoleculeFileError as error:
        flag = {"smiles_column": "--smiles-column", "target": "--target-column"}.get(
            error.setting or "", "DATA"
        )
        raise UsageError(flag, str(error)) from None
    column = next(iter(rows[0].targets)) if rows else target
    truths = [finite_number(row.targets.get(column, "")) for row in rows]
    values = model.predict(
        [row.smiles for row in rows],
        batch_size=args.batch_size or 256,
        progress=not args.no_progress,
        label="evaluate",
    )
    pairs = [(p, t) for p, t in zip(values, truths, strict=True) if p is not None and t is not None]
    if not pairs:
        raise UsageError("DATA", f"no row has both a readable SMILES and a number in {column!r}")
    mae = sum(abs(p - t) for p, t in pairs) / len(pairs)
    skipped = len(rows) - len(pairs)
    note = f"; skipped {skipped} rows (unreadable SMILES or no number)" if skipped else ""
    return {
        "kind": "graph",
        "data": str(args.data),
        "target": column,
        "unit": model.unit,
        "mae": mae,
        "molecules": len(pairs),
        "skipped": skipped,
        "line": f"MAE {mae:.4f} of {model.quantity} over {len(pairs)} molecules of "
        f"{Path(args.data).name}{note}",
    }


def _synthetic(trained, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..progress import progress_bar
    from ..tasks import get_task

    run = trained.run
    model = getattr(trained.model, "model", trained.model)
    if run.get("experiment") != "synthetic":
        raise UsageError("RUN", f"{trained.checkpoint} holds no run of urpe reproduce synthetic")
    name = args.data or run["task"]
    try:
        task = get_task(name)
    except ValueError as error:
        raise UsageError("DATA", str(error)) from None
    length, vocab = run["seq_len"], run["vocab_size"]
    if task.num_classes(length, vocab) != model.num_classes:
        raise UsageError(
            "DATA",
            f"{name} needs {task.num_classes(length, vocab)} classes; the "
            f"model has {model.num_classes}",
        )
    count = args.sequences or run["data"]["held_out"]
    seed = args.seed if args.seed is not None else run["seed"] + run["data"]["held_out_seed_offset"]
    tokens, targets = task(count, length, vocab, torch.Generator().manual_seed(seed))
    correct = total = 0
    batch = args.batch_size or 256
    model.eval()
    with torch.no_grad():
        for start in progress_bar(
            range(0, count, batch), desc="evaluate", unit="batch", enabled=not args.no_progress
        ):
            logits = model(tokens[start : start + batch])
            scored = targets[start : start + batch]
            mask = scored != -100
            correct += int((logits.argmax(-1)[mask] == scored[mask]).sum())
            total += int(mask.sum())
    accuracy = correct / max(total, 1)
    return {
        "kind": "synthetic",
        "task": name,
        "accuracy": accuracy,
        "sequences": count,
        "seed": seed,
        "tokens": total,
        "chance": task.chance(length, vocab),
        "line": f"accuracy {accuracy:.4f} on {count} {name} sequences (seed {seed}; chance "
        f"{task.chance(length, vocab):.3f})",
    }


# By what the model reads, as its checkpoint records it; a model of tensors is a synthetic
# run's (evaluated on freshly drawn sequences of its task).
EVALUATORS = {"text": _text, "molecules": _graph, "tensors": _synthetic}


def run(args: argparse.Namespace) -> int:
    from .trained import find_trained

    say = lambda line: print(f"{PROG}: {line}", file=sys.stderr)  # noqa: E731
    trained = find_trained(args.run, None, say)
    kind = trained.reads
    if kind == "tensors" and trained.run.get("experiment") != "synthetic":
        kind = None
    if kind not in EVALUATORS:
        raise UsageError(
            "RUN",
            f"{trained.checkpoint}: cannot tell what data this model takes "
            "(no run or inputs in its config.json)",
        )
    result = EVALUATORS[kind](trained, args)
    line = result.pop("line")
    result["checkpoint"] = str(trained.checkpoint)
    print(json.dumps(result, indent=1) if args.json else line)
    return 0
