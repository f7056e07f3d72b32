"""The measuring pipeline: one setting (inputs of one shape), the chosen rows, both modes.

The same steps on every device: skip what a row cannot do at this length, build each call and
warm it up (a failure is recorded with its reason, the rest go on), time the calls with the
device's clock (`clocks`), and divide every time by the baseline's in the same setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .clocks import MODES, Call, cuda_measure, interleaved_medians
from .rows import Row, skip_reason

# Fields that make two records comparable (a ratio divides records equal in all of them).
SETTING_FIELDS = ("length", "head_dim", "causal", "dtype", "batch", "heads", "threads", "busy")
BASELINE = {"cpu": "sdpa", "cuda": "sdpa_flash"}


def failure_reason(error: BaseException) -> str:
    """One line for a record: the error's type and the first line of its message."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "out of memory"
    lines = str(error).splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:160]}"


@dataclass(frozen=True)
class Method:
    """How a setting is measured: on which device, with which length caps (the parsed
    arguments: see `rows.skip_reason`), how many warm-up calls and timed repeats (CPU; CUDA's
    `do_bench` picks its own), and where progress lines go."""

    device: str
    limits: object = None
    warmup: int = 1
    repeats: int = 5
    progress: Callable[[str], None] = print


def build_calls(
    rows: list[Row], inputs, setting: dict, method: Method
) -> tuple[dict[tuple[str, str], Call], list[dict]]:
    """The warmed-up calls of every (row, mode) that runs here, and a record for each that
    does not (skipped, with the reason). A forward-only row has no record in the other mode."""
    calls, skipped = {}, []
    causal = setting.get("causal", False)
    for row in rows:
        for mode in (m for m in MODES if row.has_mode(m, method.device)):
            reason = skip_reason(row, setting["length"], method.limits)
            if reason is None:
                try:
                    call = Call(row.build(inputs, causal), mode, inputs)
                    for _ in range(method.warmup):
                        call()
                    calls[(row.name, mode)] = call
                    continue
                except Exception as error:  # noqa: BLE001 - one row failing must not stop the rest
                    reason = failure_reason(error)
                    method.progress(f"  {row.name} {mode}: failed ({reason})")
            skipped.append(dict(name=row.name, mode=mode, **setting, skipped=reason))
    return calls, skipped


def time_calls(calls: dict, setting: dict, method: Method) -> list[dict]:
    """A record with `time_ms` (and on CUDA `peak_mb`) for every call."""
    records = []
    if method.device == "cuda":
        for (name, mode), call in calls.items():
            record = dict(name=name, mode=mode, **setting)
            try:
                record.update(cuda_measure(call))
            except Exception as error:  # noqa: BLE001
                record["skipped"] = failure_reason(error)
            torch.cuda.empty_cache()
            records.append(record)
        return records
    medians = interleaved_medians(calls, method.repeats, progress=method.progress)
    for (name, mode), ms in medians.items():
        records.append(dict(name=name, mode=mode, **setting, time_ms=ms))
    return records


def measure_setting(rows: list[Row], inputs, setting: dict, method: Method) -> list[dict]:
    """Every row in both modes at one setting (its fields, `causal` among them, go into every
    record), in row order, with ratios to the device's baseline."""
    calls, skipped = build_calls(rows, inputs, setting, method)
    records = time_calls(calls, setting, method)
    order = {row.name: i for i, row in enumerate(rows)}
    records = sorted(records + skipped, key=lambda r: (order[r["name"]], MODES.index(r["mode"])))
    add_ratios(records, BASELINE[method.device])
    return records


def add_ratios(records: list[dict], baseline: str) -> None:
    """Set `ratio_to_<baseline>` on every timed record: its time over the baseline's time in
    the same setting and mode (records without that baseline get none)."""

    def key(r: dict) -> tuple:
        return (r["mode"], *(r.get(field) for field in SETTING_FIELDS))

    base = {key(r): r["time_ms"] for r in records if r["name"] == baseline and "time_ms" in r}
    for r in records:
        if "time_ms" in r and key(r) in base:
            r[f"ratio_to_{baseline}"] = r["time_ms"] / base[key(r)]
