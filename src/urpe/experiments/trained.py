"""Finding a trained model from what a user points at, for `urpe generate`, `predict` and
`evaluate`: a checkpoint directory (or a file in it), a run folder (`OUT/runs/<id>`, its newest
checkpoint), or a whole sweep folder (`OUT`, holding records/ and runs/): then the finished run
with the best validation result (lowest MAE or loss, highest accuracy), named in one line. Only
runs of the same data compete: a folder with runs on different data (an edited file trained
again under --resume, several target columns) lists them and asks for one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cli_types import UsageError

# experiment -> (result key, True when higher is better)
BEST_BY = {"graph": ("val_mae", False), "lm": ("val_loss", False), "synthetic": ("accuracy", True)}
# experiment -> the config fields that say which data a run learned from and was validated on
DATA_FIELDS = {
    "graph": ("dataset", "target", "data"),
    "lm": ("dataset", "data_sha256", "tokenizer", "tokenizer_vocab_size"),
    "synthetic": ("task", "seq_len", "vocab_size"),
}


@dataclass
class Trained:
    checkpoint: Path  # the checkpoint directory
    config: dict[str, Any]  # its config.json
    model: Any  # what load_model returned (a bundle or a module)

    @property
    def run(self) -> dict[str, Any]:
        """The training run's config ({} for a model saved with `save_model` without one)."""
        return self.config.get("run") or {}

    @property
    def experiment(self) -> str | None:
        return self.run.get("experiment") or {"text": "lm", "molecules": "graph"}.get(
            (self.config.get("inputs") or {}).get("kind")
        )


def data_identity(config: dict[str, Any]) -> str:
    """What a run learned from and was validated on: only runs of the same data (file content,
    target, split, tokenizer or task) have comparable validation results."""
    from .records import canonical_json

    fields = DATA_FIELDS.get(config.get("experiment"), ("dataset",))
    return canonical_json({field: config.get(field) for field in fields})


def best_run(out: Path, experiment: str | None = None, argument: str = "RUN") -> tuple[Path, str]:
    """The run folder of the best finished run of a sweep folder, and a line saying which; a
    UsageError listing the runs when the folder holds runs on different data (an edited file
    trained again under --resume, several targets), as no validation result ranks those."""
    from .records import RecordStore, dataset_labels

    problems: list[str] = []
    records = RecordStore(out).load_all(problems.append)
    labels = dataset_labels(r["config"] for r in records if "dataset" in r["config"])
    groups: dict[str, list[tuple]] = {}
    for record in records:
        kind = record["config"].get("experiment")
        if experiment is not None and kind != experiment:
            continue
        key, higher = BEST_BY.get(kind, (None, False))
        value = record["result"].get(key) if key else None
        run_dir = out / "runs" / record["id"]
        if isinstance(value, int | float) and (run_dir / "checkpoints").is_dir():
            candidate = (-value if higher else value, record["id"], run_dir, key, value, record)
            groups.setdefault(data_identity(record["config"]), []).append(candidate)
    if not groups:
        what = f"{experiment} " if experiment else ""
        raise UsageError(argument, f"{out}: no finished {what}run with a checkpoint under runs/")
    if len(groups) == 1:
        (candidates,) = groups.values()
        _, run_id, run_dir, key, value, record = min(candidates)
        on = _data_label(record["config"], labels)
        return (
            run_dir,
            f"using run {run_id} ({key} {value:.4g}, the best of {len(candidates)} on {on})",
        )
    best = sorted((min(c) for c in groups.values()), key=lambda c: c[5].get("finished", ""),
                  reverse=True)  # fmt: skip
    runs = "; ".join(
        f"{run_dir} ({_data_label(record['config'], labels)}, finished "
        f"{record.get('finished', '?')}, {key} {value:.4g})"
        for _, _, run_dir, key, value, record in best
    )
    raise UsageError(
        argument,
        f"{out} holds runs on {len(best)} different data (files, targets or splits), whose "
        f"validation results do not compare; name one run folder: {runs}",
    )


def _data_label(config: dict[str, Any], labels: dict[str, str]) -> str:
    """The data of a run in a few words: "mols.csv, logP", "shakespeare, char", "etp, ..."."""
    if config.get("experiment") == "synthetic":
        task, vocab, length = (config.get(k) for k in ("task", "vocab_size", "seq_len"))
        return f"{task}, vocab {vocab}, length {length}"
    shown = labels.get(config.get("dataset", ""), "?")
    detail = config.get("target") or config.get("tokenizer")
    return f"{shown}, {detail}" if detail else shown


def find_trained(
    path: Path, experiment: str | None = None, say=None, argument: str = "RUN"
) -> Trained:
    """The trained model `path` points at (see the module docstring); UsageError if none."""
    from ..training.checkpoint import (
        CONFIG,
        CheckpointError,
        load_model,
        read_checkpoint_config,
        resolve_checkpoint,
    )

    path = Path(path)
    if not path.exists():
        raise UsageError(argument, f"{path}: no such file or folder")
    if (path / "records").is_dir() and not (path / CONFIG).exists():
        path, note = best_run(path, experiment, argument)
        (say or (lambda line: print(line, file=sys.stderr)))(note)
    try:
        directory = resolve_checkpoint(path)
        config = read_checkpoint_config(directory)
        model = load_model(directory)
    except (FileNotFoundError, CheckpointError, ValueError, TypeError) as error:
        raise UsageError(argument, str(error).splitlines()[0]) from None
    return Trained(directory, config, model)
