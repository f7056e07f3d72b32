"""`urpe bench attention`: time and peak memory of the attention kernels against PyTorch SDPA.

One run measures, on the same inputs, forward (under no_grad) and forward+backward time of:

    sdpa             F.scaled_dot_product_attention, no mask: the baseline every ratio divides by
    sdpa_dense_bias  SDPA with a dense float bias (B, H, L, L) that receives a gradient
    <name>_urpe      `urpe.attention(backend=<name>)` with Toeplitz B and C (URPE), one row for
                     every backend in `urpe.kernels.BACKENDS` but SDPA: reference_urpe
                     (materialises every (L, L) matrix), fused_urpe (blockwise), and any backend
                     registered later
    fused_rpe        the fused kernel, Toeplitz B only (plain RPE)
    flex_rpe         compiled FlexAttention with the Toeplitz bias as score_mod (forward only;
                     it cannot express C)

Times are medians of several repeats after warm-up, candidates interleaved within each repeat so
that load from other processes hits them alike. Peak memory is the growth of the resident set
(peak RSS during the call, reset just before it, minus RSS just before it) of a fresh subprocess
running one call (Linux /proc): it counts every allocation, torch's or not. A profile shows
which operators fused URPE spends its time in. The end-to-end part times one training step of
small models. Results go to stdout, optionally to JSON, Markdown (BENCHMARKS.md) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cli_types import non_negative_int, positive_int
from ..kernels import BACKENDS, Toeplitz, attention
from . import gpu

# One URPE row per registered CPU backend (SDPA has rows of its own: it cannot take the gate;
# the GPU backends, "triton" and "flex", are timed by the GPU section in `gpu.py`).
GPU_ONLY = ("triton", "flex")
BACKEND_ROWS = {f"{name}_urpe": name for name in BACKENDS if name not in ("sdpa", *GPU_ONLY)}
ROWS = ("sdpa", "sdpa_dense_bias", *BACKEND_ROWS, "fused_rpe", "flex_rpe")
FORWARD_ONLY = ("flex_rpe",)
MODES = ("fwd", "fwdbwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ROW_HELP = {
    "sdpa": "F.scaled_dot_product_attention without a mask: the baseline of every ratio",
    "sdpa_dense_bias": "SDPA with a dense (B, H, L, L) float bias that receives a gradient",
    **{
        row: f"urpe.attention(backend={name!r}), Toeplitz B and C"
        for row, name in BACKEND_ROWS.items()
    },
    "reference_urpe": "the materialising reference kernel, Toeplitz B and C",
    "fused_urpe": "the fused kernel, Toeplitz B and C (URPE)",
    "fused_rpe": "the fused kernel, Toeplitz B only (RPE)",
    "flex_rpe": "compiled FlexAttention, Toeplitz bias as score_mod (forward only)",
}


# Defaults that depend on --device (None on the command line: take these).
CPU_DEFAULTS = dict(lengths=[512, 2048, 8192], dtypes=["float32", "bfloat16"], batch=1, heads=8,
                    dense_max_length=4096)  # fmt: skip
GPU_DEFAULTS = dict(**gpu.DEFAULTS, dense_max_length=8192)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    rows = "; ".join(f"{name}: {text}" for name, text in ROW_HELP.items())
    gpu_rows = "; ".join(f"{name}: {text}" for name, text in gpu.GPU_ROWS.items())
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu: the CPU report (BENCHMARKS.md's main part). cuda: the GPU section (Triton "
        "kernel, FlexAttention route, SDPA-Flash; see --gpu-rows), written between markers "
        "so the CPU part stays",
    )  # fmt: skip
    parser.add_argument(
        "--lengths", type=positive_int, nargs="+", default=argparse.SUPPRESS,
        help=f"sequence lengths to time (default: cpu {CPU_DEFAULTS['lengths']}, "
        f"cuda {GPU_DEFAULTS['lengths']})",
    )  # fmt: skip
    parser.add_argument(
        "--dtypes", nargs="+", default=argparse.SUPPRESS, choices=DTYPES,
        help="input dtypes (default: cpu float32 bfloat16, cuda bfloat16; the fused kernel "
        "computes in float32)",
    )  # fmt: skip
    parser.add_argument(
        "--rows", nargs="+", default=list(ROWS), choices=ROWS, metavar="ROW",
        help=f"CPU kernels to measure. {rows}",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-rows", nargs="+", default=list(gpu.GPU_ROWS), choices=gpu.GPU_ROWS,
        metavar="ROW", help=f"GPU kernels to measure (--device cuda). {gpu_rows}",
    )  # fmt: skip
    parser.add_argument(
        "--head-dims", type=positive_int, nargs="+", default=GPU_DEFAULTS["head_dims"],
        help="head widths D for --device cuda (the CPU report uses --head-dim)",
    )  # fmt: skip
    parser.add_argument(
        "--causal", choices=("both", "yes", "no"), default="both",
        help="causal settings for --device cuda",
    )  # fmt: skip
    parser.add_argument(
        "--time-budget", type=positive_int, default=540, metavar="SECONDS",
        help="--device cuda: start no new setting after this many seconds (those left are "
        "recorded as not measured), so one command fits a time limit",
    )  # fmt: skip
    parser.add_argument(
        "--fused-max-length", type=positive_int, default=8192,
        help="--device cuda: skip the pure-PyTorch fused kernel above this length",
    )  # fmt: skip
    parser.add_argument(
        "--train-steps", type=positive_int, default=10,
        help="--device cuda: timed training steps of the paper preset (median)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-report", type=Path, nargs="+", metavar="JSON",
        help="write the GPU section of --markdown from these results of --device cuda runs "
        "(merged; no GPU needed), print the targets, and stop",
    )  # fmt: skip
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=argparse.SUPPRESS,
        help="batch size B (default: cpu 1, cuda 4)",
    )
    parser.add_argument(
        "--heads",
        type=positive_int,
        default=argparse.SUPPRESS,
        help="heads H (default: cpu 8, cuda 16)",
    )
    parser.add_argument("--head-dim", type=positive_int, default=64, help="head width D")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed repeats (median)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed calls first")
    parser.add_argument(
        "--reference-max-length",
        type=positive_int,
        default=4096,
        help="skip the reference above this length (its (L, L) matrices would not fit)",
    )
    parser.add_argument(
        "--reference-memory-max-length",
        type=positive_int,
        default=8192,
        help="the same limit for the peak-memory probe (a subprocess: if it runs out of memory "
        "the point is reported as failed and the curve extrapolated)",
    )
    parser.add_argument(
        "--dense-max-length",
        type=positive_int,
        default=argparse.SUPPRESS,
        help="skip SDPA with a dense bias above this length (default: cpu 4096, cuda 8192)",
    )
    parser.add_argument(
        "--memory-lengths",
        type=positive_int,
        nargs="*",
        default=[512, 1024, 2048, 4096, 8192],
        help="lengths for the peak-memory curves, float32 forward+backward (none: skip)",
    )
    parser.add_argument(
        "--end-to-end", action=argparse.BooleanOptionalAction, default=True,
        help="also time one training step of small encoders: URPE, RPE, no positions on SDPA "
        "and x-transformers' T5 bias (if installed)",
    )  # fmt: skip
    parser.add_argument(
        "--profile",
        type=non_negative_int,
        default=2048,
        metavar="L",
        help="profile fused URPE forward+backward (float32) at this length and report the "
        "operators it spends its time in (0: skip)",
    )
    parser.add_argument(
        "--threads", type=non_negative_int, default=0, help="torch threads (0: torch's default)"
    )
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--markdown", type=Path, help="write the report here (BENCHMARKS.md)")
    parser.add_argument("--plot", type=Path, help="write the memory curves here (PNG)")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)  # internal: subprocess mode


# --------------------------------------------------------------------------------------------
# Inputs and the candidates


def make_inputs(batch, heads, length, head_dim, dtype, seed=0) -> dict[str, torch.Tensor]:
    """q, k, v (B, H, L, D) and URPE's tables (H, 2L-1), all requiring grad; the dense bias is
    the Toeplitz bias expanded, as a leaf (B, H, L, L) of its own."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    table_b = torch.randn(heads, 2 * length - 1, generator=gen) * 0.02
    table_c = torch.ones(heads, 2 * length - 1) + 0.1 * torch.randn(heads, 2 * length - 1)
    tensors = dict(q=q, k=k, v=v, table_b=table_b, table_c=table_c)
    return {name: t.requires_grad_() for name, t in tensors.items()}


