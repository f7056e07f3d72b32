"""Tables for `urpe reproduce graph`: results.json and results.md from the records in OUT."""

from __future__ import annotations

import platform
import statistics
from pathlib import Path
from typing import Any

from ...files import atomic_write, atomic_write_json
from ..records import dataset_labels

# The paper's Table (Graphormer + URPE on ZINC): test MAE mean ± sd, parameters.
PAPER = {
    "zinc": {"graphormer": (0.122, 0.006), "graphormer-urpe": (0.086, 0.007)},
    "zinc-full": {"graphormer": (0.052, 0.005), "graphormer-urpe": (0.028, 0.002)},
}
PAPER_PARAMS = {"graphormer": 489_321, "graphormer-urpe": 491_737}
VARIANT_ORDER = ("graphormer", "graphormer-urpe")


def curve_points(record: dict) -> list[list[float]]:
    """[[updates done, val MAE], ...]: the untrained model at 0 (when recorded), then every
    validation. Validations run every `eval_every` updates and at the end, so a logged step s
    (see `experiment.read_curve`) is the next such point at or after s + 1."""
    steps, every = record["config"]["train"]["steps"], record["config"]["train"]["eval_every"]
    r = record["result"]
    points: dict[int, float] = {}
    if r.get("initial_val_mae") is not None:
        points[0] = r["initial_val_mae"]
    for logged, value in r.get("curve", []):
        points[min(steps, -(-(int(logged) + 1) // every) * every)] = value
    return [[step, points[step]] for step in sorted(points)]


def rows(records: list[dict]) -> list[dict]:
    """One flat row per record; a user's file shown by its name (`data`), grouped by content."""
    labels = dataset_labels(record["config"] for record in records)
    out = []
    for record in records:
        c, r = record["config"], record["result"]
        out.append(
            {
                "id": record["id"],
                "dataset": c["dataset"],
                "data": labels[c["dataset"]],
                "data_file": r.get("data_file"),
                "target": c["target"],
                "variant": c["variant"],
                "seed": c["seed"],
                "steps": c["train"]["steps"],
                "model": c["model"]["graphormer"],
                "sizes": r.get("sizes"),
                "unit": r.get("unit"),
                "val_mae": r["val_mae"],
                "test_mae": r["test_mae"],
                "params": r["params"],
                "curve": curve_points(record),
                "seconds": record.get("seconds"),
            }
        )
    return sorted(out, key=lambda row: (row["dataset"], variant_rank(row["variant"]), row["seed"]))


def variant_rank(variant: str) -> int:
    return VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else len(VARIANT_ORDER)


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample sd (None for one value: JSON has no NaN)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else None


def _group_key(row: dict) -> tuple:
    model = row["model"]
    shape = (model["num_layers"], model["dim"], model["ffn_dim"], model["num_heads"])
    return row["dataset"], row["target"], row["steps"], shape, row["variant"]


def summary(table: list[dict]) -> list[dict]:
    """Mean ± sd over seeds per (dataset, target, steps, model shape, variant)."""
    groups: dict[tuple, list[dict]] = {}
    for row in table:
        groups.setdefault(_group_key(row), []).append(row)
    out = []
    for key, members in groups.items():
        dataset, target, steps, shape, variant = key
        test = _mean_sd([m["test_mae"] for m in members])
        val = _mean_sd([m["val_mae"] for m in members])
        out.append(
            {
                "dataset": dataset,
                "target": target,
                "steps": steps,
                "model": dict(
                    zip(("num_layers", "dim", "ffn_dim", "num_heads"), shape, strict=True)
                ),
                "variant": variant,
                "seeds": sorted(m["seed"] for m in members),
                "test_mae": test[0],
                "test_mae_sd": test[1],
                "val_mae": val[0],
                "val_mae_sd": val[1],
                "params": members[0]["params"],
                "unit": members[0]["unit"],
                "sizes": members[0]["sizes"],
                "data": members[0]["data"],
                "data_file": members[0]["data_file"],
                "paper_test_mae": PAPER.get(dataset, {}).get(variant),
            }
        )
    return out


def _fmt(mean: float, sd: float | None) -> str:
    return f"{mean:.4f}" if sd is None else f"{mean:.4f} ± {sd:.4f}"


def _comparisons(groups: list[dict], table: list[dict]) -> list[dict]:
    """URPE minus plain, per setting that has both: the difference of the means, and the
    per-seed (paired: same split, same seed) test MAE differences, their mean ± sd and how many
    seeds URPE won."""
    by_setting: dict[tuple, dict[str, dict]] = {}
    for g in groups:
        setting = (g["dataset"], g["target"], g["steps"], tuple(g["model"].values()))
        by_setting.setdefault(setting, {})[g["variant"]] = g
    out = []
    for setting, variants in by_setting.items():
        plain, urpe = variants.get("graphormer"), variants.get("graphormer-urpe")
        if plain is None or urpe is None:
            continue
        per_seed = {
            (row["variant"], row["seed"]): row["test_mae"]
            for row in table
            if _group_key(row)[:4] == setting
        }
        seeds = sorted(set(plain["seeds"]) & set(urpe["seeds"]))
        paired = [per_seed[("graphormer-urpe", s)] - per_seed[("graphormer", s)] for s in seeds]
        paired_mean, paired_sd = _mean_sd(paired) if paired else (None, None)
        out.append(
            {
                "dataset": setting[0],
                "data": urpe["data"],
                "target": setting[1],
                "paired_seeds": seeds,
                "paired_test_mae_change": paired_mean,
                "paired_test_mae_change_sd": paired_sd,
                "urpe_better_seeds": sum(d < 0 for d in paired),
                "test_mae_change": urpe["test_mae"] - plain["test_mae"],
                "relative_change": (urpe["test_mae"] - plain["test_mae"]) / plain["test_mae"],
                "extra_params": urpe["params"] - plain["params"],
            }
        )
    return out


def _quantity(target: str, unit: str | None) -> str:
    return f"{target} ({unit})" if unit else target


def _sizes(sizes: list[int] | None) -> str:
    return "/".join(map(str, sizes)) if sizes else "-"


def _files(groups: list[dict]) -> list[str]:
    """A line per (user's file, target): its name and digest, rows read, skipped and repeated."""
    lines = []
    for g in groups:
        facts = g["data_file"]
        if not facts:
            continue
        digest = g["dataset"].partition("sha256-")[2]
        repeated = facts["repeated_molecules"]
        lines.append(
            f"- {facts['name']} (sha256 {digest}), target {g['target']}: {facts['rows']} rows, "
            f"{facts['skipped']} skipped (SMILES RDKit cannot read, or no number), train/val/"
            f"test {_sizes(g['sizes'])}"
            + (f"; {repeated} molecule{'s' * (repeated > 1)} on several rows" if repeated else "")
        )
    return list(dict.fromkeys(lines))


def markdown(groups: list[dict], table: list[dict], wall: float) -> str:
    with_paper = any(g["paper_test_mae"] for g in groups)  # ZINC only: not for the user's data
    lines = ["# Graphormer vs Graphormer + URPE", ""]
    lines += [
        "Test and validation MAE (mean ± sd over seeds; L1-trained), in the target's units.",
        "",
        "| dataset | target | model (layers/dim/ffn/heads) | steps | variant | seeds | "
        "train/val/test | val MAE | test MAE | params |"
        + (" paper test MAE (ZINC) |" if with_paper else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_paper else ""),
    ]
    for g in sorted(groups, key=lambda g: (g["dataset"], g["steps"], variant_rank(g["variant"]))):
        m = g["model"]
        paper = g["paper_test_mae"]
        lines.append(
            f"| {g['data']} | {_quantity(g['target'], g['unit'])} | "
            f"{m['num_layers']}/{m['dim']}/{m['ffn_dim']}/{m['num_heads']} | {g['steps']} | "
            f"{g['variant']} | {len(g['seeds'])} | {_sizes(g['sizes'])} | "
            f"{_fmt(g['val_mae'], g['val_mae_sd'])} | {_fmt(g['test_mae'], g['test_mae_sd'])} | "
            f"{g['params']:,} |" + (f" {_fmt(*paper) if paper else '-'} |" if with_paper else "")
        )
    files = _files(groups)
    if files:
        lines += ["", "Your files (a run's data is identified by the file's content):", "", *files]
    comparisons = _comparisons(groups, table)
    if comparisons:
        lines += [
            "",
            "| dataset | target | URPE - plain test MAE | relative | per seed (paired) | "
            f"URPE better | extra parameters{' (paper: +2,416)' if with_paper else ''} |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in comparisons:
            paired = (
                "-"
                if c["paired_test_mae_change"] is None
                else f"{c['paired_test_mae_change']:+.4f}"
                + (
                    ""
                    if c["paired_test_mae_change_sd"] is None
                    else f" ± {c['paired_test_mae_change_sd']:.4f}"
                )
            )
            lines.append(
                f"| {c['data']} | {c['target']} | {c['test_mae_change']:+.4f} | "
                f"{100 * c['relative_change']:+.1f}% | {paired} | "
                f"{c['urpe_better_seeds']} of {len(c['paired_seeds'])} seeds | "
                f"+{c['extra_params']:,} |"
            )
    lines += [
        "",
        "Per run:",
        "",
        "| dataset | target | variant | seed | val MAE | test MAE | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table:
        seconds = f"{row['seconds']:.0f}" if row["seconds"] is not None else "-"
        lines.append(
            f"| {row['data']} | {row['target']} | {row['variant']} | {row['seed']} | "
            f"{row['val_mae']:.4f} | {row['test_mae']:.4f} | {seconds} |"
        )
    lines.append("")
    if with_paper:
        lines.append(
            f"Paper (Graphormer / + URPE): {PAPER_PARAMS['graphormer']:,} / "
            f"{PAPER_PARAMS['graphormer-urpe']:,} parameters; ZINC-subset test MAE "
            "0.122 ± 0.006 / 0.086 ± 0.007, ZINC-full 0.052 ± 0.005 / 0.028 ± 0.002."
        )
    lines += [
        "Run times are in each record (`seconds`) and in the Per run table; "
        f"{'' if wall < 1 else f'this command ran {wall:.0f} s; '}"
        f"built on {platform.machine()} ({platform.system()}).",
    ]
    return "\n".join(lines) + "\n"


def write_report(records: list[dict], out: Path, wall: float) -> str:
    table = rows(records)
    groups = summary(table)
    payload: dict[str, Any] = {
        "summary": groups,
        "comparisons": _comparisons(groups, table),
        "runs": table,
        "paper": {"test_mae": PAPER, "params": PAPER_PARAMS},
    }
    atomic_write_json(out / "results.json", payload)
    text = markdown(groups, table, wall)
    atomic_write(out / "results.md", lambda path: path.write_text(text))
    return text
