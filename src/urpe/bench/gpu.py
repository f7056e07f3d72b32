"""The GPU section of `urpe bench attention --device cuda`.

Measures, on one CUDA device and in one run, forward and forward+backward of

    triton_urpe      urpe's Triton kernel, Toeplitz B and C (URPE)
    triton_rpe       the same kernel without the gate (Toeplitz B only)
    flex_urpe        URPE through FlexAttention (the exact lse route, compiled), B and C
    flex_rpe         compiled FlexAttention, Toeplitz B as score_mod, B's gradient included
    sdpa_flash       SDPA without a bias, FlashAttention backend
    sdpa_dense_bias  SDPA with a dense (B, H, L, L) bias that receives a gradient
    fused_urpe       urpe's pure-PyTorch blockwise kernel, B and C
    reference        the materialising reference, B and C

for every length, head dim and causal setting asked for. Times are medians of
`triton.testing.do_bench` (CUDA events, L2 flushed between repeats). TFLOP/s count the two
matrix products of attention, 4 B H Lq Lk D per forward (half of it when causal), and 2.5 times
that for the backward (FlashAttention's convention), so rows are comparable. Peak memory is
`torch.cuda.max_memory_allocated` during one call, above what was allocated before it (inputs).
Ratios compare rows of the same run. The forward outputs of the URPE rows are checked against
the reference where it runs (relative error, recorded). One training step of the synthetic
paper preset (3 layers, 768 wide, 12 heads, L=128, batch 128, bf16 autocast) compares `auto`
(which takes the Triton kernel on CUDA) with no positions on SDPA.

Results go to JSON; `--gpu-report` turns one or more such files into the GPU section of
BENCHMARKS.md (between markers, leaving the CPU part alone), on any machine.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels import Toeplitz, reference_attention
from ..kernels.tables import relative_offsets

GPU_ROWS = {
    "triton_urpe": "urpe's Triton kernel, Toeplitz B and C (URPE)",
    "triton_rpe": "the same Triton kernel without the gate (Toeplitz B only)",
    "flex_urpe": "URPE through compiled FlexAttention (exact lse route), B and C",
    "flex_rpe": "compiled FlexAttention, Toeplitz B as score_mod, B's gradient included",
    "sdpa_flash": "SDPA without a bias, FlashAttention backend",
    "sdpa_dense_bias": "SDPA with a dense (B, H, L, L) bias that receives a gradient",
    "fused_urpe": "urpe's pure-PyTorch blockwise kernel, B and C",
    "reference": "the materialising reference kernel, B and C",
}
MODES = ("fwd", "fwdbwd")
SECTION_BEGIN = "<!-- gpu-section:begin (written by urpe bench attention --gpu-report) -->"
SECTION_END = "<!-- gpu-section:end -->"
DEFAULTS = dict(
    lengths=[1024, 2048, 4096, 8192, 16384],
    batch=4,
    heads=16,
    head_dims=[64, 128],
    dtypes=["bfloat16"],
)
URPE_ROWS = ("triton_urpe", "flex_urpe", "fused_urpe")


# --------------------------------------------------------------------------------------------
# Arithmetic the tables use


def attention_flops(batch, heads, lq, lk, head_dim, causal: bool, mode: str) -> float:
    """Matrix-product FLOPs: 4 B H Lq Lk D forward (q k^T and P V, 2 per multiply-add), halved
    when causal; forward+backward is 3.5 times the forward (backward = 2.5 x forward)."""
    flops = 4.0 * batch * heads * lq * lk * head_dim
    if causal:
        flops /= 2
    return flops * (3.5 if mode == "fwdbwd" else 1.0)


def add_ratios(records: list[dict], baseline: str = "sdpa_flash") -> None:
    """Set `ratio_to_<baseline>` on every timed record: its time over the baseline's time in
    the same setting (length, head dim, causal, dtype, mode)."""

    def key(r):
        return (r["length"], r["head_dim"], r["causal"], r["dtype"], r["mode"])

    base = {key(r): r["time_ms"] for r in records if r["name"] == baseline and "time_ms" in r}
    for r in records:
        if "time_ms" in r and key(r) in base:
            r[f"ratio_to_{baseline}"] = r["time_ms"] / base[key(r)]


# --------------------------------------------------------------------------------------------
# Inputs and candidates


def make_inputs(batch, heads, length, head_dim, dtype, device, seed=0) -> dict[str, torch.Tensor]:
    """q, k, v (B, H, L, D) in `dtype`; Toeplitz tables (H, 2L-1) in float32, the paper's
    initialisation (B ~ N(0, 0.02), C near 1); everything requires grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(3))
    width = 2 * length - 1
    table_b = 0.02 * torch.randn(heads, width, generator=gen, device=device)
    table_c = 1 + 0.1 * torch.randn(heads, width, generator=gen, device=device)
    tensors = dict(q=q, k=k, v=v, table_b=table_b, table_c=table_c)
    return {name: t.requires_grad_() for name, t in tensors.items()}


