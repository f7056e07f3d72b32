"""Turn run records into the table (markdown, printed), the claims check and results.json.

`rows(records)` flattens the runner's records into one row per run: task, variant, seed,
vocab_size, seq_len, steps, params, accuracy, loss, chance, seconds, id, and `label`. Several
seeds become mean ± sd only when every other setting is the same: settings that differ between
runs of one cell (say `--dim 16` and `--dim 64` in one folder) are named in the row label
("urpe (model.transformer.dim=64)"), so such runs are never averaged together.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from .variants import VARIANTS

# The paper's accuracies (its bar charts, about ±0.01) at length 128: (task, variant, vocab).
PAPER: dict[tuple[str, str, int], float] = {}
for _vocab, _pi, _etp in (
    (10, (0.07, 0.13), (0.58,)),
    (1000, (0.06, 0.11), (0.54,)),
    (10000, (0.05, 0.10), (0.52,)),
):
    PAPER[("pi", "nope", _vocab)], PAPER[("pi", "rpe", _vocab)] = _pi
    PAPER[("pi", "urpe", _vocab)] = 1.00
    PAPER[("etp", "nope", _vocab)], PAPER[("etp", "rpe", _vocab)] = 0.50, _etp[0]
    PAPER[("etp", "urpe", _vocab)] = 1.00

# The claims, checked on every table: (tasks, variants, test, wording).
PASS, NEAR_CHANCE_MARGIN = 0.95, 0.05
POSITION_PASSERS = ("urpe", "ape", "shaw", "exp", "l2", "relu2", "anchors")
POSITION_FAILERS = ("nope", "rpe", "t5", "alibi", "rope")


# Config entries that the table's rows and columns already show, or that follow from them.
_SHOWN = {
    "experiment",
    "task",
    "variant",
    "vocab_size",
    "seq_len",
    "seed",
    "train.steps",
    "optim.total_steps",
    "model.num_classes",
    "model.transformer.vocab_size",
    "model.transformer.max_len",
}
_SET_BY_VARIANTS = {f"model.transformer.{name}" for v in VARIANTS.values() for name in v.changes}


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists become JSON text (hashable)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else value
    return out


def settings(config: dict) -> dict[str, Any]:
    """The settings of a run that its row and column do not show."""
    return {
        k: v for k, v in flatten(config).items() if k not in _SHOWN and k not in _SET_BY_VARIANTS
    }


def _cell_of(config: dict) -> tuple:
    return (
        config["variant"],
        config["task"],
        config["vocab_size"],
        config["seq_len"],
        config["train"]["steps"],
    )


def rows(records: list[dict]) -> list[dict]:
    """One flat row per record, labelled by the settings that differ within its cell."""
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        by_cell[_cell_of(r["config"])].append(settings(r["config"]))
    differing = set()
    for group in by_cell.values():
        for key in set().union(*group):
            if len({json.dumps(s.get(key)) for s in group}) > 1:
                differing.add(key)
    out = []
    for r in records:
        c, result = r["config"], r["result"]
        own = settings(c)
        suffix = ", ".join(f"{k}={own.get(k)}" for k in sorted(differing))
        out.append(
            dict(
                task=c["task"],
                variant=c["variant"],
                seed=c["seed"],
                vocab_size=c["vocab_size"],
                seq_len=c["seq_len"],
                steps=c["train"]["steps"],
                params=result["params"],
                accuracy=result["accuracy"],
                loss=result.get("loss"),
                chance=result["chance"],
                seconds=r.get("seconds", 0.0),
                id=r["id"],
                label=f"{c['variant']} ({suffix})" if suffix else c["variant"],
            )
        )
    return out


def common_settings(records: list[dict]) -> dict[str, Any]:
    """Settings with one value across all records (for the report's header)."""
    all_settings = [settings(r["config"]) for r in records]
    if not all_settings:
        return {}
    first = all_settings[0]
    return {k: v for k, v in first.items() if all(s.get(k, None) == v for s in all_settings)}


def group_key(r: dict) -> tuple:
    return (r.get("label", r["variant"]), r["task"], r["vocab_size"], r["seq_len"], r["steps"])


def summarize(records: list[dict]) -> dict[tuple, dict]:
    """(row label, task, vocab, length, steps) -> mean, sd (0 for one seed), n, seeds, chance,
    seconds, params, variant. `records` are `rows(...)` (flat dicts)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[group_key(r)].append(r)
    summary = {}
    for key, runs in groups.items():
        accs = [r["accuracy"] for r in runs]
        summary[key] = {
            "mean": statistics.fmean(accs),
            "sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "n": len(accs),
            "seeds": sorted(r["seed"] for r in runs),
            "chance": runs[0]["chance"],
            "seconds": statistics.fmean(r["seconds"] for r in runs),
            "params": runs[0]["params"],
            "variant": runs[0]["variant"],
        }
    return summary


def table_columns(summary: dict) -> list[tuple[str, int, int, int]]:
    """(task, vocab, length, steps) in task order of first appearance."""
    order = {"pi": 0, "etp": 1, "probe": 2}
    cols = {(k[1], k[2], k[3], k[4]) for k in summary}
    return sorted(cols, key=lambda c: (order.get(c[0], 9), c[0], c[1], c[2], c[3]))


def row_labels(summary: dict) -> list[str]:
    """Row labels, in the registry's variant order, then by label."""
    order = {name: i for i, name in enumerate(VARIANTS)}
    labels = {k[0]: s["variant"] for k, s in summary.items()}
    return sorted(labels, key=lambda label: (order.get(labels[label], len(order)), label))


def claims(summary: dict) -> list[dict]:
    """Every claim of the issue that this table can test, with the numbers and whether it held."""
    out = []
    for (label, task, vocab, length, steps), s in sorted(summary.items()):
        mean, chance, variant = s["mean"], s["chance"], s["variant"]
        claim = None
        if task in ("pi", "probe") and variant in POSITION_PASSERS:
            claim, held = f">= {PASS}", mean >= PASS
        elif task in ("pi", "probe") and variant in POSITION_FAILERS:
            limit = chance + NEAR_CHANCE_MARGIN
            claim, held = f"near chance (<= {limit:.3f})", mean <= limit
        elif task == "etp" and variant == "urpe":
            claim, held = f">= {PASS}", mean >= PASS
        elif task == "etp" and variant == "rpe":
            claim, held = "<= 0.7", mean <= 0.7
        if claim is not None:
            out.append(
                dict(
                    variant=variant,
                    label=label,
                    task=task,
                    vocab_size=vocab,
                    seq_len=length,
                    steps=steps,
                    claim=claim,
                    mean=mean,
                    sd=s["sd"],
                    n=s["n"],
                    held=bool(held),
                )
            )
    return out


def _cell(s: dict | None, paper: float | None, failed: bool) -> str:
    if s is None:
        return ""
    text = f"{s['mean']:.3f}" + (f" ± {s['sd']:.3f} (n={s['n']})" if s["n"] > 1 else "")
    if failed:
        text += " ✗"
    if paper is not None:
        text += f" [paper {paper:.2f}]"
    return text


def markdown_table(records: list[dict]) -> str:
    """Variants as rows, (task, vocab) as columns; mean ± sd over seeds; the paper's values in
    brackets; ✗ marks a cell that breaks the issue's claim."""
    summary = summarize(records)
    columns = table_columns(summary)
    failed = {
        (c["label"], c["task"], c["vocab_size"], c["seq_len"], c["steps"])
        for c in claims(summary)
        if not c["held"]
    }
    head = ["variant", "breaks row sum"] + [
        f"{t} (V={v}, L={n}, {s} steps)" for t, v, n, s in columns
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in row_labels(summary):
        variant = next(s["variant"] for k, s in summary.items() if k[0] == label)
        known = VARIANTS.get(variant)  # a record from another urpe may name an unknown one
        theory = "?" if known is None else "yes" if known.breaks_row_sum else "no"
        row = [label, theory]
        for task, vocab, length, steps in columns:
            key = (label, task, vocab, length, steps)
            row.append(_cell(summary.get(key), PAPER.get((task, variant, vocab)), key in failed))
        lines.append("| " + " | ".join(row) + " |")
    chance = ["chance", ""] + [
        f"{next(s['chance'] for k, s in summary.items() if k[1:] == c):.3f}" for c in columns
    ]
    lines.append("| " + " | ".join(chance) + " |")
    return "\n".join(lines)


def claims_markdown(records: list[dict]) -> str:
    rows = claims(summarize(records))
    if not rows:
        return "No claim of the issue applies to these runs."
    lines = ["| claim | task | variant | V | accuracy | held |", "|---|---|---|---|---|---|"]
    for c in rows:
        acc = f"{c['mean']:.3f}" + (f" ± {c['sd']:.3f}" if c["n"] > 1 else "")
        lines.append(
            f"| {c['claim']} | {c['task']} | {c['label']} | {c['vocab_size']} | "
            f"{acc} | {'yes' if c['held'] else '**no**'} |"
        )
    held = sum(c["held"] for c in rows)
    lines.append(f"\n{held} of {len(rows)} claims held.")
    return "\n".join(lines)


def write_report(records: list[dict], out_dir: Path, wall_seconds: float) -> str:
    """Write results.json (one flat row per run, with its full record beside) and results.md;
    return the markdown. `records`: the runner's records."""
    from ...files import atomic_write_json, atomic_write_text

    table = rows(records)
    order = sorted(
        range(len(table)),
        key=lambda i: (
            table[i]["task"],
            table[i]["label"],
            table[i]["vocab_size"],
            table[i]["seed"],
        ),
    )
    atomic_write_json(out_dir / "results.json", [{**table[i], "record": records[i]} for i in order])
    total = sum(r["seconds"] for r in table)
    common = common_settings(records)
    settings_text = ", ".join(
        f"{k.removeprefix('model.transformer.')}={v}" for k, v in common.items()
    )
    text = "\n\n".join(
        [
            "# Synthetic tasks: token accuracy on held-out batches",
            f"Settings shared by every run: {settings_text}.",
            markdown_table(table),
            "Cells: mean ± sd over seeds (n = number of seeds; one seed shows the value alone). "
            "[paper x]: the paper's value read off its bar charts (about ±0.01), at length 128 and "
            "40k steps, not measured here. ✗: the issue's claim for this cell did not hold. "
            "A row label in parentheses names settings that differ between runs of one cell.",
            "## Claims",
            claims_markdown(table),
            f"{len(table)} runs, {total:.0f} s of training and evaluation in total; this command's "
            f"wall time {wall_seconds:.0f} s.",
        ]
    )
    atomic_write_text(out_dir / "results.md", text + "\n")
    return text
