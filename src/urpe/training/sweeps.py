"""A sweep folder, and the run a loader takes from it.

`urpe reproduce ... --out OUT` writes one record per finished run (`OUT/records/<id>.json`:
{"id", "config", "result", ...}) and its checkpoints (`OUT/runs/<id>/checkpoints/`). Given OUT
where a model is expected, `urpe.load_model`, `urpe predict`, `evaluate` and `generate` all take
the same run, chosen here: among the finished runs with a checkpoint (of the command's
experiment, when it names one), the best by validation result: the lowest MAE (graph) or loss
(lm), the highest accuracy (synthetic). Only runs of the same data compete (file content,
target, split, tokenizer or task): a folder with runs on different data (an edited file trained
again under --resume, several target columns) lists them and asks for one.

Standard library only (and `urpe.files`): the commands resolve a folder before loading torch.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..files import CorruptFileError, read_json

# experiment -> (result key, True when higher is better)
BEST_BY = {"graph": ("val_mae", False), "lm": ("val_loss", False), "synthetic": ("accuracy", True)}
# experiment -> the config fields that say which data a run learned from and was validated on
DATA_FIELDS = {
    "graph": ("dataset", "target", "data"),
    "lm": ("dataset", "data_sha256", "tokenizer", "tokenizer_vocab_size"),
    "synthetic": ("task", "seq_len", "vocab_size"),
}
# Stored with a run's config, not part of its identity: where its data files lie.
LOCATIONS = "locations"
FILE_KINDS = ("csv", "sdf", "text")  # a user's file, named by its file name alone


class SweepChoiceError(ValueError):
    """A sweep folder holds runs on different data: no validation result ranks them."""


def dataset_labels(configs: Iterable[dict]) -> dict[str, str]:
    """config["dataset"] -> how a report or message names it: a user's file by its name (the
    start of its digest added where two contents share a name), anything else as it is."""
    named: dict[str, str] = {}
    for config in configs:
        shown, located = config["dataset"], config.get(LOCATIONS, {}).get("dataset")
        if located:
            kind, name = shown.partition(":")[0], Path(located).name
            named[shown] = name if kind in FILE_KINDS else f"{kind}:{name}"
        else:
            named.setdefault(shown, shown)
    clashes = Counter(named.values())
    return {
        shown: f"{name} ({shown.partition('sha256-')[2] or shown})" if clashes[name] > 1 else name
        for shown, name in named.items()
    }


def data_identity(config: dict[str, Any]) -> str:
    """What a run learned from and was validated on: only runs of the same data have
    comparable validation results."""
    fields = DATA_FIELDS.get(config.get("experiment"), ("dataset",))
    return json.dumps({field: config.get(field) for field in fields}, sort_keys=True)


def _data_label(config: dict[str, Any], labels: dict[str, str]) -> str:
    """The data of a run in a few words: "mols.csv, logP", "shakespeare, char", "etp, ..."."""
    if config.get("experiment") == "synthetic":
        task, vocab, length = (config.get(k) for k in ("task", "vocab_size", "seq_len"))
        return f"{task}, vocab {vocab}, length {length}"
    shown = labels.get(config.get("dataset", ""), "?")
    detail = config.get("target") or config.get("tokenizer")
    return f"{shown}, {detail}" if detail else shown


def _result_text(key: str, value: float, record: dict[str, Any]) -> str:
    """A run's validation result as its reports show it: a language model's loss (nats per
    token) in its metric, "val bpc 1.234" or "val perplexity 56.7"; others as recorded."""
    metric = record["result"].get("metric")
    if key == "val_loss" and metric in ("bpc", "perplexity"):
        from .lm_scoring import report_metric

        return f"val {metric} {report_metric(value, metric):.4g}"
    return f"{key} {value:.4g}"


def _records(out: Path) -> Iterator[dict[str, Any]]:
    """The sweep's readable records; a damaged one is skipped here (`--resume` names it)."""
    for path in sorted((out / "records").glob("*.json")):
        try:
            record = read_json(path)
        except (CorruptFileError, OSError):
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("id"), str)
            and all(isinstance(record.get(key), dict) for key in ("config", "result"))
        ):
            yield record


def best_run(out: str | Path, experiment: str | None = None) -> tuple[Path, str, int]:
    """(run folder, a line naming it, how many runs it was chosen from) for the best finished
    run of the sweep folder `out`; FileNotFoundError when it holds none with a checkpoint,
    SweepChoiceError (listing them) when its runs are on different data."""
    out = Path(out)
    records = list(_records(out))
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
        raise FileNotFoundError(f"{out}: no finished {what}run with a checkpoint under runs/")
    if len(groups) == 1:
        (candidates,) = groups.values()
        _, run_id, run_dir, key, value, record = min(candidates)
        on = _data_label(record["config"], labels)
        result = _result_text(key, value, record)
        note = f"using run {run_id} ({result}, the best of {len(candidates)} on {on})"
        return run_dir, note, len(candidates)
    best = sorted(
        (min(c) for c in groups.values()), key=lambda c: c[5].get("finished", ""), reverse=True
    )
    runs = "; ".join(
        f"{run_dir} ({_data_label(record['config'], labels)}, finished "
        f"{record.get('finished', '?')}, {_result_text(key, value, record)})"
        for _, _, run_dir, key, value, record in best
    )
    raise SweepChoiceError(
        f"{out} holds runs on {len(best)} different data (files, targets or splits), whose "
        f"validation results do not compare; name one run folder: {runs}"
    )
