"""Learning curves and the extrapolation plot (matplotlib, no display)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ...training.lm import report_metric


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean_lines(ax, points: dict[str, dict[float, list[float]]], colours: dict, **style) -> None:
    """One line per variant through the mean of its values at each x (dashed: with URPE)."""
    for variant in sorted(points):
        xs = sorted(points[variant])
        means = [sum(points[variant][x]) / len(points[variant][x]) for x in xs]
        dashes = "--" if "urpe" in variant else "-"
        ax.plot(xs, means, label=variant, color=colours[variant], linestyle=dashes, **style)


def _colours(variants) -> dict[str, object]:
    """One colour per variant, the same in every panel and figure."""
    import matplotlib

    cycle = matplotlib.colormaps["tab10"]
    return {name: cycle(i % 10) for i, name in enumerate(sorted(set(variants)))}


def curves_chart(records: list[dict], path: Path) -> None:
    """Training and validation loss against updates, per variant (mean over seeds)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    metric = records[0]["result"]["metric"]
    colours = _colours(r["config"]["variant"] for r in records)
    for split, ax in zip(("train", "val"), axes, strict=True):
        series: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for record in records:
            for step, loss in record["result"]["curve"].get(split, []):
                series[record["config"]["variant"]][step].append(report_metric(loss, metric))
        _mean_lines(ax, series, colours)
        ax.set_xlabel("update")
        ax.set_ylabel(metric)
        ax.set_title(f"{split} ({'first 8k validation tokens' if split == 'val' else 'batches'})")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def extrapolation_chart(table: list[dict], path: Path) -> None:
    """Validation loss against context (multiples of L), one panel per evaluation mode."""
    plt = _pyplot()
    modes = [
        m for m in ("chunks", "sliding", "memory") if any(m in r["extrapolation"] for r in table)
    ]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4.5), squeeze=False)
    colours = _colours(r["variant"] for r in table)
    for mode, ax in zip(modes, axes[0], strict=True):
        values: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for row in table:
            for factor, loss in row["extrapolation"].get(mode, {}).items():
                values[row["variant"]][int(factor)].append(loss)
        _mean_lines(ax, values, colours, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context / training length")
        ax.set_ylabel(table[0]["metric"])
        ax.set_title(
            {
                "chunks": "full context, no memory",
                "sliding": "sliding window, no memory",
                "memory": "with memory",
            }[mode]
        )
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)  # the first panel shows every variant
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
