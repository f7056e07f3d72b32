"""`StolenTime`: the share of CPU time a virtual machine's host took while a timed block ran,
read from /proc/stat's steal ticks, so that a benchmark report can say how disturbed a run was."""

from __future__ import annotations

import sys
import time

import pytest

from urpe.bench import machine
from urpe.bench.machine import StolenTime


def test_the_share_is_the_steal_ticks_over_all_ticks_of_the_block(monkeypatch):
    # (all ticks, steal ticks) at the block's start and end: 400 ticks pass, 30 of them stolen
    readings = iter([(10_000, 100), (10_400, 130)])
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: next(readings))
    with StolenTime() as stolen:
        assert stolen.fraction is None  # (known only when the block ends)
    assert stolen.fraction == pytest.approx(30 / 400)


@pytest.mark.parametrize("start, end", [(None, None), ((5, 1), None), ((5, 1), (5, 1))])
def test_no_share_without_readings_or_without_time_passing(monkeypatch, start, end):
    readings = iter([start, end])
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: next(readings))
    with StolenTime() as stolen:
        pass
    assert stolen.fraction is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_a_real_block_reads_a_share_between_0_and_1():
    with StolenTime() as stolen:
        end = time.perf_counter() + 0.1  # long enough for the kernel's tick counters to move
        while time.perf_counter() < end:
            pass
    assert stolen.fraction is not None and 0.0 <= stolen.fraction <= 1.0


def test_start_and_stop_measure_a_block_without_a_scope(monkeypatch):
    readings = iter([(0, 0), (100, 50), (300, 50), (500, 50)])
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: next(readings))
    stolen = StolenTime().start()
    assert stolen.stop() == pytest.approx(0.5)
    stolen.start()  # a second block: 200 ticks, none of them stolen
    assert stolen.stop() == 0.0


@pytest.mark.parametrize(
    "line", ["", "cpu 1 2 3\n", "cpu a b c d e f g h i\n", "intr 5 6 7 8 9 1 2 3 4\n"]
)
def test_a_proc_stat_it_cannot_read_gives_no_share(monkeypatch, tmp_path, line):
    import builtins

    fake = tmp_path / "stat"
    fake.write_text(line)
    real_open = builtins.open
    monkeypatch.setattr(
        builtins,
        "open",
        lambda path, *a, **k: real_open(fake if path == "/proc/stat" else path, *a, **k),
    )
    with StolenTime() as stolen:
        pass
    assert stolen.fraction is None
