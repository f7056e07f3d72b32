"""The benchmark's targets, as data, and how they are judged on measured records.

A ratio target divides the time of one row by another's in the same setting and mode; where
several settings match (GPU: lengths, head dims, causal), the worst one judges it and is named.
Memory and end-to-end targets follow. Every target becomes a record
{target, value, limit, met, [setting, met_count]}; value and met are None when not measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from urpe.bench.measure import SETTING_FIELDS
from urpe.bench.rows import current_names

CONDITION_FIELDS = ("threads", "busy")
SETTING_LABELS = dict(
    length="L=",
    head_dim="D=",
    causal="causal=",
    dtype="",
    batch="B=",
    heads="H=",
    threads="threads=",
    busy="busy=",
)


@dataclass(frozen=True)
class RatioTarget:
    """time(numerator) / time(denominator) <= limit (>= limit when `at_least`: a speed-up),
    over the records at `length` (None: any, from `min_length` on), `dtype` (None: any) and
    `condition` (threads and load; empty: the ordinary idle run's records)."""

    target: str
    numerator: str
    denominator: str
    mode: str
    length: int | None
    dtype: str | None
    limit: float
    min_length: int = 0
    at_least: bool = False
    condition: dict = field(default_factory=dict)

    def rows(self) -> set[str]:
        return {self.numerator, self.denominator}

    def matches(self, r: dict) -> bool:
        return (
            r["mode"] == self.mode
            and "time_ms" in r
            and (self.length is None or r["length"] == self.length)
            and r["length"] >= self.min_length
            and (self.dtype is None or r["dtype"] == self.dtype)
            and all(r.get(f) == self.condition.get(f) for f in CONDITION_FIELDS)
        )

    def judge(self, records: list[dict]) -> dict:
        def times(name: str) -> dict[tuple, float]:
            return {
                tuple(r.get(f) for f in SETTING_FIELDS): r["time_ms"]
                for r in records
                if r["name"] == name and self.matches(r)
            }

        top, bottom = times(self.numerator), times(self.denominator)
        values = sorted((top[key] / bottom[key], key) for key in set(top) & set(bottom))
        out = dict(target=self.target, value=None, limit=self.limit, met=None)
        if not values:
            return dict(out, setting="not measured")
        value, key = values[0] if self.at_least else values[-1]
        met = [v >= self.limit if self.at_least else v <= self.limit for v, _ in values]
        setting = " ".join(
            f"{SETTING_LABELS[f]}{v}"
            for f, v in zip(SETTING_FIELDS, key, strict=True)
            if v is not None
        )
        return dict(
            out, value=value, met=all(met), met_count=f"{sum(met)}/{len(met)}", setting=setting
        )


def _cpu(
    target: str,
    numerator: str,
    denominator: str,
    mode: str,
    limit: float,
    dtype: str = "float32",
    **condition,
):
    return RatioTarget(
        target, numerator, denominator, mode, 2048, dtype, limit, condition=condition
    )


def _gpu(target: str, numerator: str, denominator: str, mode: str, limit: float, **more):
    return RatioTarget(target, numerator, denominator, mode, None, None, limit, **more)


# fmt: off
# Issue 4: the eager blockwise kernel on the CPU, float32, L=2048, idle machine.
BLOCKWISE_TARGETS = (
    _cpu("blockwise URPE fwd+bwd / bias-free SDPA", "blockwise_urpe", "sdpa", "fwdbwd", 1.5),
    _cpu("blockwise URPE fwd+bwd / SDPA dense bias", "blockwise_urpe", "sdpa_dense_bias",
         "fwdbwd", 0.5),
    _cpu("blockwise URPE fwd / bias-free SDPA", "blockwise_urpe", "sdpa", "fwd", 1.3),
    _cpu("blockwise URPE / blockwise RPE, fwd+bwd", "blockwise_urpe", "blockwise_rpe", "fwdbwd",
         1.05),
    _cpu("blockwise URPE / blockwise RPE, fwd", "blockwise_urpe", "blockwise_rpe", "fwd", 1.05),
)
# Issue 21: the compiled C++ tile loop ("cpp", what "auto" runs on the CPU), idle machine.
CPP_TARGETS = (
    _cpu("cpp URPE fwd+bwd / bias-free SDPA", "cpp_urpe", "sdpa", "fwdbwd", 1.4),
    _cpu("cpp URPE fwd / bias-free SDPA", "cpp_urpe", "sdpa", "fwd", 1.25),
    _cpu("cpp URPE / cpp RPE, fwd+bwd", "cpp_urpe", "cpp_rpe", "fwdbwd", 1.05),
    _cpu("cpp URPE / cpp RPE, fwd", "cpp_urpe", "cpp_rpe", "fwd", 1.05),
    _cpu("cpp URPE fwd+bwd / bias-free SDPA, bfloat16", "cpp_urpe", "sdpa", "fwdbwd", 1.6,
         dtype="bfloat16"),
)
CPU_TARGETS = BLOCKWISE_TARGETS + CPP_TARGETS
# Issue 21: the C++ kernel's ratio at 1 and 2 threads, idle and with one core busy.
CONTENTION_TARGETS = tuple(
    _cpu(f"cpp URPE {label} / bias-free SDPA, {threads} thread(s), {load}", "cpp_urpe",
         "sdpa", mode, limit, threads=threads, busy=busy)
    for threads in (1, 2)
    for label, mode, busy, load, limit in (("fwd+bwd", "fwdbwd", False, "idle", 1.4),
                                           ("fwd", "fwd", False, "idle", 1.25),
                                           ("fwd+bwd", "fwdbwd", True, "one core busy", 1.6))
)
# Issue 11: the Triton kernel on a GPU, judged on the worst of every setting measured.
GPU_TARGETS = (
    _gpu("triton URPE fwd+bwd / flex RPE (<=)", "triton_urpe", "flex_rpe", "fwdbwd", 1.3),
    _gpu("triton URPE fwd+bwd / SDPA-Flash (<=)", "triton_urpe", "sdpa_flash", "fwdbwd", 1.8),
    _gpu("speed-up of triton URPE over SDPA dense bias, fwd+bwd, L >= 4k (>=)",
         "sdpa_dense_bias", "triton_urpe", "fwdbwd", 3.0, min_length=4096, at_least=True),
    _gpu("triton URPE / triton without gate, fwd (<=)", "triton_urpe", "triton_rpe", "fwd", 1.1),
    _gpu("triton URPE / triton without gate, fwdbwd (<=)", "triton_urpe", "triton_rpe", "fwdbwd",
         1.1),
)
# One training step, URPE on auto / another model: (model, its label, limit).
END_TO_END_TARGETS = (("nope_sdpa", "no-PE SDPA", 1.1),
                      ("xtransformers_t5", "x-transformers T5", 1.0))
# fmt: on
TARGETS = {"cpu": CPU_TARGETS + CONTENTION_TARGETS, "cuda": GPU_TARGETS}


def named_rows(device: str) -> set[str]:
    """Every row a target of this device compares."""
    return {name for t in TARGETS[device] for name in t.rows()}


def fit_quadratic(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares a + b L^2 through (L, MB) points; None with fewer than two points."""
    if len(points) < 2:
        return None
    xs = [length**2 for length, _ in points]
    ys = [mb for _, mb in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    b /= sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _peaks(memory: list[dict], name: str) -> dict[int, float]:
    return {r["length"]: r["peak_mb"] for r in memory if r["name"] == name and "peak_mb" in r}


def cpu_memory_targets(memory: list[dict]) -> list[dict]:
    """Peak memory of each tiled CPU kernel (blockwise, cpp) against the reference's at the longest
    length (extrapolated a + b L^2 where the reference was not measured there), and its growth
    with L."""
    ref = _peaks(memory, "reference_urpe")
    return [t for kernel in ("blockwise", "cpp") for t in _memory_targets(memory, kernel, ref)]


def _memory_targets(memory: list[dict], kernel: str, ref: dict[int, float]) -> list[dict]:
    peaks = _peaks(memory, f"{kernel}_urpe")
    if not peaks:
        return []
    longest, shortest = max(peaks), min(peaks)
    ref_mb, how = ref.get(longest), "measured"
    if ref_mb is None:
        fit = fit_quadratic(sorted(ref.items()))
        ref_mb, how = (
            (None, "") if fit is None else (fit[0] + fit[1] * longest**2, "extrapolated a + b L^2")
        )
    out = [
        dict(
            target=f"{kernel} URPE peak memory / reference at L={longest} ({how})",
            value=None if ref_mb is None else peaks[longest] / ref_mb,
            limit=1 / 8,
        )
    ]
    if longest > shortest:
        n = longest // shortest
        out.append(
            dict(
                target=f"{kernel} URPE memory growth L={shortest}->{longest} (linear: "
                f"{n}x, quadratic: {n**2}x)",
                value=peaks[longest] / max(peaks[shortest], 1e-9),
                limit=1.25 * longest / shortest,
            )
        )
    return out


def gpu_memory_target(records: list[dict], name: str = "triton_urpe") -> dict:
    """Peak memory of fwd+bwd linear in L: from the shortest to the longest length measured
    (per head dim, causal setting and dtype), growth at most 1.25 x the length ratio."""
    label = f"{name} fwd+bwd peak memory linear in L (growth / length ratio <=)"
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["name"] == name and r["mode"] == "fwdbwd" and "peak_mb" in r:
            groups.setdefault((r["head_dim"], r["causal"], r["dtype"]), []).append(r)
    worst = None
    for (head_dim, causal, dtype), rows in groups.items():
        short, long = min(rows, key=lambda r: r["length"]), max(rows, key=lambda r: r["length"])
        if short is long:
            continue
        value = long["peak_mb"] / max(short["peak_mb"], 1e-9) / (long["length"] / short["length"])
        setting = (
            f"D={head_dim} causal={causal} {dtype}: {short['peak_mb']:.0f} MB at "
            f"L={short['length']} -> {long['peak_mb']:.0f} MB at L={long['length']}"
        )
        if worst is None or value > worst[0]:
            worst = (value, setting)
    if worst is None:
        return dict(target=label, value=None, limit=1.25, setting="not measured", met=None)
    return dict(
        target=label, value=worst[0], limit=1.25, setting=worst[1], met=bool(worst[0] <= 1.25)
    )


def end_to_end_targets(e2e: list[dict]) -> list[dict]:
    """A training step of URPE on auto against each model of END_TO_END_TARGETS, per size."""
    by = {(r["name"], r.get("size")): r["time_ms"] for r in e2e if "time_ms" in r}
    return [
        dict(
            target=f"end-to-end step ({size}): URPE auto / {label}",
            value=by[("urpe_auto", size)] / by[(name, size)],
            limit=limit,
        )
        for size in ("quick", "long")
        for name, label, limit in END_TO_END_TARGETS
        if ("urpe_auto", size) in by and (name, size) in by
    ]


def _judged(records: list[dict]) -> list[dict]:
    for r in records:
        if r.get("met") is None:
            r["met"] = None if r["value"] is None else bool(r["value"] <= r["limit"])
    return records


def cpu_targets(
    times: list[dict], memory: list[dict], e2e: list[dict], contention: list[dict] = ()
) -> list[dict]:
    """Issue 4's and issue 21's targets (the contention ones where contention was measured),
    judged."""
    ratios = CPU_TARGETS + (CONTENTION_TARGETS if contention else ())
    times, memory, contention = (current_names(r) for r in (times, memory, contention))
    records = [*times, *contention]
    out = [t.judge(records) for t in ratios]
    return _judged(out + cpu_memory_targets(memory) + end_to_end_targets(e2e))


def gpu_targets(records: list[dict]) -> list[dict]:
    """Issue 11's targets, each judged on its worst setting (the setting is named)."""
    return _judged([t.judge(records) for t in GPU_TARGETS] + [gpu_memory_target(records)])
