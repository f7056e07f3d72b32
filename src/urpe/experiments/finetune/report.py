"""results.json, results.md and the figures of `urpe finetune`, from the runner's records. The
rows, the extrapolation tables and both figures are `urpe reproduce lm`'s; the summary table is
this experiment's own (gates, trained parameters)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ...training.lm import report_metric
from ..lm.report import cell, finish_report, mean_sd, rows
from .presets import VARIANTS


def _order(variant: str) -> tuple[int, str]:
    names = list(VARIANTS)
    return (names.index(variant) if variant in names else len(names), variant)


def summary_table(records: list[dict], table: list[dict]) -> str:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(table):
        groups[row["variant"]].append(i)
    metric = table[0]["metric"]
    lines = [
        f"| variant | trained params | gate params | val {metric} before | val {metric} | "
        f"test {metric} | max abs(C - 1) | step time vs base | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = mean_sd([table[i]["step_seconds_median"] for i in groups.get("base", [])])[0]
    for variant in sorted(groups, key=_order):
        runs = [records[i]["result"] for i in groups[variant]]
        speed = mean_sd([table[i]["step_seconds_median"] for i in groups[variant]])[0]
        ratio = "-" if variant == "base" or "base" not in groups else f"{speed / base:.2f}x"
        moved = [r["gate_max_change"] for r in runs if r["gate_max_change"] is not None]
        seeds = ",".join(
            str(table[i]["seed"]) for i in sorted(groups[variant], key=lambda i: table[i]["seed"])
        )
        lines.append(
            f"| {variant} | {runs[0]['trained_params']:,} | {runs[0]['gate_params']:,} | "
            f"{cell([report_metric(r['val_loss_start'], metric) for r in runs])} | "
            f"{cell([table[i]['val'] for i in groups[variant]])} | "
            f"{cell([table[i]['test'] for i in groups[variant]])} | "
            f"{cell(moved) if moved else '-'} | {ratio} | {seeds} |"
        )
    unit = "bits per token" if metric == "bpc" else "perplexity"
    lines.append(f"\nLoss in {unit} ({metric}) at the training length; mean ± sd over seeds.")
    return "\n".join(lines)


def skipped_contexts(records: list[dict], length: int) -> str:
    """The extrapolation contexts runs left out and why (empty when none were)."""
    notes: dict[tuple[int, str], list[str]] = defaultdict(list)
    for r in records:
        for factor, why in r["result"].get("extrapolation_skipped", {}).items():
            notes[(int(factor), why)].append(f"{r['config']['variant']} seed {r['config']['seed']}")
    lines = [
        f"- {factor}x ({factor * length} tokens), {', '.join(runs)}: {why}"
        for (factor, why), runs in sorted(notes.items())
    ]
    return "Contexts left out:\n" + "\n".join(lines) if lines else ""


def write_report(records: list[dict], out: Path, wall_seconds: float) -> tuple[str, list[Path]]:
    from ...files import atomic_write_json

    records = sorted(records, key=lambda r: (_order(r["config"]["variant"]), r["config"]["seed"]))
    table = rows(records)
    atomic_write_json(
        out / "results.json",
        [{**row, "record": record} for row, record in zip(table, records, strict=True)],
    )
    c = records[0]["config"]
    m = c["model"]
    models = sorted(
        {(r["config"]["model"]["path"], r["config"]["model"]["digest"][:12]) for r in records}
    )
    gate_lr = next(
        (r["config"]["gate_lr"] for r in records if r["config"].get("gate_lr")), c["optim"]["lr"]
    )
    settings = (
        f"model {m['class']} from {', '.join(f'{p} (sha256 {d}...)' for p, d in models)}; "
        f"data {c['dataset']}, tokens by the {c['tokens']}; windows of L={m['segment_length']} "
        f"tokens{', packed in one row per batch' if m.get('pack') else ''}, "
        f"{c['train']['steps']} updates of {c['train']['batch_size']} windows, peak lr "
        f"{c['optim']['lr']} (URPE gates: {gate_lr}), warm-up {c['optim']['warmup_steps']}; "
        f"evaluation on the first {c['eval']['tokens'] or 'all'} tokens of each split"
    )
    variants = "\n".join(
        f"- `{name}`: {VARIANTS[name].description}"
        for name in sorted({r["variant"] for r in table}, key=_order)
        if name in VARIANTS
    )
    text = "\n\n".join(
        [
            "# Fine-tuning with and without URPE: loss, gates and length extrapolation",
            f"Settings of the first record: {settings}.",
            variants,
            summary_table(records, table),
            "val before: the model folder's weights (gates at 1) before any update. "
            "max abs(C - 1): how far the trained gates moved from their initial value 1 (largest "
            "entry). Step time vs base: median update time over the base variant's (runs may share "
            "the CPU, so read it as a rough ratio).",
            "## Extrapolation: the same fine-tuned weights at longer contexts",
            "Validation split; columns: context as a multiple of the training length (tokens).",
            *filter(None, [skipped_contexts(records, m["segment_length"])]),
        ]
    )
    return finish_report(text, records, table, out, wall_seconds)