def dense_bias(inputs, batch) -> torch.Tensor:
    q = inputs["q"]
    length = q.shape[-2]
    dense = Toeplitz(inputs["table_b"].detach()).dense(length, length).to(q.dtype)
    return dense.expand(batch, -1, -1, -1).contiguous().requires_grad_()


def candidate(name: str, inputs: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A no-argument callable computing one row's attention output."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    bias, gate = Toeplitz(inputs["table_b"]), Toeplitz(inputs["table_c"])
    if name == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v)
    if name == "sdpa_dense_bias":
        mask = inputs["dense_bias"]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if name in BACKEND_ROWS:
        backend = BACKEND_ROWS[name]
        return lambda: attention(q, k, v, bias=bias, gate=gate, backend=backend)
    if name == "fused_rpe":
        return lambda: attention(q, k, v, bias=bias, backend="fused")
    if name == "flex_rpe":  # inference only: compiled FlexAttention has no CPU backward
        return _flex_rpe(q.detach(), k.detach(), v.detach(), inputs["table_b"].detach())
    raise ValueError(name)


def _flex_rpe(q, k, v, table):
    from torch.nn.attention.flex_attention import flex_attention

    length = q.shape[-2]
    compiled = torch.compile(flex_attention, dynamic=False)  # a length per compile

    def score_mod(score, b, h, q_idx, kv_idx):
        offset = (kv_idx - q_idx).clamp(-(length - 1), length - 1) + length - 1
        return score + table[h, offset].to(score.dtype)

    return lambda: compiled(q, k, v, score_mod=score_mod)


