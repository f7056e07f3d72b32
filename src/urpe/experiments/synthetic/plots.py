"""Figures in the style of the paper: accuracy bars per task (one group per vocabulary size, as
its Figure 1) and heatmaps of the learned B and C (its Figure 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from .report import row_labels, summarize, table_columns  # noqa: E402
from .variants import VARIANTS  # noqa: E402

TASK_TITLES = {"pi": "Position Identification", "etp": "Even Token Prediction", "probe": "Probe"}


def accuracy_chart(records: list[dict], path: Path) -> None:
    """One panel per task; bars per variant, one colour per vocabulary size; sd as error bars
    when there are several seeds; chance as a dashed line."""
    summary = summarize(records)
    columns = table_columns(summary)
    variants = row_labels(summary)
    tasks = list(dict.fromkeys(c[0] for c in columns))
    fig, axes = plt.subplots(
        len(tasks),
        1,
        figsize=(max(6.0, 0.55 * len(variants) + 2), 2.8 * len(tasks)),
        squeeze=False,
    )
    colours = plt.get_cmap("tab10").colors
    for ax, task in zip(axes[:, 0], tasks, strict=True):
        task_columns = [c for c in columns if c[0] == task]
        width = 0.8 / len(task_columns)
        for j, (_, vocab, length, steps) in enumerate(task_columns):
            xs, means, sds = [], [], []
            for i, variant in enumerate(variants):
                s = summary.get((variant, task, vocab, length, steps))
                if s is not None:
                    xs.append(i + (j - (len(task_columns) - 1) / 2) * width)
                    means.append(s["mean"])
                    sds.append(s["sd"])
            ax.bar(
                xs,
                means,
                width,
                yerr=sds,
                capsize=2,
                color=colours[j % 10],
                label=f"vocab {vocab}",
                edgecolor="black",
                linewidth=0.4,
            )
            chance = next(
                s["chance"] for k, s in summary.items() if k[1:] == (task, vocab, length, steps)
            )
            ax.axhline(chance, color=colours[j % 10], linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(variants)), variants, rotation=45, ha="right")
        ax.set_xlabel("variant")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("held-out accuracy")
        length = task_columns[0][2]
        ax.set_title(f"{TASK_TITLES.get(task, task)} (L={length}; dashed: chance)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        if len(task_columns) > 1 or task == tasks[0]:
            ax.legend(fontsize=8, loc="upper left", ncols=len(task_columns))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The colour bar's label of each learned matrix: what its entry at (i, j) does.
MATRIX_MEANINGS = {"B": "B[i, j], added to the logits", "C": "C[i, j], multiplies the softmax"}
OFFSETS_NOTE = (
    "rows: query i, columns: key j; each diagonal is one offset j - i (dotted: j = i); "
    "above it j - i > 0 (keys after the query), below it j - i < 0 (keys before it)"
)


def _mark_diagonal(ax, n: int) -> None:
    """The main diagonal j = i, dotted (the image keeps its extent)."""
    limits = ax.get_xlim(), ax.get_ylim()
    ax.plot([0, n - 1], [0, n - 1], color="white", linestyle=":", linewidth=0.8)
    ax.set_xlim(limits[0])
    ax.set_ylim(limits[1])


# Panels per row of the learned-matrix figure: two keep it about 800 px wide, so that at the
# width of a documentation page (about 740 px) its smallest text still shows at 9 px or more.
HEATMAP_COLUMNS = 2


def learned_matrices_chart(
    matrices: dict[str, torch.Tensor], title: str, path: Path, max_heads: int = 4
) -> None:
    """matrices: {"B": (H, L, L), "C": (H, L, L)} (either may be missing). Each matrix's heads
    (up to max_heads) in rows of `HEATMAP_COLUMNS` panels; rows are queries i, columns keys j,
    both counted from the first token; each panel dots the diagonal j = i, and the title says
    on which side the offset j - i is positive."""
    import textwrap

    from matplotlib.ticker import MaxNLocator

    names = [n for n in ("B", "C") if matrices.get(n) is not None]
    if not names:
        return
    heads = min(max_heads, max(matrices[n].shape[0] for n in names))
    columns = min(heads, HEATMAP_COLUMNS)
    rows_per_matrix = -(-heads // columns)
    rows = len(names) * rows_per_matrix
    fig, axes = plt.subplots(
        rows, columns, figsize=(3.3 * columns + 0.4, 3.0 * rows + 1.0), squeeze=False
    )
    used = set()
    for r, name in enumerate(names):
        m = matrices[name].float()
        for h in range(heads):
            ax = axes[r * rows_per_matrix + h // columns, h % columns]
            used.add(ax)
            image = ax.imshow(m[h].numpy(), cmap="viridis")
            ax.set_title(f"{name}, head {h}", fontsize=10)
            ax.set_xlabel("key j", fontsize=9)
            ax.set_ylabel("query i", fontsize=9)
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(MaxNLocator(nbins=5, integer=True))
            ax.tick_params(labelsize=8)
            _mark_diagonal(ax, m.shape[-1])
            bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
            bar.set_label(MATRIX_MEANINGS[name], fontsize=8)
            bar.ax.tick_params(labelsize=8)
    for ax in set(axes.flat) - used:  # an odd number of heads leaves a slot empty
        fig.delaxes(ax)
    lines = [*textwrap.wrap(title, 80), *OFFSETS_NOTE.split("; ")]
    fig.suptitle("\n".join(lines), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_curve(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """A run's learning curve from its Lightning log (`run_dir/logs/metrics.csv`):
    {"train/acc": [(step, acc)], "val/acc": [...], "train/loss": [...], "val/loss": [...]}."""
    import csv

    curve: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "logs" / "metrics.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            for key in ("train/acc", "val/acc", "train/loss", "val/loss"):
                if row.get(key):
                    curve.setdefault(key, []).append((int(row["step"]), float(row[key])))
    return curve


def learning_curves_chart(
    run_dirs: list[Path], path: Path, title: str = "", labels: list[str] | None = None
) -> None:
    """Training accuracy (lines; each point is one logged batch) and held-out accuracy (dots)
    against the update step, one colour per run, labelled with `labels` or else the run's
    folder name without its config digest."""
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    fig, ax = plt.subplots(figsize=(8, 4.2))
    colours = plt.get_cmap("tab10").colors
    for i, run_dir in enumerate(run_dirs):
        curve = read_curve(run_dir)
        label = labels[i] if labels is not None else run_dir.name.rsplit("-", 1)[0]
        colour = colours[i % 10]
        if curve.get("train/acc"):
            steps, values = zip(*curve["train/acc"], strict=True)
            ax.plot(steps, values, color=colour, linewidth=1, label=label)
        if curve.get("val/acc"):
            steps, values = zip(*curve["val/acc"], strict=True)
            ax.plot(steps, values, "o", color=colour, markersize=4)
    ax.set_xlabel("update")
    ax.set_ylabel("accuracy (line: training batch; dots: held-out)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # runs shorter than one log interval have no line
        ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figures(records: list[dict], table: list[dict], out: Path) -> list[Path]:
    """accuracy.png, and URPE's learned B and C per task (Figure 2 of the paper)."""
    from safetensors.torch import load_file

    written = [out / "accuracy.png"]
    accuracy_chart(table, written[0])
    # Figure 2 of the paper shows URPE's B and C: take urpe (else any gated variant), lowest
    # seed, first vocabulary, per task.
    order = ["urpe"] + [v for v in VARIANTS if v != "urpe"]
    for task in dict.fromkeys(r["task"] for r in table):
        for variant in order:
            runs = sorted(
                (r for r in table if r["task"] == task and r["variant"] == variant),
                key=lambda r: (r["vocab_size"], r["seed"]),
            )
            path = out / "records" / f"{runs[0]['id']}.safetensors" if runs else None
            if path is None or not path.exists():
                continue
            try:
                matrices = load_file(str(path))
            except Exception as error:  # a damaged file costs the figure, not the report
                print(f"urpe reproduce synthetic: skipping {path}: {error}", file=sys.stderr)
                continue
            if matrices.get("C") is None:
                continue
            r = runs[0]
            config = next(rec["config"] for rec in records if rec["id"] == r["id"])
            shared = config["model"]["transformer"].get("share_position", True)
            where = "shared by all layers" if shared else "of the first layer (one pair per layer)"
            title = (
                f"learned B (before softmax) and C (after softmax), {where}: "
                f"{task}, {variant}, V={r['vocab_size']}, L={r['seq_len']}, seed {r['seed']}, "
                f"accuracy {r['accuracy']:.3f}"
            )
            written.append(out / f"learned_BC_{task}.png")
            learned_matrices_chart(matrices, title, written[-1])
            break
    return written
