"""The context-parallel benchmark (benchmarks/bench_context_parallel.py): the activations a rank
saves for backward fall ~1/N when 2 processes share the sequence, the table and the
BENCHMARKS.md section are written, and a length the layout cannot split is one line."""

from __future__ import annotations

import pytest

import bench_context_parallel as script
from harness.context_parallel import ContextParallelSettings, run_sizes, table
from harness.sections import CONTEXT_PARALLEL

TINY = ContextParallelSettings(length=512, layers=1, dim=16, heads=2, vocab=11, repeats=1)


@pytest.mark.slow  # spawns 3 processes: ~30 s on a loaded 2-core machine
def test_saved_activations_per_rank_halve_with_two_processes(tmp_path):
    one, two = run_sizes(TINY, (1, 2), tmp_path, progress=lambda m: None)
    assert [r["processes"] for r in (one, two)] == [1, 2]
    assert [r["shard_tokens"] for r in two["ranks"]] == [256, 256]
    # every activation is (L/N, ...) but a few per-call numbers: ~1/2, not more
    for rank in two["ranks"]:
        assert 0.4 < rank["saved_mib"] / one["saved_mib"] < 0.6, (rank, one)
    assert all(r["step_ms"] > 0 and r["rss_rise_mib"] >= 0 for r in (one, two))
    lines = table([one, two]).splitlines()
    assert len(lines) == 4 and lines[3].startswith("| 2 | 256 |")
    text = script.section([one, two], TINY, "load average: 1.0", "python bench.py", "now")
    assert text.startswith(CONTEXT_PARALLEL.begin) and text.rstrip().endswith(CONTEXT_PARALLEL.end)
    assert "## Context parallel (CPU processes)" in text and "load average: 1.0" in text


def test_a_length_the_layout_cannot_split_is_one_line(capsys):
    assert script.main(["--length", "100", "--processes", "1", "4"]) == 2
    err = capsys.readouterr().err
    assert "--length is a multiple of 8" in err and err.count("\n") == 1
