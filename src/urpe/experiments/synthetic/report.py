"""Turn run records into the table (markdown, printed), the claims check and results.json.

A record is one run: task, variant, seed, vocab_size, seq_len, steps, params, accuracy, chance,
seconds. Several seeds of the same (variant, task, vocab, length, steps) become mean ± sd.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from .variants import VARIANTS

# The paper's accuracies (its bar charts, about ±0.01) at length 128: (task, variant, vocab).
PAPER: dict[tuple[str, str, int], float] = {}
for _vocab, _pi, _etp in ((10, (0.07, 0.13), (0.58,)), (1000, (0.06, 0.11), (0.54,)),
                          (10000, (0.05, 0.10), (0.52,))):  # fmt: skip
    PAPER[("pi", "nope", _vocab)], PAPER[("pi", "rpe", _vocab)] = _pi
    PAPER[("pi", "urpe", _vocab)] = 1.00
    PAPER[("etp", "nope", _vocab)], PAPER[("etp", "rpe", _vocab)] = 0.50, _etp[0]
    PAPER[("etp", "urpe", _vocab)] = 1.00

# The claims, checked on every table: (tasks, variants, test, wording).
PASS, NEAR_CHANCE_MARGIN = 0.95, 0.05
POSITION_PASSERS = ("urpe", "ape", "shaw", "exp", "l2", "relu2", "anchors")
POSITION_FAILERS = ("nope", "rpe", "t5", "alibi", "rope")


def group_key(r: dict) -> tuple:
    return (r["variant"], r["task"], r["vocab_size"], r["seq_len"], r["steps"])


def summarize(records: list[dict]) -> dict[tuple, dict]:
    """(variant, task, vocab, length, steps) -> mean, sd (0 for one seed), n, chance, seconds."""
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
        }
    return summary


def _columns(summary: dict) -> list[tuple[str, int, int, int]]:
    """(task, vocab, length, steps) in task order of first appearance."""
    order = {"pi": 0, "etp": 1, "probe": 2}
    cols = {(k[1], k[2], k[3], k[4]) for k in summary}
    return sorted(cols, key=lambda c: (order.get(c[0], 9), c[0], c[1], c[2], c[3]))


def _variants(summary: dict) -> list[str]:
    present = {k[0] for k in summary}
    return [v for v in VARIANTS if v in present]


def claims(summary: dict) -> list[dict]:
    """Every claim of the issue that this table can test, with the numbers and whether it held."""
    out = []
    for (variant, task, vocab, length, steps), s in sorted(summary.items()):
        mean, chance = s["mean"], s["chance"]
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
            out.append(dict(variant=variant, task=task, vocab_size=vocab, seq_len=length,
                            steps=steps, claim=claim, mean=mean, sd=s["sd"], n=s["n"],
                            held=bool(held)))  # fmt: skip
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
    columns = _columns(summary)
    failed = {(c["variant"], c["task"], c["vocab_size"], c["seq_len"], c["steps"])
              for c in claims(summary) if not c["held"]}  # fmt: skip
    head = ["variant", "breaks row sum"] + [
        f"{t} (V={v}, L={n}, {s} steps)" for t, v, n, s in columns
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant in _variants(summary):
        row = [variant, "yes" if VARIANTS[variant].breaks_row_sum else "no"]
        for task, vocab, length, steps in columns:
            key = (variant, task, vocab, length, steps)
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
        lines.append(f"| {c['claim']} | {c['task']} | {c['variant']} | {c['vocab_size']} | "
                     f"{acc} | {'yes' if c['held'] else '**no**'} |")  # fmt: skip
    held = sum(c["held"] for c in rows)
    lines.append(f"\n{held} of {len(rows)} claims held.")
    return "\n".join(lines)


def write_report(records: list[dict], out_dir: Path, settings: dict, wall_seconds: float) -> str:
    """Write results.json and results.md; return the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = sorted(records, key=lambda r: (r["task"], r["variant"], r["vocab_size"], r["seed"]))
    (out_dir / "results.json").write_text(json.dumps(records, indent=1) + "\n")
    total = sum(r["seconds"] for r in records)
    settings_text = ", ".join(f"{k}={v}" for k, v in settings.items())
    text = "\n\n".join([
        "# Synthetic tasks: token accuracy on held-out batches",
        f"Settings: {settings_text}.",
        markdown_table(records),
        "Cells: mean ± sd over seeds (n = number of seeds; one seed shows the value alone). "
        "[paper x]: the paper's value read off its bar charts (about ±0.01), at length 128 and "
        "40k steps, not measured here. ✗: the issue's claim for this cell did not hold.",
        "## Claims",
        claims_markdown(records),
        f"{len(records)} runs, {total:.0f} s of training and evaluation in total; this command's "
        f"wall time {wall_seconds:.0f} s.",
    ])  # fmt: skip
    (out_dir / "results.md").write_text(text + "\n")
    return text


def load_records(directory: Path) -> list[dict]:
    """Every record in directory/records/*.json (one file per run)."""
    return [json.loads(p.read_text()) for p in sorted((directory / "records").glob("*.json"))]
