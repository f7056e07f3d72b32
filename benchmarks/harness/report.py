"""BENCHMARKS.md's CPU report, written from the results of one run (what `attention.json`
holds), and the table helpers the GPU section shares."""

from __future__ import annotations

from urpe.bench.clocks import MODES
from urpe.bench.memory import MEMORY_ROWS
from urpe.bench.rows import RENAMED, current_names

RECORD_LISTS = ("times", "memory", "contention", "end_to_end")  # each record named by its row

MET = {True: "yes", False: "**no**", None: "n/a"}


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; rows whose cells are all empty are left out."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows if any(row[1:])]


def find(records: list[dict], **fields) -> dict | None:
    """The first record whose fields equal these (a missing field counts as None)."""
    return next((r for r in records if all(r.get(k) == v for k, v in fields.items())), None)


def cell(r: dict | None, render) -> str:
    """A table cell for record `r`: "" when not asked for, "-" when skipped, else render(r)."""
    if r is None:
        return ""
    return render(r) if "time_ms" in r else "-"


def time_cell(r: dict) -> str:
    """ "12.3 ms (1.45x)": time and ratio to SDPA."""
    ratio = r.get("ratio_to_sdpa")
    return f"{r['time_ms']:.1f} ms" + ("" if ratio is None else f" ({ratio:.2f}x)")


def ratio_cell(r: dict) -> str:
    """ "1.45x (12.3)": ratio to SDPA first, then ms."""
    return f"{fmt(r.get('ratio_to_sdpa'))}x ({r['time_ms']:.1f})"


def _header(results: dict) -> list[str]:
    m, shape, load = results["machine"], results["shape"], results["load_start"]
    return [
        "# Benchmarks: URPE attention",
        "",
        f"Measured {results['date']} on {m['cpu']} ({m['cores']} cores, {m['threads']} torch "
        f"threads, {m['capability']}), torch {m['torch']}, Python {m['python']}"
        f"{malloc_note(m)}. Load average "
        f"at start {_load(load)}, at end {_load(m['load_average'])}{steal_note(results)} "
        "(other processes shared the cores: compare ratios, measured interleaved in one run, "
        "rather than absolute times).",
        "",
        f"Command: `{results['command']}`. Shapes: B={shape['batch']}, H={shape['heads']}, "
        f"D={shape['head_dim']}. Times are medians of {results['repeats']} repeats after "
        "warm-up; forward runs under `no_grad`; ratios are to bias-free SDPA in the same run, "
        "dtype and length.",
        "",
        "Which targets are missed, where the time goes and what would close the gap: "
        "`benchmarks/README.md` (written by hand; this file is generated).",
    ]


def malloc_note(machine: dict) -> str:
    """', malloc: <setting>' where the run recorded one (`keep_freed_memory`; older runs not)."""
    return f", malloc: {machine['allocator']}" if "allocator" in machine else ""


def steal_note(results: dict) -> str:
    """'; the host took N% of the CPU time while timing' where the run measured it (Linux)."""
    stolen = results.get("stolen")
    if stolen is None:
        return ""
    return f"; the host took {100 * stolen:.1f}% of the CPU time while timing (steal)"


def _load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def _targets(results: dict) -> list[str]:
    rows = [
        [t["target"], fmt(t["value"]), f"{t['limit']:.3g}", MET[t["met"]]]
        for t in results["targets"]
    ]
    return [
        "",
        "## Targets (float32, L=2048 unless stated)",
        "",
        *table(["target", "measured", "limit", "met"], rows),
    ]


def _row_names(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["name"] for r in records))


def _times(results: dict) -> list[str]:
    lines = []
    for dtype in results["dtypes"]:
        records = [r for r in results["times"] if r["dtype"] == dtype]
        lengths = sorted({r["length"] for r in records})
        header = ["kernel"] + [f"L={n} {m}" for n in lengths for m in ("fwd", "fwd+bwd")]
        rows = [
            [name]
            + [
                cell(find(records, name=name, length=n, mode=m), time_cell)
                for n in lengths
                for m in MODES
            ]
            for name in _row_names(records)
        ]
        lines += ["", f"## Time, {dtype}", "", *table(header, rows)]
    return lines