def _dense_bias(inputs, causal: bool) -> torch.Tensor:
    """The Toeplitz bias as a dense (B, H, L, L) leaf, the causal mask folded in as -inf."""
    q = inputs["q"]
    length = q.shape[-2]
    with torch.no_grad():
        dense = Toeplitz(inputs["table_b"]).dense(length, length).to(q.dtype)  # (1, H, L, L)
        if causal:
            hidden = relative_offsets(length, length, q.device) > 0
            dense = dense.masked_fill(hidden, float("-inf"))
        dense = dense.expand(q.shape[0], -1, -1, -1).contiguous()
    return dense.requires_grad_()


_flex_cache: dict = {}


def _flex_rpe(inputs, causal: bool) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, table = inputs["q"], inputs["k"], inputs["v"], inputs["table_b"]
    length = q.shape[-2]
    if "compiled" not in _flex_cache:
        _flex_cache["compiled"] = torch.compile(flex_attention)
    compiled = _flex_cache["compiled"]
    block_mask = None
    if causal:
        block_mask = create_block_mask(
            lambda b, h, i, j: j <= i, None, None, length, length, device=q.device
        )

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx - q_idx + length - 1]

    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def candidate(name: str, inputs: dict, causal: bool) -> Callable[[], torch.Tensor]:
    """A no-argument callable computing one row's attention output."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    bias, gate = Toeplitz(inputs["table_b"]), Toeplitz(inputs["table_c"])
    if name in ("triton_urpe", "triton_rpe"):
        from ..kernels.triton import triton_attention

        terms = dict(bias=bias, gate=gate if name == "triton_urpe" else None)
        return lambda: triton_attention(q, k, v, **terms, is_causal=causal)
    if name == "flex_urpe":
        from ..kernels.flex import flex_urpe_attention

        return lambda: flex_urpe_attention(q, k, v, bias=bias, gate=gate, is_causal=causal)
    if name == "flex_rpe":
        return _flex_rpe(inputs, causal)
    if name == "sdpa_flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return flash
    if name == "sdpa_dense_bias":
        mask = inputs["dense_bias"]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if name == "fused_urpe":
        from ..kernels.fused import fused_attention

        return lambda: fused_attention(q, k, v, bias=bias, gate=gate, is_causal=causal)
    if name == "reference":
        return lambda: reference_attention(q, k, v, bias=bias, gate=gate, is_causal=causal)
    raise ValueError(f"unknown row {name!r}")


def skip_reason(name: str, length: int, args) -> str | None:
    if name == "reference" and length > args.reference_max_length:
        return f"reference skipped above L={args.reference_max_length} (its (L, L) matrices)"
    if name == "sdpa_dense_bias" and length > args.dense_max_length:
        return f"dense bias skipped above L={args.dense_max_length}"
    if name == "fused_urpe" and length > args.fused_max_length:
        return f"fused kernel skipped above L={args.fused_max_length}"
    return None


# --------------------------------------------------------------------------------------------
# Measuring


def _one_call(fn, mode: str, inputs: dict, grad: list) -> None:
    if mode == "fwd":
        with torch.no_grad():
            fn()
        return
    out = fn()
    if not grad:
        grad.append(torch.randn_like(out))
    out.backward(grad[0])


def measure(fn, mode: str, inputs: dict) -> dict:
    """Median time (ms) and peak memory above the inputs (MB) of one row in one mode."""
    import triton.testing

    grad: list = []
    leaves = [t for t in inputs.values() if t.requires_grad]
    _one_call(fn, mode, inputs, grad)  # compile, autotune
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _one_call(fn, mode, inputs, grad)
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    ms = triton.testing.do_bench(
        lambda: _one_call(fn, mode, inputs, grad),
        warmup=25,
        rep=100,
        grad_to_none=leaves,
        return_mode="median",
    )
    return dict(time_ms=float(ms), peak_mb=float(peak_mb))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def time_setting(args, length, head_dim, causal, dtype_name, progress) -> list[dict]:
    """Every row in both modes at one setting; the URPE rows' forward checked against the
    reference where it runs."""
    dtype = getattr(torch, dtype_name)
    inputs = make_inputs(args.batch, args.heads, length, head_dim, dtype, "cuda")
    setting = dict(
        length=length,
        head_dim=head_dim,
        causal=causal,
        dtype=dtype_name,
        batch=args.batch,
        heads=args.heads,
    )
    records = []
    if "sdpa_dense_bias" in args.gpu_rows and skip_reason("sdpa_dense_bias", length, args) is None:
        try:
            inputs["dense_bias"] = _dense_bias(inputs, causal)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    expected = None
    for name in args.gpu_rows:
        reason = skip_reason(name, length, args)
        if name == "sdpa_dense_bias" and "dense_bias" not in inputs and reason is None:
            reason = "out of memory building the dense bias"
        if reason is not None:
            records += [dict(name=name, mode=m, skipped=reason, **setting) for m in MODES]
            continue
        try:
            fn = candidate(name, inputs, causal)
        except Exception as error:  # noqa: BLE001 - say why, measure the rest
            message = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            records += [dict(name=name, mode=m, skipped=message, **setting) for m in MODES]
            continue
        outputs = {}
        for mode in MODES:
            record = dict(name=name, mode=mode, **setting)
            try:
                record.update(measure(fn, mode, inputs))
                flops = attention_flops(
                    args.batch, args.heads, length, length, head_dim, causal, mode
                )
                record["tflops"] = flops / (record["time_ms"] * 1e-3) / 1e12
                if mode == "fwd" and (name == "reference" or name in URPE_ROWS):
                    with torch.no_grad():
                        outputs[name] = fn()
            except torch.cuda.OutOfMemoryError:
                record["skipped"] = "out of memory"
            except Exception as error:  # noqa: BLE001
                record["skipped"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            torch.cuda.empty_cache()
            records.append(record)
            progress(_progress_line(record))
        if name == "reference" and "reference" in outputs:
            expected = outputs.pop("reference")
        if expected is not None:
            for row, out in outputs.items():
                for r in records:
                    if r["name"] == row and r["mode"] == "fwd":
                        r["error_vs_reference"] = _relative_error(out, expected)
    del inputs, expected
    torch.cuda.empty_cache()
    return records


def _progress_line(r: dict) -> str:
    where = f"L={r['length']} D={r['head_dim']} causal={r['causal']} {r['name']} {r['mode']}"
    if "time_ms" in r:
        return f"  {where}: {r['time_ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s, {r['peak_mb']:.0f} MB"
    return f"  {where}: skipped ({r['skipped']})"


def training_step(args, progress) -> list[dict]:
    """One optimizer step of the synthetic paper preset's model on the GPU (bf16 autocast):
    URPE and RPE on "auto" against no positions on SDPA."""
    from ..experiments.synthetic.presets import PRESETS
    from ..kernels import select_backend
    from ..models import TransformerConfig, TransformerEncoder

    preset = PRESETS["paper"]
    batch, length = preset.batch_size, preset.seq_len
    tokens = torch.randint(0, 10, (batch, length), device="cuda")
    records = []
    for name, position, gate, backend in (
        ("urpe_auto", "rpe", "toeplitz", "auto"),
        ("rpe_auto", "rpe", None, "auto"),
        ("nope_sdpa", "none", None, "sdpa"),
    ):
        config = TransformerConfig(
            vocab_size=10,
            max_len=length,
            num_layers=preset.num_layers,
            dim=preset.dim,
            num_heads=preset.num_heads,
            ffn_dim=preset.ffn_dim,
            position=position,
            gate=gate,
            attention_backend=backend,
        )
        model = TransformerEncoder(config).cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=preset.lr)

        def step(model=model, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hidden = model(tokens)  # (B, L, dim)
            hidden.float().square().mean().backward()
            optimizer.step()

        for _ in range(3):
            step()
        times = []
        for _ in range(args.train_steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        head_dim = preset.dim // preset.num_heads
        probe = torch.empty(
            batch, preset.num_heads, length, head_dim, device="cuda", dtype=torch.bfloat16
        )
        table = Toeplitz(torch.ones(preset.num_heads, 2 * length - 1, device="cuda"))
        picked = select_backend(
            backend,
            q=probe,
            k=probe,
            v=probe,
            bias=table if position == "rpe" else None,
            gate=table if gate else None,
            key_padding_mask=None,
            is_causal=False,
            normalization="softmax",
            scale=None,
            dropout_p=0.0,
        ).name
        records.append(
            dict(
                name=name,
                backend=picked,
                batch=batch,
                length=length,
                dim=preset.dim,
                time_ms=statistics.median(times),
            )
        )
        progress(f"  training step {name} ({picked}): {records[-1]['time_ms']:.2f} ms")
        del model, optimizer
        torch.cuda.empty_cache()
    base = next(r["time_ms"] for r in records if r["name"] == "nope_sdpa")
    for r in records:
        r["ratio_to_nope_sdpa"] = r["time_ms"] / base
    return records


def device_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(
        gpu=props.name,
        multiprocessors=props.multi_processor_count,
        memory_gb=round(props.total_memory / 2**30, 1),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
    )


def run(args, progress, command: str) -> int:
    """`urpe bench attention --device cuda`: measure, write JSON (and the GPU section)."""
    if not torch.cuda.is_available():
        print(
            "urpe bench attention: error: --device cuda: no CUDA device is visible "
            "(torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 2
    started = time.monotonic()
    # FlexAttention compiles per shape and variant: room for the whole grid, so that no row
    # silently falls back to eager (materialising) execution after the default 8 recompiles
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))
    results = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command,
        device=device_info(),
        times=[],
        training=[],
    )
    causal_settings = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            for causal in causal_settings:
                for length in args.lengths:
                    setting = f"L={length} D={head_dim} causal={causal} {dtype_name}"
                    if time.monotonic() - started > args.time_budget:
                        progress(f"time budget spent: {setting} not measured")
                        results["times"].append(
                            dict(
                                name="*",
                                mode="*",
                                length=length,
                                head_dim=head_dim,
                                causal=causal,
                                dtype=dtype_name,
                                skipped="time budget",
                            )
                        )
                        continue
                    progress(f"timing {setting}")
                    results["times"] += time_setting(
                        args, length, head_dim, causal, dtype_name, progress
                    )
    if args.end_to_end:
        progress("training step, synthetic paper preset")
        results["training"] = training_step(args, progress)
    add_ratios(results["times"])
    results["targets"] = targets(results["times"])
    for t in results["targets"]:
        print(f"{t['target']}: {_fmt(t['value'])} (limit {t['limit']}, met: {t['met']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:
        write_section(args.markdown, section_markdown([results]))
    return 0


# --------------------------------------------------------------------------------------------
# Targets and report


def _times(records, name, mode):
    return {
        (r["length"], r["head_dim"], r["causal"], r["dtype"]): r
        for r in records
        if r["name"] == name and r["mode"] == mode and "time_ms" in r
    }


def targets(records: list[dict]) -> list[dict]:
    """Issue 11's targets, each judged on its worst setting (the setting is named)."""
    out = []

    def ratio_target(label, num, den, mode, limit, *, min_length=0, at_least=False):
        """time(num) / time(den) per setting; at most `limit`, or at least it (at_least)."""
        a, b = _times(records, num, mode), _times(records, den, mode)
        values = []
        for key in sorted(set(a) & set(b)):
            if key[0] < min_length:
                continue
            value = a[key]["time_ms"] / b[key]["time_ms"]
            values.append((value, key))
        if not values:
            out.append(dict(target=label, value=None, limit=limit, setting="not measured"))
            return
        worst = min(values) if at_least else max(values)
        met = [(v >= limit) if at_least else (v <= limit) for v, _ in values]
        length, head_dim, causal, dtype = worst[1]
        out.append(
            dict(
                target=label,
                value=worst[0],
                limit=limit,
                met=all(met),
                met_count=f"{sum(met)}/{len(met)}",
                setting=f"L={length} D={head_dim} causal={causal} {dtype}",
            )
        )

    ratio_target("triton URPE fwd+bwd / flex RPE (<=)", "triton_urpe", "flex_rpe", "fwdbwd", 1.3)
    ratio_target(
        "triton URPE fwd+bwd / SDPA-Flash (<=)", "triton_urpe", "sdpa_flash", "fwdbwd", 1.8
    )
    ratio_target(
        "speed-up of triton URPE over SDPA dense bias, fwd+bwd, L >= 4k (>=)",
        "sdpa_dense_bias",
        "triton_urpe",
        "fwdbwd",
        3.0,
        min_length=4096,
        at_least=True,
    )
    for mode in MODES:
        ratio_target(
            f"triton URPE / triton without gate, {mode} (<=)",
            "triton_urpe",
            "triton_rpe",
            mode,
            1.1,
        )
    out.append(memory_target(records))
    for t in out:
        if "met" not in t:
            t["met"] = None
    return out


