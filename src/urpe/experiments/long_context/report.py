"""results.json and results.md of a long-context evaluation, from the runner's records (`urpe
reproduce long-context`) or from one model's measurement (`urpe evaluate long-context`).

results.json:

    {"results": {task: {variant: {length: value, or {depth: value}}}},   # means over seeds
     "metric": {task: "accuracy" | "perplexity"}, "chance": {task: accuracy},
     "training_length": {variant: L}, "seeds": {variant: [...]},
     "notes": {variant: {what: why}}, "runs": [one line per run]}

A task is a task name ("passkey") or "perplexity/<corpus>"; lengths are token counts and depths
shares of the haystack, as strings; a value is None where the variant cannot read the length.
Runs of one variant whose settings differ (say two --steps in one folder) are told apart in
their label ("rope (train.steps=600)") instead of averaged.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..synthetic.report import flatten

PERPLEXITY = "perplexity/"
# Config entries that name the run's row or follow from its variant or kind.
_SHOWN = {"experiment", "variant", "seed", "kind", "tasks", "dataset", "metric", "locations"}


def _settings(config: dict) -> dict[str, Any]:
    return {
        k: v
        for k, v in flatten(config).items()
        if k.split(".")[0] not in _SHOWN
        and not k.startswith(("model.transformer.", "locations", "data_sha256"))
    }


def labels(records: list[dict]) -> list[str]:
    """Each record's row label: its variant, plus the settings that differ between runs of
    that variant and kind (never the seed)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["config"]["variant"], r["config"]["kind"])].append(_settings(r["config"]))
    differing: dict[tuple, list[str]] = {}
    for key, group in groups.items():
        keys = set().union(*group)
        differing[key] = sorted(k for k in keys if len({json.dumps(s.get(k)) for s in group}) > 1)
    out = []
    for r in records:
        c = r["config"]
        own = _settings(c)
        suffix = ", ".join(f"{k}={own.get(k)}" for k in differing[(c["variant"], c["kind"])])
        out.append(f"{c['variant']} ({suffix})" if suffix else c["variant"])
    return out


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _average(cells: list[Any]) -> Any:
    """The mean of several seeds' cells ({length: value or {depth: value}}), key by key."""
    if isinstance(cells[0], dict):
        return {k: _average([c.get(k) for c in cells if c is not None]) for k in cells[0]}
    return _mean(cells)


def corpus_names(records: list[dict]) -> dict[str, str]:
    from ...training.sweeps import dataset_labels

    return dataset_labels(r["config"] for r in records if r["config"]["kind"] == "text")


def results_of_records(records: list[dict]) -> dict[str, Any]:
    """The report's data (the shape of results.json) from the runner's records."""
    corpora = corpus_names(records)
    by_cell: dict[tuple[str, str], list[Any]] = defaultdict(list)
    out: dict[str, Any] = {
        "results": {},
        "metric": {},
        "chance": {},
        "training_length": {},
        "seeds": defaultdict(list),
        "notes": defaultdict(dict),
        "runs": [],
    }
    for label, record in zip(labels(records), records, strict=True):
        c, r = record["config"], record["result"]
        out["training_length"][label] = c["model"]["segment_length"]
        if c["seed"] not in out["seeds"][label]:
            out["seeds"][label].append(c["seed"])
        out["notes"][label].update(r.get("notes", {}))
        if c["kind"] == "tasks":
            for task, cells in r["accuracy"].items():
                by_cell[(task, label)].append(cells)
                out["metric"][task], out["chance"][task] = "accuracy", r["chance"][task]
        else:
            task = PERPLEXITY + corpora[c["dataset"]]
            by_cell[(task, label)].append(r["perplexity"])
            out["metric"][task] = "perplexity"
        out["runs"].append(
            {
                "id": record["id"],
                "variant": label,
                "kind": c["kind"],
                "seed": c["seed"],
                "seconds": record.get("seconds"),
                "params": r.get("params"),
            }
        )
    for (task, label), cells in by_cell.items():
        out["results"].setdefault(task, {})[label] = _average(cells)
    out["seeds"] = {k: sorted(v) for k, v in out["seeds"].items()}
    out["notes"] = {k: v for k, v in out["notes"].items() if v}
    return out


def length_value(cell: Any) -> float | None:
    """A length's value; for a needle task the mean over depths."""
    return _mean(list(cell.values())) if isinstance(cell, dict) else cell


def lengths_of(results: dict[str, Any], task: str) -> list[str]:
    keys = {length for cells in results["results"][task].values() for length in cells}
    return sorted(keys, key=int)


