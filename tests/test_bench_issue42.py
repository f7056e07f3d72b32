"""benchmarks/bench_issue42.py runs its groups and, with --processes, merges fresh processes'
records into medians with their ranges. No speed is asserted (timings here are noise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_issue42.py"
TINY = ["--groups", "decode", "--lengths", "16", "--dtypes", "float32"]
TINY += ["--conditions", "idle", "--repeats", "1", "--threads", "1"]


def _run(tmp_path: Path, *more: str) -> tuple[list[dict], str]:
    out = tmp_path / "records.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, *more, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stdout


def test_one_process_gives_a_ratio_per_row(tmp_path):
    records, stdout = _run(tmp_path)
    assert [r["row"] for r in records] == ["cpp", "cpp_gate", "cpp_gate_k1024"]
    for r in records:
        assert r["ratio"] == r["ms"] / r["sdpa_ms"] and "ratio_range" not in r
    assert "decode float32 Lk=16" in stdout


def test_two_processes_give_the_median_and_the_range_of_each_ratio(tmp_path):
    records, stdout = _run(tmp_path, "--processes", "2")
    assert [r["row"] for r in records] == ["cpp", "cpp_gate", "cpp_gate_k1024"]
    for r in records:
        low, high = r["ratio_range"]
        assert low <= r["ratio"] <= high  # (the median of two: their mean)
        assert r["ratio"] == (low + high) / 2
    assert stdout.count("[median of 2 processes]") == 3
    assert stdout.count("decode float32 Lk=16") == 2  # each child's own line


def test_a_process_count_below_one_is_refused_in_one_line():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--processes", "0"], capture_output=True, text=True
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]  # (argparse's usage above it)
    assert last.endswith("error: argument --processes: must be a positive integer, got 0")