def _contention(results: dict) -> list[str]:
    records = results.get("contention") or []
    if not records:
        return []
    conditions = list(dict.fromkeys((r["threads"], r["busy"]) for r in records))
    lines = [
        "",
        "## Under contention: ratio to bias-free SDPA (ms)",
        "",
        "The same rows measured at each torch thread count, idle and with another process "
        "spinning on one core (started before each block of measurements, stopped after). "
        "Ratios are to SDPA under the same condition.",
    ]
    for dtype, length in dict.fromkeys((r["dtype"], r["length"]) for r in records):
        block = [r for r in records if (r["dtype"], r["length"]) == (dtype, length)]
        header = ["kernel"] + [
            f"{'fwd+bwd' if m == 'fwdbwd' else m}, {t}T {'busy' if b else 'idle'}"
            for m in MODES
            for t, b in conditions
        ]
        rows = [
            [name]
            + [
                cell(find(block, name=name, mode=m, threads=t, busy=b), ratio_cell)
                for m in MODES
                for t, b in conditions
            ]
            for name in _row_names(block)
        ]
        lines += ["", f"### {dtype}, L={length}", "", *table(header, rows)]
    return lines


def _memory(results: dict) -> list[str]:
    memory = results["memory"]
    if not memory:
        return []
    lengths = sorted({r["length"] for r in memory})
    rows = []
    for name in MEMORY_ROWS:
        cells = []
        for n in lengths:
            r = find(memory, name=name, length=n, dtype="float32", mode="fwdbwd")
            cells.append("" if r is None else f"{r['peak_mb']:.0f}" if "peak_mb" in r else "-")
        rows.append([name, *cells])
    lines = [
        "",
        "## Peak memory, float32 forward+backward (MB above the inputs)",
        "",
        "Growth of the process's resident set during one call, in a fresh subprocess "
        "(peak RSS during the call, reset just before it, minus RSS before it).",
        "",
        *table(["kernel"] + [f"L={n}" for n in lengths], rows),
    ]
    if results.get("plot"):
        lines += ["", f"![peak memory]({results['plot']})"]
    return lines


def _profile(results: dict) -> list[str]:
    prof = results.get("profile")
    if not prof:
        return []
    rows = [
        [f"`{op['op']}`", f"{op['ms_per_call']:.1f}", f"{op['share']:.0%}", str(op["count"])]
        for op in prof["ops"]
    ]
    row = prof.get("row", "blockwise_urpe")  # earlier results profiled that kernel only
    kernel = row.removesuffix("_urpe").removesuffix("_rpe")
    return [
        "",
        f"## Where {kernel} URPE spends its time (float32, L={prof['length']}, fwd+bwd)",
        "",
        "Self CPU time per operator (torch.profiler), per call. " + PROFILE_NOTES.get(kernel, ""),
        "",
        *table(["operator", "ms per call", "share", "calls"], rows),
    ]


PROFILE_NOTES = {
    "blockwise": "`bmm`/`baddbmm_` are the matrix products; the rest is elementwise work over "
    "score tiles, which SDPA's compiled kernel does in cache.",
    "cpp": "`urpe_cpp::forward` and `urpe_cpp::backward` are the compiled tile loops (matrix "
    "products and every per-element step inside); the rest is the preparation around them "
    "(dtype conversions, the Toeplitz rows, delta = rowsum(dO * O)) and autograd.",
}


def _end_to_end(results: dict) -> list[str]:
    if not results["end_to_end"]:
        return []
    rows = []
    for r in results["end_to_end"]:
        if "time_ms" in r:
            shape = f"B={r['batch']}, L={r['length']}, dim={r['dim']}, heads={r['heads']}"
            rows.append(
                [
                    r["name"],
                    f"{r['size']} ({shape})",
                    f"{r['time_ms']:.1f}",
                    f"{r['ratio_to_nope_sdpa']:.2f}",
                ]
            )
        else:
            rows.append([r["name"], r.get("size", ""), r["skipped"], ""])
    return [
        "",
        "## End to end: one training step (forward, backward, Adam)",
        "",
        *table(["model", "size", "time (ms)", "ratio to no-PE SDPA"], rows),
    ]


def markdown(results: dict) -> str:
    """The CPU report (everything of BENCHMARKS.md but the GPU section), from results of any
    version (rows of earlier names are renamed)."""
    results = {
        key: current_names(value) if key in RECORD_LISTS else value
        for key, value in results.items()
    }
    if "row" in (results.get("profile") or {}):
        results["profile"] = dict(
            results["profile"],
            row=RENAMED.get(results["profile"]["row"], results["profile"]["row"]),
        )
    parts = (_header, _targets, _times, _contention, _memory, _profile, _end_to_end)
    return "\n".join(line for part in parts for line in part(results)) + "\n"