def skip_reason(name: str, length: int, mode: str, args) -> str | None:
    if name in FORWARD_ONLY and mode != "fwd":
        return "forward only"
    if name == "reference_urpe" and length > args.reference_max_length:
        return f"reference skipped above L={args.reference_max_length}"
    if name == "sdpa_dense_bias" and length > args.dense_max_length:
        return f"dense bias skipped above L={args.dense_max_length}"
    return None


def run_once(fn: Callable[[], torch.Tensor], mode: str, inputs) -> None:
    if mode == "fwd":
        with torch.no_grad():
            fn()
        return
    for t in inputs.values():
        t.grad = None
    out = fn()
    out.backward(torch.ones_like(out))


# --------------------------------------------------------------------------------------------
# Timing


def time_rows(args, length: int, dtype_name: str, progress) -> list[dict]:
    """Median times of every row at one length and dtype, rows interleaved per repeat."""
    dtype = DTYPES[dtype_name]
    inputs = make_inputs(args.batch, args.heads, length, args.head_dim, dtype)
    if "sdpa_dense_bias" in args.rows and length <= args.dense_max_length:
        inputs["dense_bias"] = dense_bias(inputs, args.batch)
    results = []
    jobs = []
    for name in args.rows:
        for mode in MODES:
            reason = skip_reason(name, length, mode, args)
            if reason is not None:
                if not (name in FORWARD_ONLY and mode != "fwd"):
                    results.append(_record(name, length, dtype_name, mode, skipped=reason))
                continue
            try:
                fn = candidate(name, inputs)
                for _ in range(args.warmup):
                    run_once(fn, mode, inputs)
            except Exception as error:  # e.g. FlexAttention without a compiler: say so, go on
                message = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                results.append(_record(name, length, dtype_name, mode, skipped=message))
                progress(f"  {name} {mode}: failed ({message})")
                continue
            jobs.append((name, mode, fn))
    times = {(name, mode): [] for name, mode, _ in jobs}
    for repeat in range(args.repeats):
        order = jobs[repeat % len(jobs) :] + jobs[: repeat % len(jobs)] if jobs else []
        for name, mode, fn in order:
            start = time.perf_counter()
            run_once(fn, mode, inputs)
            times[(name, mode)].append(time.perf_counter() - start)
        progress(f"  L={length} {dtype_name}: repeat {repeat + 1}/{args.repeats}")
    for (name, mode), samples in times.items():
        results.append(
            _record(name, length, dtype_name, mode, time_ms=1e3 * statistics.median(samples))
        )
    add_ratios(results)
    return results


