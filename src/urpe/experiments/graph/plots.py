"""Figures for `urpe reproduce graph`: validation curves (curves.png) and URPE's learned gate C
against the shortest-path distance, per head and layer (gate.png)."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from .report import VARIANT_ORDER, variant_rank  # noqa: E402

COLOURS = {"graphormer": "tab:blue", "graphormer-urpe": "tab:red"}


def curves_chart(table: list[dict], path: Path) -> None:
    """Validation MAE against updates, one panel per dataset and target: each seed faint, the
    mean over seeds bold (steps where every seed has a value)."""
    panels = list(dict.fromkeys((row["dataset"], row["target"]) for row in table))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        rows = [r for r in table if (r["dataset"], r["target"]) == panel and r["curve"]]
        variants = sorted({r["variant"] for r in rows}, key=variant_rank)
        for variant in variants:
            colour = COLOURS.get(variant)
            runs = [r for r in rows if r["variant"] == variant]
            for run in runs:
                steps, values = zip(*run["curve"], strict=True)
                ax.plot(steps, values, color=colour, alpha=0.25, linewidth=1)
            common = set.intersection(*(set(s for s, _ in r["curve"]) for r in runs))
            steps = sorted(common)
            means = [sum(dict(map(tuple, r["curve"]))[s] for r in runs) / len(runs) for s in steps]
            ax.plot(
                steps, means, color=colour, linewidth=2, label=f"{variant} (mean of {len(runs)})"
            )
        unit = rows[0]["unit"] if rows else ""
        ax.set_title(f"{rows[0]['data']}, {panel[1]}" if rows else panel[0])
        ax.set_xlabel("updates")
        ax.set_ylabel(f"validation MAE ({unit})" if unit else "validation MAE")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def relation_labels(num_relations: int) -> list[str]:
    """Names of the relation index's columns (see `urpe.graph.relation_index`)."""
    max_distance = num_relations - 4
    return [str(d) for d in range(max_distance + 1)] + ["far", "unreach.", "token"]


def gate_chart(gates: torch.Tensor, title: str, path: Path) -> None:
    """gates: (layers, H, R) learned C; one panel per layer, one line per head, x = relation
    (SPD 0..D, far, unreachable, graph token); the initial value 1 dashed."""
    layers, heads, relations = gates.shape
    columns = min(layers, 4)
    rows = (layers + columns - 1) // columns
    fig, axes = plt.subplots(
        rows, columns, figsize=(3.6 * columns, 2.8 * rows), squeeze=False, sharey=True
    )
    labels = relation_labels(relations)
    xs = list(range(relations))
    colours = plt.get_cmap("viridis")
    for layer in range(rows * columns):
        ax = axes[layer // columns, layer % columns]
        if layer >= layers:
            ax.axis("off")
            continue
        for head in range(heads):
            ax.plot(
                xs,
                gates[layer, head].tolist(),
                marker=".",
                linewidth=1,
                color=colours(head / max(1, heads - 1)),
                label=f"head {head}",
            )
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("shortest-path distance", fontsize=8)
        ax.set_ylabel("C (multiplies the softmax)", fontsize=8)
        ax.set_xticks(xs[::2] + ([xs[-1]] if (len(xs) - 1) % 2 else []))
        ax.set_xticklabels(
            [labels[x] for x in ax.get_xticks().astype(int)], fontsize=6, rotation=90
        )
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["VARIANT_ORDER", "curves_chart", "gate_chart", "relation_labels"]


def figures(records: list[dict], table: list[dict], out: Path) -> list[Path]:
    """curves.png, and the learned gate C of the first URPE run (gate.png)."""
    from safetensors.torch import load_file

    written = [out / "curves.png"]
    curves_chart(table, written[0])
    urpe_runs = sorted(
        (r for r in table if r["variant"] == "graphormer-urpe"),
        key=lambda r: (r["dataset"], r["seed"]),
    )
    for row in urpe_runs[:1]:
        path = out / "records" / f"{row['id']}.safetensors"
        try:
            gates = load_file(str(path))["C"]
        except Exception as error:  # a missing or damaged file costs the figure, not the report
            print(f"urpe reproduce graph: no gate figure from {path}: {error}", file=sys.stderr)
            continue
        title = (
            f"learned C (after softmax) per layer and head, against shortest-path distance: "
            f"{row['data']}, {row['target']}, seed {row['seed']}, test MAE {row['test_mae']:.4f}"
        )
        written.append(out / "gate.png")
        gate_chart(gates.float(), title, written[-1])
    return written