def memory_target(records: list[dict], name: str = "triton_urpe") -> dict:
    """Peak memory of fwd+bwd linear in L: from the shortest to the longest length measured
    (per head dim and causal setting), growth at most 1.25 x the length ratio."""
    label = f"{name} fwd+bwd peak memory linear in L (growth / length ratio <=)"
    groups: dict = {}
    for r in records:
        if r["name"] == name and r["mode"] == "fwdbwd" and "peak_mb" in r:
            groups.setdefault((r["head_dim"], r["causal"], r["dtype"]), []).append(r)
    worst = None
    for (head_dim, causal, dtype), rows in groups.items():
        rows.sort(key=lambda r: r["length"])
        if len(rows) < 2:
            continue
        short, long = rows[0], rows[-1]
        growth = long["peak_mb"] / max(short["peak_mb"], 1e-9)
        value = growth / (long["length"] / short["length"])
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


def _fmt(value, digits=2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def section_markdown(runs: list[dict]) -> str:
    """The GPU section of BENCHMARKS.md from one or more runs' results (merged)."""
    lines = [SECTION_BEGIN, "", "## GPU: Triton kernel, FlexAttention route, SDPA", ""]
    if not runs:
        lines += [
            "**Pending: no GPU run yet.** The kernels are verified on the CPU (Triton's "
            "interpreter, FlexAttention in float64); no GPU figure has been measured, and none "
            "is estimated. `benchmarks/README.md` gives the exact commands for a GPU session.",
            "",
            SECTION_END,
        ]
        return "\n".join(lines) + "\n"
    records = [r for run in runs for r in run["times"]]
    add_ratios(records)
    device = runs[0]["device"]
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
        "| target | measured | limit | met | worst setting | settings met |",
        "|---|---|---|---|---|---|",
    ]
    for t in targets(records):
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(
            f"| {t['target']} | {_fmt(t['value'])} | {t['limit']} | {met} | "
            f"{t['setting']} | {t.get('met_count', '')} |"
        )
    settings = sorted({(r["head_dim"], r["causal"], r["dtype"]) for r in records})
    for head_dim, causal, dtype in settings:
        rows = [
            r
            for r in records
            if (r["head_dim"], r["causal"], r["dtype"]) == (head_dim, causal, dtype)
        ]
        lengths = sorted({r["length"] for r in rows})
        batch = next((r["batch"] for r in rows if "batch" in r), "?")
        heads = next((r["heads"] for r in rows if "heads" in r), "?")
        for mode in MODES:
            lines += [
                "",
                f"### {'forward' if mode == 'fwd' else 'forward+backward'}, D={head_dim}, "
                f"{'causal' if causal else 'not causal'}, {dtype}, B={batch}, H={heads}",
                "",
                "ms · TFLOP/s · ratio to SDPA-Flash · peak MB",
                "",
                "| kernel | " + " | ".join(f"L={n}" for n in lengths) + " |",
                "|---|" + "---|" * len(lengths),
            ]
            for name in GPU_ROWS:
                cells = []
                for length in lengths:
                    r = next(
                        (
                            x
                            for x in rows
                            if (x["name"], x["mode"], x["length"]) == (name, mode, length)
                        ),
                        None,
                    )
                    cells.append(_cell(r))
                if any(cells):
                    lines.append(f"| {name} | " + " | ".join(cells) + " |")
    checks = [r for r in records if "error_vs_reference" in r]
    if checks:
        lines += [
            "",
            "### Forward outputs against the reference (relative error)",
            "",
            "| kernel | setting | ‖out − ref‖ / ‖ref‖ |",
            "|---|---|---|",
        ]
        for r in checks:
            lines.append(
                f"| {r['name']} | L={r['length']} D={r['head_dim']} "
                f"causal={r['causal']} {r['dtype']} | {r['error_vs_reference']:.1e} |"
            )
    training = [r for run in runs for r in run.get("training", [])]
    if training:
        lines += [
            "",
            "### One training step, synthetic paper preset (bf16 autocast, Adam)",
            "",
            "| model | backend auto picked | B x L, width | ms | ratio to no-PE SDPA |",
            "|---|---|---|---|---|",
        ]
        for r in training:
            lines.append(
                f"| {r['name']} | {r['backend']} | {r['batch']} x {r['length']}, "
                f"{r['dim']} | {r['time_ms']:.2f} | {r['ratio_to_nope_sdpa']:.2f} |"
            )
    lines += ["", SECTION_END]
    return "\n".join(lines) + "\n"


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if "time_ms" not in r:
        return "-"
    ratio = r.get("ratio_to_sdpa_flash")
    parts = [f"{r['time_ms']:.2f}", f"{r['tflops']:.0f}"]
    parts.append("" if ratio is None else f"{ratio:.2f}x")
    parts.append(f"{r['peak_mb']:.0f}")
    return " · ".join(p for p in parts if p)