def add_ratios(results: list[dict]) -> None:
    """Set `ratio_to_sdpa` on every timed record: its time over bias-free SDPA's time at the
    same length, dtype and mode (records without that baseline get none)."""

    def key(r):
        return (r["length"], r["dtype"], r["mode"])

    baseline = {key(r): r["time_ms"] for r in results if r["name"] == "sdpa" and "time_ms" in r}
    for r in results:
        if "time_ms" in r and key(r) in baseline:
            r["ratio_to_sdpa"] = r["time_ms"] / baseline[key(r)]


def _record(name, length, dtype, mode, **fields) -> dict:
    return dict(name=name, length=length, dtype=dtype, mode=mode, **fields)


# --------------------------------------------------------------------------------------------
# Peak memory, one fresh subprocess per measurement


def _status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Set the process's peak resident set (VmHWM) back to its current size (Linux >= 4.0), so
    that the peak read after a call is that call's, not import time's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def memory_probe(spec: str) -> None:
    """Subprocess side: one call; print the peak resident set during it minus the resident set
    just before it (MB): every allocation counts, torch's or not."""
    name, length, dtype_name, mode, batch, heads, head_dim = spec.split(",")
    length, batch, heads, head_dim = int(length), int(batch), int(heads), int(head_dim)
    inputs = make_inputs(batch, heads, length, head_dim, DTYPES[dtype_name])
    if name == "sdpa_dense_bias":
        inputs["dense_bias"] = dense_bias(inputs, batch)
    fn = candidate(name, inputs)
    before = _status_bytes("VmRSS")
    _reset_peak_rss()
    run_once(fn, mode, inputs)
    peak = _status_bytes("VmHWM")
    print(json.dumps(dict(peak_mb=(peak - before) / 2**20)))


def measure_memory(name, length, dtype_name, mode, args) -> dict:
    spec = ",".join(
        map(str, (name, length, dtype_name, mode, args.batch, args.heads, args.head_dim))
    )
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    command = [sys.executable, "-m", "urpe.bench.attention", "--memory-probe", spec]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    record = _record(name, length, dtype_name, mode)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no message (killed: out of memory?)"]
        record["skipped"] = f"probe failed with exit code {done.returncode}: {last[0][:160]}"
        return record
    result = json.loads(done.stdout.strip().splitlines()[-1])
    record["peak_mb"] = result["peak_mb"]
    return record


def memory_curves(args, progress) -> list[dict]:
    rows = [r for r in ("reference_urpe", "fused_urpe", "fused_rpe", "sdpa") if r in args.rows]
    records = []
    for length in args.memory_lengths:
        for name in rows:
            reason = skip_reason(name, length, "fwdbwd", args)
            if name == "reference_urpe":
                limit = args.reference_memory_max_length
                reason = f"reference skipped above L={limit}" if length > limit else None
            if reason is not None:
                records.append(_record(name, length, "float32", "fwdbwd", skipped=reason))
                continue
            record = measure_memory(name, length, "float32", "fwdbwd", args)
            records.append(record)
            progress(f"  memory {name} L={length}: {record.get('peak_mb', 0):.0f} MB")
    return records


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


