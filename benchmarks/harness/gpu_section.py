"""The GPU section of BENCHMARKS.md: written between markers from the JSON results of one or
more `--device cuda` runs (merged), so that the CPU report around it stays, on any machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from urpe.bench.clocks import MODES
from urpe.bench.measure import add_ratios
from urpe.bench.rows import RENAMED

from .report import MET, cell, find, fmt, table
from .sections import GPU
from .targets import gpu_targets

SECTION_BEGIN, SECTION_END = GPU.begin, GPU.end


def _gpu_cell(r: dict) -> str:
    """ms · TFLOP/s · ratio to SDPA-Flash · peak MB."""
    ratio = r.get("ratio_to_sdpa_flash")
    parts = [
        f"{r['time_ms']:.2f}",
        f"{r['tflops']:.0f}",
        "" if ratio is None else f"{ratio:.2f}x",
        f"{r['peak_mb']:.0f}",
    ]
    return " · ".join(p for p in parts if p)


PENDING = [
    "**Pending: no GPU run yet.** The kernels are verified on the CPU (Triton's interpreter, "
    "FlexAttention in float64); no GPU figure has been measured, and none is estimated. "
    "`benchmarks/README.md` gives the exact commands for a GPU session.",
]


def merged_records(runs: list[dict]) -> list[dict]:
    records = [
        dict(r, name=RENAMED.get(r["name"], r["name"])) for run in runs for r in run["times"]
    ]
    add_ratios(records, "sdpa_flash")
    return records


def _tables(records: list[dict]) -> list[str]:
    lines = []
    names = list(dict.fromkeys(r["name"] for r in records if r["name"] != "*"))
    for head_dim, causal, dtype in sorted(
        {(r["head_dim"], r["causal"], r["dtype"]) for r in records}
    ):
        rows = [
            r
            for r in records
            if (r["head_dim"], r["causal"], r["dtype"]) == (head_dim, causal, dtype)
        ]
        lengths = sorted({r["length"] for r in rows})
        batch = next((r["batch"] for r in rows if "batch" in r), "?")
        heads = next((r["heads"] for r in rows if "heads" in r), "?")
        for mode in MODES:
            cells = [
                [name]
                + [cell(find(rows, name=name, mode=mode, length=n), _gpu_cell) for n in lengths]
                for name in names
            ]
            lines += [
                "",
                f"### {'forward' if mode == 'fwd' else 'forward+backward'}, D={head_dim}, "
                f"{'causal' if causal else 'not causal'}, {dtype}, B={batch}, H={heads}",
                "",
                "ms · TFLOP/s · ratio to SDPA-Flash · peak MB",
                "",
                *table(["kernel"] + [f"L={n}" for n in lengths], cells),
            ]
    return lines


def section_markdown(runs: list[dict]) -> str:
    """The GPU section from one or more runs' results (merged)."""
    lines = [SECTION_BEGIN, "", "## GPU: Triton kernel, FlexAttention route, SDPA", ""]
    if not runs:
        return "\n".join([*lines, *PENDING, "", SECTION_END]) + "\n"
    records, device = merged_records(runs), runs[0]["device"]
    targets = [
        [
            t["target"],
            fmt(t["value"]),
            str(t["limit"]),
            MET[t["met"]],
            t["setting"],
            t.get("met_count", ""),
        ]
        for t in gpu_targets(records)
    ]
    lines += [
        f"Measured {', '.join(run['date'] for run in runs)} on {device['gpu']} "
        f"({device['multiprocessors']} SMs, {device['memory_gb']} GB), torch {device['torch']}, "
        f"Triton {device['triton']}, CUDA {device['cuda']}.",
        "",
        "Commands: " + "; ".join(f"`{run['command']}`" for run in runs) + ".",
        "",
        "Times: medians of `triton.testing.do_bench` (CUDA events). TFLOP/s: 4·B·H·L²·D per "
        "forward (halved when causal), 3.5x that for forward+backward. Memory: peak "
        "`torch.cuda.max_memory_allocated` during one call above the inputs. Ratios: to "
        "SDPA-Flash in the same run and setting.",
        "",
        "### Targets (each judged on its worst setting)",
        "",
        *table(["target", "measured", "limit", "met", "worst setting", "settings met"], targets),
        *_tables(records),
    ]
    checks = [
        [
            r["name"],
            f"L={r['length']} D={r['head_dim']} causal={r['causal']} {r['dtype']}",
            f"{r['error_vs_reference']:.1e}",
        ]
        for r in records
        if "error_vs_reference" in r
    ]
    if checks:
        lines += [
            "",
            "### Forward outputs against the reference (relative error)",
            "",
            *table(["kernel", "setting", "‖out − ref‖ / ‖ref‖"], checks),
        ]
    training = [
        [
            r["name"],
            r.get("backend", ""),
            f"{r['batch']} x {r['length']}, {r['dim']}",
            f"{r['time_ms']:.2f}",
            f"{r['ratio_to_nope_sdpa']:.2f}",
        ]
        for run in runs
        for r in run.get("training", [])
        if "time_ms" in r
    ]
    if training:
        lines += [
            "",
            "### One training step, synthetic paper preset (bf16 autocast, Adam)",
            "",
            *table(
                ["model", "backend auto picked", "B x L, width", "ms", "ratio to no-PE SDPA"],
                training,
            ),
        ]
    return "\n".join([*lines, "", SECTION_END]) + "\n"


def write_section(path: Path, section: str) -> None:
    """Put the GPU section into the Markdown file at `path`, replacing an earlier one and
    keeping everything else (the CPU report, the model section)."""
    GPU.write(path, section)


def print_targets(targets: list[dict]) -> None:
    for t in targets:
        print(f"{t['target']}: {fmt(t['value'])} (limit {t['limit']:.3g}, met: {t['met']})")


def report(paths: list[Path], markdown: Path | None) -> int:
    """`--gpu-report`: the GPU section from saved JSON results (no GPU needed)."""
    runs = []
    for path in paths:
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            print(f"bench_attention.py: error: --gpu-report {path}: {error}", file=sys.stderr)
            return 2
        if not isinstance(run, dict) or "times" not in run or "device" not in run:
            print(
                f"bench_attention.py: error: --gpu-report {path}: not a GPU results file",
                file=sys.stderr,
            )
            return 2
        runs.append(run)
    section = section_markdown(runs)
    if markdown is None:
        print(section)
    else:
        write_section(markdown, section)
    print_targets(gpu_targets(merged_records(runs)))
    return 0
