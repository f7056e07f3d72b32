"""results.json, results.md and the figures of `urpe reproduce lm`, from the runner's records."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from ...training.lm import report_metric
from ..records import dataset_labels
from .variants import parse_variant

MODES = {
    "chunks": "full context, no memory: consecutive chunks of the context length, each target "
    "sees the earlier tokens of its chunk",
    "sliding": "sliding window, no memory: windows of the context length advancing by half of it, "
    "every target sees at least half a window",
    "memory": "chunks of the context length with the trained memory M carried across chunks "
    "(Transformer-XL evaluation; memory variants only)",
}


def _key(record: dict) -> tuple[str, str]:
    return record["config"]["dataset"], record["config"]["variant"]


def _packed(config: dict) -> bool:
    return "document_separator" in config["train"]


def rows(records: list[dict]) -> list[dict]:
    """One flat row per run; a user's file shown by its name (`dataset_labels`)."""
    labels = dataset_labels(record["config"] for record in records)
    out = []
    for record in records:
        c, r = record["config"], record["result"]
        metric = r["metric"]
        out.append(
            {
                "id": record["id"],
                "variant": c["variant"],
                # Packed runs (--pack) are another training setting: never averaged with the rest.
                "dataset": labels[c["dataset"]] + (" (packed)" if _packed(c) else ""),
                "seed": c["seed"],
                "metric": metric,
                "params": r["params"],
                "val": report_metric(r["val_loss"], metric),
                "test": report_metric(r["test_loss"], metric),
                "val_loss_nats": r["val_loss"],
                "test_loss_nats": r["test_loss"],
                "tokens_per_second": r["tokens_per_second"],
                "step_seconds_median": r["step_seconds_median"],
                "segment_length": c["model"]["segment_length"],
                "memory_length": c["model"]["memory_length"],
                "steps": c["train"]["steps"],
                "extrapolation": {
                    mode: {f: report_metric(v, metric) for f, v in values.items()}
                    for mode, values in r["extrapolation"].items()
                },
                "seconds": record["seconds"],
            }
        )
    return out


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample sd of the finite values (sd None for one; NaN mean for none)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def cell(values: list[float], digits: int = 3) -> str:
    """A table cell: "mean ± sd", "mean" for one value, "n/a" for none."""
    mean, sd = mean_sd(values)
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def _ordered(groups: dict) -> list:
    from .variants import DEFAULT_VARIANTS

    order = {name: i for i, name in enumerate(DEFAULT_VARIANTS)}
    return sorted(groups, key=lambda k: (k[0], order.get(k[1], len(order)), k[1]))


def summary_table(table: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in table:
        groups[(row["dataset"], row["variant"])].append(row)
    metric = table[0]["metric"]
    unit = "bits per token" if metric == "bpc" else "perplexity"
    lines = [
        f"| dataset | variant | M | params | val {metric} | test {metric} | tokens/s | "
        "step time vs base | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    medians = {k: mean_sd([r["step_seconds_median"] for r in v])[0] for k, v in groups.items()}
    for key in _ordered(groups):
        runs = groups[key]
        base = parse_variant(key[1]).base_variant
        ratio = "-"
        if base is not None and (key[0], base) in medians:
            ratio = f"{medians[key] / medians[(key[0], base)]:.2f}x {base}"
        lines.append(
            f"| {key[0]} | {key[1]} | {runs[0]['memory_length']} | {runs[0]['params']:,} | "
            f"{cell([r['val'] for r in runs])} | {cell([r['test'] for r in runs])} | "
            f"{cell([r['tokens_per_second'] for r in runs], 0)} | {ratio} | "
            f"{','.join(str(r['seed']) for r in sorted(runs, key=lambda r: r['seed']))} |"
        )
    lines.append(f"\nLoss in {unit} ({metric}); mean ± sd over seeds.")
    return "\n".join(lines)


def extrapolation_tables(table: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in table:
        groups[(row["dataset"], row["variant"])].append(row)
    factors = sorted({int(f) for r in table for m in r["extrapolation"].values() for f in m})
    parts = []
    for mode, meaning in MODES.items():
        keys = [k for k in _ordered(groups) if any(mode in r["extrapolation"] for r in groups[k])]
        if not keys:
            continue
        head = ["dataset", "variant"] + [
            f"{f}x ({f * table[0]['segment_length']})" for f in factors
        ]
        lines = [
            f"### {mode}: {meaning}",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for key in keys:
            cells = [
                cell([r["extrapolation"].get(mode, {}).get(str(f), math.nan) for r in groups[key]])
                for f in factors
            ]
            lines.append("| " + " | ".join([*key, *cells]) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def write_report(records: list[dict], out_dir: Path, wall_seconds: float) -> tuple[str, list]:
    from ...files import atomic_write_json

    table = rows(records)
    order = sorted(
        range(len(table)),
        key=lambda i: (table[i]["dataset"], table[i]["variant"], table[i]["seed"]),
    )
    atomic_write_json(out_dir / "results.json", [{**table[i], "record": records[i]} for i in order])
    c = records[0]["config"]
    settings = (
        f"segment length L={c['model']['segment_length']}, "
        f"{c['train']['steps']} updates of {c['train']['batch_size']} segments, "
        f"{c['model']['transformer']['num_layers']} layers, "
        f"width {c['model']['transformer']['dim']}, "
        f"{c['model']['transformer']['num_heads']} heads, lr {c['optim']['lr']}, "
        f"evaluation on the first {c['eval']['tokens'] or 'all'} tokens of each split"
    )
    text = "\n\n".join(
        [
            "# Language modelling: loss, throughput and length extrapolation",
            f"Settings of the first record: {settings}.",
            summary_table(table),
            "tokens/s: training tokens per second of wall time, from the median update time of "
            "each run (runs may share the CPU with others, so read ratios, not absolute speeds). "
            "'step time vs base': median update time of a +urpe variant over its variant without "
            "the gate.",
            "## Extrapolation: the same checkpoints at longer contexts",
            "Validation split; loss in the table's metric; columns: context as a multiple of the "
            "training length (tokens).",
        ]
    )
    return finish_report(text, records, table, out_dir, wall_seconds)


def finish_report(
    text: str, records: list[dict], table: list[dict], out_dir: Path, wall_seconds: float
) -> tuple[str, list[Path]]:
    """`text` + the extrapolation tables and totals as results.md, and both figures (also
    `urpe finetune`'s report)."""
    from ...files import atomic_write_text
    from .plots import curves_chart, extrapolation_chart

    total = sum(r["seconds"] for r in table)
    text = "\n\n".join(
        [
            text,
            extrapolation_tables(table),
            f"{len(table)} runs, {total:.0f} s of training and evaluation in total; this command's "
            f"wall time {wall_seconds:.0f} s.",
        ]
    )
    atomic_write_text(out_dir / "results.md", text + "\n")
    figures = [out_dir / "curves.png", out_dir / "extrapolation.png"]
    curves_chart(records, figures[0])
    extrapolation_chart(table, figures[1])
    return text, figures