# --------------------------------------------------------------------------------------------
# Where the time goes


def profile_fused(args, length: int, top: int = 12) -> list[dict]:
    """Self CPU time per operator of fused URPE forward+backward (float32), averaged over three
    calls after a warm-up, against the whole call's time."""
    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs(args.batch, args.heads, length, args.head_dim, torch.float32)
    fn = candidate("fused_urpe", inputs)
    run_once(fn, "fwdbwd", inputs)
    calls = 3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run_once(fn, "fwdbwd", inputs)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        dict(op=e.key, ms_per_call=e.self_cpu_time_total / 1e3 / calls,
             share=e.self_cpu_time_total / total, count=e.count // calls)
        for e in events[:top]
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# End to end: one training step


def end_to_end(args, progress) -> list[dict]:
    """One optimizer step of small encoders: URPE on auto vs no positions on SDPA vs
    x-transformers with T5 relative bias, at the quick preset's size and at a longer length."""
    try:
        from ..models import TransformerConfig, TransformerEncoder
    except ImportError as error:
        return [dict(name="end_to_end", skipped=f"urpe.models unavailable: {error}")]
    sizes = [
        # the synthetic quick preset: 3 layers, dim 64, 4 heads, FFN 256, length 24, batch 64
        dict(size="quick", batch=64, length=24, dim=64, heads=4, ffn=256, layers=3),
        dict(size="long", batch=2, length=1024, dim=128, heads=8, ffn=512, layers=3),
    ]
    records = []
    for s in sizes:
        models = {}
        for variant, position, gate, backend in (
            ("urpe_auto", "rpe", "toeplitz", "auto"),
            ("rpe_auto", "rpe", None, "auto"),
            ("nope_sdpa", "none", None, "sdpa"),
        ):
            config = TransformerConfig(
                vocab_size=10,
                max_len=s["length"],
                num_layers=s["layers"],
                dim=s["dim"],
                num_heads=s["heads"],
                ffn_dim=s["ffn"],
                position=position,
                gate=gate,
                attention_backend=backend,
            )
            models[variant] = TransformerEncoder(config)
        try:
            from x_transformers import Encoder, TransformerWrapper

            models["xtransformers_t5"] = TransformerWrapper(
                num_tokens=10,
                max_seq_len=s["length"],
                use_abs_pos_emb=False,
                return_only_embed=True,
                attn_layers=Encoder(
                    dim=s["dim"], depth=s["layers"], heads=s["heads"], rel_pos_bias=True
                ),
            )
        except ImportError:
            records.append(dict(name="xtransformers_t5", size=s["size"], skipped="not installed"))
        tokens = torch.randint(0, 10, (s["batch"], s["length"]), generator=torch.Generator())
        steps = {name: _train_step(model, tokens) for name, model in models.items()}
        for step in steps.values():
            for _ in range(max(1, args.warmup)):
                step()
        times = {name: [] for name in steps}
        for _ in range(args.repeats):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["nope_sdpa"])
        for name, samples in times.items():
            t = statistics.median(samples)
            records.append(
                dict(
                    name=name,
                    size=s["size"],
                    **{k: v for k, v in s.items() if k != "size"},
                    time_ms=1e3 * t,
                    ratio_to_nope_sdpa=t / base,
                )
            )
        progress(f"  end-to-end {s['size']}: done")
    return records


def _train_step(model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        hidden = model(tokens)  # (B, L, dim)
        hidden.float().square().mean().backward()
        optimizer.step()

    return step


# --------------------------------------------------------------------------------------------
# Report


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        capability=torch.backends.cpu.get_cpu_capability(),
        torch=torch.__version__,
        python=platform.python_version(),
        load_average=os.getloadavg(),
    )


