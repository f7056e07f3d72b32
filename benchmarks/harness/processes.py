"""One benchmark run in several fresh processes, and their records merged into one.

Inside one process a ratio of two rows timed interleaved is steady, but the next process can
read it 10-20% apart on the same code: where each model's weights, caches and scratch land in
memory is fixed when a process builds them, and decides the rows for the rest of it (the
model benchmark's generation rows, 2026-11-30, are in benchmarks/README.md). As pyperf does
with its worker processes, the run is repeated in fresh interpreters and each figure is the
median over them of what each process measured, its range kept beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

# The model benchmark's measured fields: a merged record holds each as the median over
# processes, with its [lowest, highest] as "<field>_range".
MERGED_FIELDS = ("time_ms", "ratio", "extra_us")


def in_fresh_processes(run: Callable[[object], dict], argument: object, count: int) -> list[dict]:
    """run(argument) in `count` new interpreters (spawned, not forked: nothing of this one's
    memory comes along), one after another; their results in order. `run` must be importable
    by name (a module-level function) and `argument` picklable."""
    results = []
    for _ in range(count):
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            results.append(pool.submit(run, argument).result())
    return results


def merged_records(runs: list[list[dict]], measured: tuple = MERGED_FIELDS) -> list[dict]:
    """The records of several runs of one benchmark as one list, in the first run's order.
    Records are the same figure where all their fields but the `measured` ones are equal; one
    found in every run gets the median of each measured field over the runs and its range
    ("ratio_range": [lowest, highest]); one missing from a run (its group failed there, or it
    was skipped) is kept as the first run that has it gave it."""
    by_key: dict[tuple, list[dict]] = {}
    for records in runs:
        for r in records:
            key = tuple(sorted((k, repr(v)) for k, v in r.items() if k not in measured))
            by_key.setdefault(key, []).append(r)
    merged = []
    for group in by_key.values():
        first = dict(group[0])
        if len(group) == len(runs):
            for name in measured:
                values = [r[name] for r in group if name in r]
                if len(values) == len(group):
                    first[name] = statistics.median(values)
                    first[f"{name}_range"] = [min(values), max(values)]
        merged.append(first)
    return merged


__all__ = ["MERGED_FIELDS", "in_fresh_processes", "merged_records"]