def write_section(path: Path, section: str) -> None:
    """Put the GPU section into the Markdown file at `path`, replacing an earlier one and
    keeping everything else (the CPU report)."""
    text = path.read_text() if path.exists() else ""
    if SECTION_BEGIN in text and SECTION_END in text:
        head, rest = text.split(SECTION_BEGIN, 1)
        tail = rest.split(SECTION_END, 1)[1]
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def keep_section(path: Path, new_text: str) -> str:
    """`new_text` (a freshly written CPU report) with the GPU section of the file at `path`
    carried over, so that a CPU run does not erase GPU figures."""
    old = path.read_text() if path.exists() else ""
    if SECTION_BEGIN not in old or SECTION_END not in old:
        return new_text
    section = SECTION_BEGIN + old.split(SECTION_BEGIN, 1)[1].split(SECTION_END, 1)[0] + SECTION_END
    return new_text.rstrip("\n") + "\n\n" + section + "\n"


def report(paths: list[Path], markdown: Path | None) -> int:
    """`--gpu-report`: the GPU section from saved JSON results (no GPU needed)."""
    runs = []
    for path in paths:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as error:
            print(f"urpe bench attention: error: --gpu-report {path}: {error}", file=sys.stderr)
            return 2
        if "times" not in runs[-1] or "device" not in runs[-1]:
            print(
                f"urpe bench attention: error: --gpu-report {path}: not a GPU results file",
                file=sys.stderr,
            )
            return 2
    section = section_markdown(runs)
    if markdown is None:
        print(section)
    else:
        write_section(markdown, section)
    records = [r for run in runs for r in run["times"]]
    add_ratios(records)
    for t in targets(records):
        print(f"{t['target']}: {_fmt(t['value'])} (limit {t['limit']}, met: {t['met']})")
    return 0


def pending_section() -> str:
    return section_markdown([])


__all__ = ["GPU_ROWS", "attention_flops", "report", "run", "targets", "write_section"]