def targets(times: list[dict], memory: list[dict], e2e: list[dict]) -> list[dict]:
    """Issue 4's targets (float32, L=2048) with the measured value and whether it is met."""

    def t(name, mode, length=2048, dtype="float32"):
        for r in times:
            key = (r["name"], r["mode"], r["length"], r["dtype"])
            if key == (name, mode, length, dtype) and "time_ms" in r:
                return r["time_ms"]
        return None

    def ratio(a, b):
        return None if a is None or b is None else a / b

    def r(a, b, mode):
        return ratio(t(a, mode), t(b, mode))

    out = [
        ("fused URPE fwd+bwd / bias-free SDPA", r("fused_urpe", "sdpa", "fwdbwd"), 1.5),
        ("fused URPE fwd+bwd / SDPA dense bias", r("fused_urpe", "sdpa_dense_bias", "fwdbwd"), 0.5),
        ("fused URPE fwd / bias-free SDPA", r("fused_urpe", "sdpa", "fwd"), 1.3),
        ("fused URPE / fused RPE, fwd+bwd", r("fused_urpe", "fused_rpe", "fwdbwd"), 1.05),
        ("fused URPE / fused RPE, fwd", r("fused_urpe", "fused_rpe", "fwd"), 1.05),
    ]  # fmt: skip
    records = [dict(target=name, value=value, limit=limit) for name, value, limit in out]
    fused = {
        r["length"]: r["peak_mb"] for r in memory if r["name"] == "fused_urpe" and "peak_mb" in r
    }
    ref = {
        r["length"]: r["peak_mb"]
        for r in memory
        if r["name"] == "reference_urpe" and "peak_mb" in r
    }
    if fused:
        longest = max(fused)
        if longest in ref:
            ref_mb, how = ref[longest], "measured"
        else:
            fit = fit_quadratic(sorted(ref.items()))
            ref_mb, how = (
                (None, "")
                if fit is None
                else (fit[0] + fit[1] * longest**2, "extrapolated a + b L^2")
            )
        records.append(
            dict(
                target=f"fused URPE peak memory / reference at L={longest} ({how})",
                value=None if ref_mb is None else fused[longest] / ref_mb,
                limit=1 / 8,
            )
        )
        shortest = min(fused)
        if longest > shortest:
            growth = fused[longest] / max(fused[shortest], 1e-9)
            records.append(
                dict(
                    target=f"fused URPE memory growth L={shortest}->{longest} (linear: "
                    f"{longest // shortest}x, quadratic: {(longest // shortest) ** 2}x)",
                    value=growth,
                    limit=1.25 * longest / shortest,
                )
            )
    by = {(r["name"], r.get("size")): r for r in e2e if "time_ms" in r}
    baselines = (("nope_sdpa", "no-PE SDPA", 1.1), ("xtransformers_t5", "x-transformers T5", 1.0))
    for size in ("quick", "long"):
        urpe = by.get(("urpe_auto", size))
        for name, label, limit in baselines:
            other = by.get((name, size))
            if urpe and other:
                ratio = urpe["time_ms"] / other["time_ms"]
                target = f"end-to-end step ({size}): URPE auto / {label}"
                records.append(dict(target=target, value=ratio, limit=limit))
    for r in records:
        r["met"] = None if r["value"] is None else bool(r["value"] <= r["limit"])
    return records


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Benchmarks: URPE attention",
        "",
        f"Measured {results['date']} on {m['cpu']} ({m['cores']} cores, {m['threads']} torch "
        f"threads, {m['capability']}), torch {m['torch']}, Python {m['python']}. Load average "
        f"at start {_fmt_load(results['load_start'])}, at end {_fmt_load(m['load_average'])} "
        "(other processes shared the cores: compare ratios, measured interleaved in one run, "
        "rather than absolute times).",
        "",
        f"Command: `{results['command']}`. Shapes: B={results['shape']['batch']}, "
        f"H={results['shape']['heads']}, D={results['shape']['head_dim']}. Times are medians of "
        f"{results['repeats']} repeats after warm-up; forward runs under `no_grad`; ratios are to "
        "bias-free SDPA in the same run, dtype and length.",
        "",
        "Which targets are missed, where the time goes and what would close the gap: "
        "`benchmarks/README.md` (written by hand; this file is generated).",
        "",
        "## Targets (float32, L=2048 unless stated)",
        "",
        "| target | measured | limit | met |",
        "|---|---|---|---|",
    ]
    for r in results["targets"]:
        value = "n/a" if r["value"] is None else f"{r['value']:.2f}"
        met = {True: "yes", False: "**no**", None: "n/a"}[r["met"]]
        lines.append(f"| {r['target']} | {value} | {r['limit']:.3g} | {met} |")
    for dtype in results["dtypes"]:
        lines += ["", f"## Time, {dtype}", ""]
        lengths = sorted({r["length"] for r in results["times"] if r["dtype"] == dtype})
        header = "| kernel | " + " | ".join(f"L={n} fwd | L={n} fwd+bwd" for n in lengths) + " |"
        lines += [header, "|---|" + "---|---|" * len(lengths)]
        for name in ROWS:
            cells = []
            for length in lengths:
                for mode in MODES:
                    cells.append(_cell(results["times"], name, length, dtype, mode))
            if any(c != "" for c in cells):
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if results["memory"]:
        lines += [
            "",
            "## Peak memory, float32 forward+backward (MB above the inputs)",
            "",
            "Growth of the process's resident set during one call, in a fresh subprocess "
            "(peak RSS during the call, reset just before it, minus RSS before it).",
            "",
        ]
        lengths = sorted({r["length"] for r in results["memory"]})
        lines += ["| kernel | " + " | ".join(f"L={n}" for n in lengths) + " |"]
        lines += ["|---|" + "---|" * len(lengths)]
        for name in ("reference_urpe", "fused_urpe", "fused_rpe", "sdpa"):
            cells = []
            for length in lengths:
                r = _find(results["memory"], name, length, "float32", "fwdbwd")
                cells.append("" if r is None else f"{r['peak_mb']:.0f}" if "peak_mb" in r else "-")
            if any(cells):
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        if results.get("plot"):
            lines += ["", f"![peak memory]({results['plot']})"]
    if results.get("profile"):
        prof = results["profile"]
        lines += [
            "",
            f"## Where fused URPE spends its time (float32, L={prof['length']}, fwd+bwd)",
            "",
            "Self CPU time per operator (torch.profiler), per call. `bmm`/`baddbmm_` are the "
            "matrix products; the rest is elementwise work over score tiles, which SDPA's "
            "compiled kernel does in cache.",
            "",
            "| operator | ms per call | share | calls |",
            "|---|---|---|---|",
        ]
        for op in prof["ops"]:
            lines.append(f"| `{op['op']}` | {op['ms_per_call']:.1f} | {op['share']:.0%} | "
                         f"{op['count']} |")  # fmt: skip
    if results["end_to_end"]:
        lines += [
            "",
            "## End to end: one training step (forward, backward, Adam)",
            "",
            "| model | size | time (ms) | ratio to no-PE SDPA |",
            "|---|---|---|---|",
        ]
        for r in results["end_to_end"]:
            if "time_ms" in r:
                lines.append(
                    f"| {r['name']} | {r['size']} (B={r['batch']}, L={r['length']}, "
                    f"dim={r['dim']}, heads={r['heads']}) | {r['time_ms']:.1f} | "
                    f"{r['ratio_to_nope_sdpa']:.2f} |"
                )
            else:
                lines.append(f"| {r['name']} | {r.get('size', '')} | {r['skipped']} | |")
    return "\n".join(lines) + "\n"


