"""The model section of BENCHMARKS.md (the model benchmark), written from the results of one
run (what `model.json` holds), between markers so that the rest of the file stays."""

from __future__ import annotations

from .model_targets import condition_label
from .report import MET, fmt, malloc_note, table
from .sections import MODEL

TITLE = "## URPE in a model: decoding calls, generation, whole steps (issue 28)"


def _load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def _header(results: dict) -> list[str]:
    m = results["machine"]
    busy = f" (a child process spinning on core {results['busy_core']})"
    return [
        f"Measured {results['date']} on {m['cpu']} ({m['cores']} cores, {m['threads']} torch "
        f"threads, {m['capability']}), torch {m['torch']}, transformers "
        f"{m.get('transformers') or 'not installed'}, Python {m['python']}{malloc_note(m)}. "
        "Load average at "
        f"start {_load(results['load_start'])}, at end {_load(m['load_average'])}.",
        "",
        f"Command: `{results['command']}` ({results['sizes_name']} sizes). CPU, eager unless "
        "stated. Every group is built once, then timed idle and with one core busy"
        f"{busy if results['busy_core'] is not None else ''}; times are medians of "
        f"{results['repeats']} repeats, the rows of a case interleaved in each repeat, and "
        "every ratio divides by the group's baseline measured in the same case and condition."
        + _processes(results.get("processes", 1)),
    ]


def _processes(count: int) -> str:
    if count == 1:
        return ""
    return (
        f" The whole run was made in {count} fresh processes, one after another: each figure "
        f"is the median of the {count} processes' own, their range in brackets in the targets "
        'table (benchmarks/README.md, "One process is one draw").'
    )


def spread(target: dict, label: str) -> str:
    """The range of a target's value over fresh processes as " (lowest to highest)", or ""."""
    low_high = target.get("ranges", {}).get(label)
    if low_high is None:
        return ""
    low, high = (_measured(v, target["measure"]) for v in low_high)
    return f" ({low} to {high})"


def _measured(value: float | None, measure: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.1f} us" if measure == "extra_us" else fmt(value)


def _targets(results: dict) -> list[str]:
    labels = [condition_label(c) for c in results["conditions"]]
    rows = [
        [
            t["target"],
            *(
                _measured(t["values"].get(label), t["measure"]) + spread(t, label)
                for label in labels
            ),
            limit_cell(t),
            "-" if t["limit"] is None else MET[t["met"]],
        ]
        for t in results["targets"]
    ]
    return ["", "### Targets", "", *table(["target", *labels, "limit", "met"], rows)]


def limit_cell(target: dict) -> str:
    """A target's limit as the tables print it; "-" for a control (no limit)."""
    if target["limit"] is None:
        return "-"
    return f"{target['limit']:.3g}" + (" us" if target["measure"] == "extra_us" else "")


def _cell(r: dict | None, unit: str) -> str:
    if r is None:
        return ""
    if "time_ms" not in r:
        return "-"
    if unit == "us":
        extra = r.get("extra_us")
        return f"{1e3 * r['time_ms']:.1f}" + ("" if extra is None else f" ({extra:+.1f})")
    ratio = r.get("ratio")
    return f"{r['time_ms']:.1f}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def _group(name: str, results: dict) -> list[str]:
    """A group's table: rows (name and mode) against cases and conditions, turned so that the
    longer of the two lists runs down the table."""
    group, conditions = results["groups"][name], results["conditions"]
    records = [r for r in results["records"] if r["group"] == name]
    cases = list(dict.fromkeys(r["case"] for r in records))
    rows = list(dict.fromkeys((r["name"], r["mode"]) for r in records))
    show_mode = len({mode for _, mode in rows}) > 1
    labels = {row: row[0] + (f" {row[1]}" if show_mode else "") for row in rows}

    def cell(row: tuple[str, str], case: str, condition: dict) -> str:
        fields = dict(name=row[0], mode=row[1], case=case, **condition)
        found = (r for r in records if all(r.get(k) == v for k, v in fields.items()))
        return _cell(next(found, None), group["unit"])

    if len(cases) > len(rows):
        header = [
            "case",
            *(f"{labels[row]}, {condition_label(c)}" for row in rows for c in conditions),
        ]
        body = [[case, *(cell(row, case, c) for row in rows for c in conditions)] for case in cases]
    else:
        header = ["row", *(f"{case}, {condition_label(c)}" for case in cases for c in conditions)]
        body = [
            [labels[row], *(cell(row, case, c) for case in cases for c in conditions)]
            for row in rows
        ]
    shapes = dict.fromkeys(f"{r['case']}: {r['shape']}" for r in records if "shape" in r)
    about = group.get("about", "")
    lines = [
        "",
        f"### {group['title']}",
        "",
        f"{about} Baseline: `{group['baseline']}`. Cases: " + "; ".join(shapes) + ".",
        "",
        *table(header, body),
    ]
    stolen = group.get("stolen")
    if stolen:
        shares = ", ".join(f"{label} {100 * share:.1f}%" for label, share in stolen.items())
        lines += ["", f"CPU time taken by the host (steal) while this group ran: {shares}."]
    skipped = dict.fromkeys(
        f"{r['name']} ({r['case']}): {r['skipped']}" for r in records if "skipped" in r
    )
    if skipped:
        lines += ["", "Not measured: " + "; ".join(skipped) + "."]
    return lines


def section_markdown(results: dict) -> str:
    """The model section, markers included."""
    lines = [MODEL.begin, "", TITLE, "", *_header(results), *_targets(results)]
    for name, group in results["groups"].items():
        if any(r["group"] == name for r in results["records"]):
            lines += _group(name, results)
        else:
            lines += ["", f"### {group['title']}"]
        if "failed" in group:
            lines += ["", f"Stopped: {group['failed']}."]
    return "\n".join([*lines, "", MODEL.end]) + "\n"