def _fmt(value: float | None, metric: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if metric == "accuracy" else f"{value:.3g}"


def task_table(results: dict[str, Any], task: str, order: list[str]) -> str:
    """Variants as rows, lengths as columns (needle tasks: the mean over depths)."""
    metric = results["metric"][task]
    lengths = lengths_of(results, task)
    trained = set(results["training_length"].values())
    head = ["variant"] + [f"{n} (L)" if int(n) in trained else n for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells = results["results"][task]
    for label in [v for v in order if v in cells]:
        row = [label] + [_fmt(length_value(cells[label].get(n)), metric) for n in lengths]
        lines.append("| " + " | ".join(row) + " |")
    if metric == "accuracy":
        chance = results["chance"][task]
        lines.append("| chance | " + " | ".join([f"{chance:.2g}"] * len(lengths)) + " |")
    return "\n".join(lines)


def gate_effect(results: dict[str, Any]) -> list[dict[str, Any]]:
    """For each gated variant whose base is in the results: its mean accuracy over every task
    at the training length and beyond it, beside the base's (only cells both can read)."""
    from ..lm.variants import parse_variant

    out = []
    tasks = [t for t, m in results["metric"].items() if m == "accuracy"]
    variants = {label for t in tasks for label in results["results"][t]}
    for label in sorted(variants):
        try:
            variant = parse_variant(label)
        except ValueError:
            continue  # a label with settings, or from another urpe
        base = variant.base_variant
        if base is None or base not in variants:
            continue
        length = results["training_length"][label]
        pairs: dict[str, list[tuple[float, float]]] = {"at L": [], "beyond L": []}
        for task in tasks:
            cells = results["results"][task]
            for n in set(cells.get(label, {})) & set(cells.get(base, {})):
                gated, plain = length_value(cells[label][n]), length_value(cells[base][n])
                if gated is not None and plain is not None:
                    pairs["at L" if int(n) == length else "beyond L"].append((plain, gated))
        if pairs["at L"]:
            row = {"variant": label, "base": base}
            for where, values in pairs.items():
                row[where] = (
                    tuple(statistics.fmean(v[i] for v in values) for i in (0, 1))
                    if values
                    else None
                )
            out.append(row)
    return out


def gate_markdown(results: dict[str, Any]) -> str:
    rows = gate_effect(results)
    if not rows:
        return "No gated variant ran beside its base."
    lines = [
        "| gated variant | base | at L: base → gated | beyond L: base → gated |",
        "|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            "n/a" if r[w] is None else f"{r[w][0]:.3f} → {r[w][1]:.3f} ({r[w][1] - r[w][0]:+.3f})"
            for w in ("at L", "beyond L")
        ]
        lines.append(f"| {r['variant']} | {r['base']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def variant_order(results: dict[str, Any]) -> list[str]:
    """Labels by encoding (the order of `urpe.experiments.lm.variants.BASES`), each base
    before its gated variant; labels that name no variant (a model folder) last."""
    from ..lm.variants import BASES, parse_variant

    order = list(BASES)

    def key(label: str) -> tuple:
        try:
            variant = parse_variant(label.split(" (")[0])
        except ValueError:
            return (len(order), 0, label)
        return (order.index(variant.base), variant.gate, label)

    labels = {label for cells in results["results"].values() for label in cells}
    return sorted(labels, key=key)


def markdown(results: dict[str, Any], title: str, footer: str = "") -> str:
    order = variant_order(results)
    parts = [f"# {title}"]
    accuracy = [t for t, m in results["metric"].items() if m == "accuracy"]
    if accuracy:
        parts.append(
            "Accuracy: the share of answers right in every token (teacher forcing: equal to "
            "greedy decoding), at each context length in tokens; (L) marks the training "
            "length. Needle tasks (passkey, needle, multikey): the mean over needle depths "
            "(the heatmaps show each depth). n/a: the model cannot read that length, or the "
            "task does not fit in it (see Not measured)."
        )
    for task in results["results"]:
        parts += [f"## {task}", task_table(results, task, order)]
    if accuracy:
        parts += [
            "## URPE's gate against its base",
            "Mean accuracy over every task above, at the training length and beyond it.",
            gate_markdown(results),
        ]
    notes = results.get("notes", {})
    if notes:
        lines = [
            f"- {label}: {what}: {why}" for label, n in notes.items() for what, why in n.items()
        ]
        parts += ["## Not measured", "\n".join(lines)]
    if footer:
        parts.append(footer)
    return "\n\n".join(parts)


def write_results(
    results: dict[str, Any], out: Path, wall_seconds: float, records: list[dict] | None = None
) -> str:
    """Write results.json and results.md into `out`; return the markdown."""
    from ...files import atomic_write_json, atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    footer = f"This command's wall time: {wall_seconds:.0f} s."
    if records:
        total = sum(r.get("seconds", 0.0) for r in records)
        footer = f"{len(records)} runs, {total:.0f} s of training and evaluation. " + footer
    text = markdown(results, "How far each encoding reaches: long-context tasks", footer)
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "results.md", text + "\n")
    return text