def _fmt_load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def _find(records, name, length, dtype, mode):
    for r in records:
        if (r["name"], r["length"], r["dtype"], r["mode"]) == (name, length, dtype, mode):
            return r
    return None


def _cell(records, name, length, dtype, mode) -> str:
    r = _find(records, name, length, dtype, mode)
    if r is None:
        return ""
    if "time_ms" not in r:
        return "-"
    ratio = r.get("ratio_to_sdpa")
    return f"{r['time_ms']:.1f} ms" + ("" if ratio is None else f" ({ratio:.2f}x)")


def plot_memory(memory: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("reference_urpe", "fused_urpe", "fused_rpe", "sdpa"):
        points = sorted(
            (r["length"], r["peak_mb"]) for r in memory if r["name"] == name and "peak_mb" in r
        )
        if not points:
            continue
        ax.plot(*zip(*points, strict=True), marker="o", label=name)
        if name == "reference_urpe":
            fit = fit_quadratic(points)
            measured = {length for length, _ in points}
            wanted = sorted({r["length"] for r in memory} - measured)
            if fit is not None and wanted:
                xs = [points[-1][0], *wanted]
                ys = [fit[0] + fit[1] * x**2 for x in xs]
                ys[0] = points[-1][1]
                ax.plot(xs, ys, "--", color=ax.lines[-1].get_color(), label="reference (fit a+bL²)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("peak memory above inputs (MB)")
    ax.set_title("forward+backward, float32, B=1, H=8, D=64")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fill_defaults(args: argparse.Namespace) -> None:
    """Options left out (argparse.SUPPRESS) take the chosen device's defaults."""
    defaults = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for name in ("lengths", "dtypes", "batch", "heads", "dense_max_length"):
        if getattr(args, name, None) is None:
            setattr(args, name, defaults[name])


def run(args: argparse.Namespace) -> int:
    if args.memory_probe:
        memory_probe(args.memory_probe)
        return 0
    _fill_defaults(args)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.gpu_report:
        return gpu.report(args.gpu_report, args.markdown)
    if args.device == "cuda":
        return gpu.run(args, progress, _command_line())
    if args.threads:
        torch.set_num_threads(args.threads)

    results = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=_command_line(),
        shape=dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim),
        repeats=args.repeats,
        dtypes=args.dtypes,
        load_start=os.getloadavg(),
        times=[],
        memory=[],
        end_to_end=[],
    )
    for dtype_name in args.dtypes:
        for length in args.lengths:
            progress(f"timing L={length} {dtype_name}")
            results["times"] += time_rows(args, length, dtype_name, progress)
            _print_times(results["times"], length, dtype_name)
    if args.memory_lengths:
        progress("peak memory (one subprocess per point)")
        results["memory"] = memory_curves(args, progress)
    if args.profile:
        progress(f"profile fused URPE at L={args.profile}")
        results["profile"] = dict(length=args.profile, ops=profile_fused(args, args.profile))
    if args.end_to_end:
        progress("end to end")
        results["end_to_end"] = end_to_end(args, progress)
    results["machine"] = machine()
    results["targets"] = targets(results["times"], results["memory"], results["end_to_end"])
    if args.plot and any("peak_mb" in r for r in results["memory"]):
        plot_memory(results["memory"], args.plot)
        if args.markdown:
            results["plot"] = os.path.relpath(args.plot, args.markdown.parent)
    for r in results["targets"]:
        value = "n/a" if r["value"] is None else f"{r['value']:.2f}"
        print(f"{r['target']}: {value} (limit {r['limit']:.3g}, met: {r['met']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:  # a GPU section already in the file is carried over
        args.markdown.write_text(gpu.keep_section(args.markdown, markdown(results)))
    return 0


def _command_line() -> str:
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "attention"]:
        argv = argv[2:]
    return " ".join(["urpe bench attention", *argv])


def _print_times(times, length, dtype) -> None:
    for r in times:
        if r["length"] == length and r["dtype"] == dtype:
            if "time_ms" in r:
                ratio = r.get("ratio_to_sdpa", math.nan)
                print(f"{dtype} L={length} {r['name']:16s} {r['mode']:7s} {r['time_ms']:9.1f} ms  "
                      f"x{ratio:.2f}")  # fmt: skip
            else:
                print(f"{dtype} L={length} {r['name']:16s} {r['mode']:7s} skipped: {r['skipped']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="urpe bench attention")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
