"""Calls built once and timed under every condition of a run (the model benchmark).

A group of the model benchmark is built once (models, compiled graphs, warmed-up calls) and
then timed under each condition (idle, one core busy). Its calls come in cases (one shape or
batch size each); the calls of one case are interleaved (`clocks.interleaved_medians`) and each
is compared with its baseline in the same case, mode and condition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from urpe.bench.clocks import interleaved_medians

Key = tuple[str, str]  # (row name, mode)
# Fields that make two records comparable: a ratio divides records equal in all of them.
COMPARED_FIELDS = ("group", "case", "mode", "threads", "busy")


@dataclass
class Timed:
    """Per case: (name, mode) -> a no-argument call. A sample runs a call `loops` times (so
    that one sample of a microsecond call is long enough to time); records hold the time of
    one call. `shapes` says what each case is, `about` what all cases share; `skipped` records
    go out as they are."""

    cases: dict[str, dict[Key, Callable[[], object]]]
    shapes: dict[str, str]
    about: str = ""
    loops: int = 1
    skipped: list[dict] = field(default_factory=list)

    def measure(self, repeats: int, progress: Callable[[str], None]) -> list[dict]:
        records = []
        for case, calls in self.cases.items():
            looped = {key: _looped(call, self.loops) for key, call in calls.items()}
            medians = interleaved_medians(looped, repeats, progress=_prefixed(progress, case))
            for (name, mode), ms in medians.items():
                records.append(
                    dict(
                        case=case,
                        shape=self.shapes[case],
                        name=name,
                        mode=mode,
                        time_ms=ms / self.loops,
                    )
                )
        return records + [dict(r) for r in self.skipped]


def _looped(call: Callable[[], object], loops: int) -> Callable[[], None]:
    if loops == 1:
        return call

    def run() -> None:
        for _ in range(loops):
            call()

    return run


def _prefixed(progress: Callable[[str], None], case: str) -> Callable[[str], None]:
    return lambda line: progress(f"    {case}: {line}")


def compare(records: list[dict], baselines: dict[str, str]) -> None:
    """Set `ratio` (time / baseline's time) and `extra_us` (time - baseline's time, in
    microseconds) on every timed record whose group has a baseline (`baselines`: group ->
    name) measured with the same COMPARED_FIELDS."""

    def key(r: dict) -> tuple:
        return tuple(r.get(f) for f in COMPARED_FIELDS)

    base = {
        key(r): r["time_ms"]
        for r in records
        if "time_ms" in r and r["name"] == baselines.get(r["group"])
    }
    for r in records:
        if "time_ms" in r and key(r) in base:
            r["ratio"] = r["time_ms"] / base[key(r)]
            r["extra_us"] = 1e3 * (r["time_ms"] - base[key(r)])
