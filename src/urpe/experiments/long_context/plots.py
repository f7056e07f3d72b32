"""The pictures of a long-context evaluation (matplotlib, no display), from results.json's data:

- accuracy.png: accuracy against context length, one panel per task (and perplexity against
  length, one panel per corpus), one line per variant; a gated variant (+urpe) is drawn dashed
  in its base's colour; dotted: chance and the training length;
- needle_<task>.png for passkey, needle and multikey: per variant a heatmap of accuracy by
  context length (columns) and needle depth (rows), each cell labelled.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .report import length_value, lengths_of, variant_order

PANEL = 3.4  # inches per panel


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    """One colour per base encoding, dashed for its gated variant."""
    import matplotlib

    palette = matplotlib.colormaps["tab20"].colors[::2] + matplotlib.colormaps["tab20"].colors[1::2]
    bases: dict[str, int] = {}
    out = {}
    for label in labels:
        name = label.split(" (")[0]
        gated = name.endswith("+urpe") or name == "urpe"
        base = "rpe" if name == "urpe" else name.removesuffix("+urpe")
        index = bases.setdefault(base, len(bases))
        out[label] = {
            "color": palette[index % len(palette)],
            "linestyle": "--" if gated else "-",
            "marker": "s" if gated else "o",
        }
    return out


def accuracy_chart(results: dict[str, Any], path: Path, title: str) -> None:
    plt = _pyplot()
    tasks = list(results["results"])
    columns = min(3, len(tasks))
    rows = math.ceil(len(tasks) / columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(PANEL * columns + 2.2, PANEL * rows + 0.6), squeeze=False
    )
    order = variant_order(results)
    styles = _styles(order)
    trained = sorted(set(results["training_length"].values()))
    for ax, task in zip(axes.flat, tasks, strict=False):
        metric = results["metric"][task]
        lengths = [int(n) for n in lengths_of(results, task)]
        for label in order:
            cells = results["results"][task].get(label)
            if cells is None:
                continue
            points = [(n, length_value(cells.get(str(n)))) for n in lengths]
            points = [(n, v) for n, v in points if v is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=label, markersize=4, linewidth=1.4, **styles[label])
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        for length in trained:
            ax.axvline(length, color="grey", linestyle=":", linewidth=1)
        if metric == "accuracy":
            ax.axhline(results["chance"][task], color="black", linestyle=":", linewidth=1)
            ax.set_ylim(-0.03, 1.03)
            ax.set_ylabel("accuracy")
        else:
            _perplexity_axis(ax)
        ax.set_title(task, fontsize=11)
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    spare = list(axes.flat)[len(tasks) :]
    for ax in spare:
        ax.axis("off")
    handles, names = [], []
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            if name not in names:
                handles.append(handle)
                names.append(name)
    if spare:  # the legend in the first empty panel
        spare[0].legend(handles, names, loc="center", fontsize=9, ncol=1 + len(names) // 9)
    else:
        fig.legend(handles, names, loc="center right", fontsize=9, frameon=False)
    fig.suptitle(
        f"{title}\ndotted: chance (horizontal) and training length (vertical); "
        "dashed: with URPE's gate",
        fontsize=11,
    )
    right = 1 if spare else 1 - 2.0 / fig.get_figwidth()
    fig.tight_layout(rect=(0, 0, right, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _perplexity_axis(ax) -> None:
    """Log scale where perplexities differ by more than 4x (a blow-up past the training
    length), linear otherwise; plain numbers either way."""
    from matplotlib.ticker import FuncFormatter

    values = [
        y
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
        for y in line.get_ydata()
    ]
    if values and max(values) > 4 * min(values):
        ax.set_yscale("log")

        def minor(y: float, _) -> str:  # 2x and 5x of each power of ten
            mantissa = y / 10 ** math.floor(math.log10(y))
            return f"{y:.3g}" if round(mantissa) in (2, 5) else ""

        ax.yaxis.set_minor_formatter(FuncFormatter(minor))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.4g}"))
    else:
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax.set_ylabel("perplexity per token")


def needle_chart(results: dict[str, Any], task: str, path: Path, title: str) -> None:
    """Per variant: accuracy by length (x) and depth (y), one labelled cell each."""
    import numpy as np

    plt = _pyplot()
    cells = results["results"][task]
    order = [label for label in variant_order(results) if label in cells]
    lengths = lengths_of(results, task)
    depths = sorted(
        {d for label in order for cell in cells[label].values() if cell for d in cell}, key=float
    )
    columns = min(4, len(order))
    rows = math.ceil(len(order) / columns)
    width = max(2.6, 0.62 * len(lengths) + 1.2)
    height = max(2.2, 0.34 * len(depths) + 1.1)
    fig, axes = plt.subplots(
        rows, columns, figsize=(width * columns + 1.2, height * rows + 0.8), squeeze=False
    )
    image = None
    for ax, label in zip(axes.flat, order, strict=False):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for j, n in enumerate(lengths):
            cell = cells[label].get(n) or {}
            for i, d in enumerate(depths):
                if cell.get(d) is not None:
                    grid[i, j] = cell[d]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="upper")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                value = grid[i, j]
                text = "n/a" if np.isnan(value) else f"{value:.2f}".removeprefix("0")
                colour = "black" if np.isnan(value) or value >= 0.6 else "white"
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color=colour)
        ax.set_xticks(range(len(lengths)), lengths, fontsize=7)
        ax.set_yticks(range(len(depths)), depths, fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("context length", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
        ax.set_facecolor("lightgrey")
    for ax in list(axes.flat)[len(order) :]:
        ax.axis("off")
    fig.suptitle(
        f"{title}: {task}, accuracy by context length and needle depth "
        "(depth 0: at the start, 1: just before the question)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1 - 1.0 / fig.get_figwidth(), 1))
    if image is not None:
        bar = fig.add_axes((1 - 0.8 / fig.get_figwidth(), 0.15, 0.15 / fig.get_figwidth(), 0.7))
        fig.colorbar(image, cax=bar, label="accuracy")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(results: dict[str, Any], out: Path, title: str = "Long-context tasks") -> list[Path]:
    """accuracy.png and needle_<task>.png for every task measured by depth; their paths."""
    out = Path(out)
    written = []
    if results["results"]:
        written.append(out / "accuracy.png")
        accuracy_chart(results, written[-1], title)
    for task, cells in results["results"].items():
        if any(isinstance(cell, dict) for lengths in cells.values() for cell in lengths.values()):
            written.append(out / f"needle_{task}.png")
            needle_chart(results, task, written[-1], title)
    return written
