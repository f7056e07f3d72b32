"""`urpe bench attention`: its rows come from the backend registry and compute what they name,
its pipeline times them and divides by the right baseline, its targets and reports follow from
known records, the busy-core condition really loads a core, and a tiny real run writes files
of the documented schema.

No speed is asserted (timings on a shared machine are noise); the targets live in BENCHMARKS.md,
produced by the full run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from urpe.bench import (
    contention,
    gpu_section,
    measure,
    packing_rows,
    report,
    rows,
    sections,
    targets,
)
from urpe.bench.end_to_end import Size, end_to_end
from urpe.bench.inputs import dense_bias, make_inputs
from urpe.bench.memory import fit_quadratic
from urpe.cli import main
from urpe.kernels import (
    BACKENDS,
    Backend,
    Decay,
    Toeplitz,
    native_backends,
    reference_attention,
    register_backend,
    registered,
)
from urpe.kernels.capabilities import Capabilities
from urpe.kernels.reference import reference_run

ROOT = Path(__file__).resolve().parent.parent
SMALL_ROWS = [
    "sdpa",
    "sdpa_dense_bias",
    "reference_urpe",
    "blockwise_urpe",
    "blockwise_rpe",
    "cpp_urpe",
]
SMALL_ROWS = [name for name in SMALL_ROWS if name in rows.rows_for("cpu")]  # cpp: where built


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(
        [
            "bench",
            "attention",
            "--lengths",
            "48",
            "64",
            "--dtypes",
            "float32",
            "--rows",
            *SMALL_ROWS,
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "2",
            "--memory-lengths",
            "512",
            "--no-end-to-end",
            "--profile",
            "64",
            "--json",
            str(out / "bench.json"),
            "--markdown",
            str(out / "BENCH.md"),
            "--plot",
            str(out / "memory.png"),
        ]
    )
    assert code == 0
    return out


# --------------------------------------------------------------------------------------------
# A tiny real run: files of the documented schema, finite times


def test_a_small_run_writes_the_documented_json(small_run):
    results = json.loads((small_run / "bench.json").read_text())
    assert {
        "date",
        "command",
        "shape",
        "repeats",
        "dtypes",
        "load_start",
        "times",
        "memory",
        "end_to_end",
        "profile",
        "machine",
        "targets",
        "plot",
    } <= set(results)
    assert results["shape"] == dict(batch=1, heads=2, head_dim=16)
    for length in (48, 64):
        for mode in ("fwd", "fwdbwd"):
            setting = (length, mode, "float32")
            timed = {
                r["name"]: r
                for r in results["times"]
                if (r["length"], r["mode"], r["dtype"]) == setting
            }
            assert set(timed) == set(SMALL_ROWS)
            assert timed["sdpa"]["ratio_to_sdpa"] == 1.0
            for r in timed.values():
                assert math.isfinite(r["time_ms"]) and r["time_ms"] > 0
                assert r["ratio_to_sdpa"] == pytest.approx(r["time_ms"] / timed["sdpa"]["time_ms"])
    for t in results["targets"]:
        assert set(t) >= {"target", "value", "limit", "met"}


def test_memory_is_measured_in_subprocesses_and_plotted(small_run):
    results = json.loads((small_run / "bench.json").read_text())
    memory = {(r["name"], r["length"]): r for r in results["memory"]}
    tiled = {"reference_urpe", "blockwise_urpe", "blockwise_rpe", "cpp_urpe", "sdpa"}
    rows = tiled & set(SMALL_ROWS)
    assert set(memory) == {(n, 512) for n in rows}
    # The reference materialises (B, H, L, L) matrices: at L=512 with H=2 in float32 each
    # is 2 MB, and forward+backward keeps several.
    assert memory[("reference_urpe", 512)]["peak_mb"] > 4
    assert (small_run / "memory.png").stat().st_size > 1000


def test_markdown_of_a_small_run(small_run):
    text = (small_run / "BENCH.md").read_text()
    assert "## Targets" in text and "## Time, float32" in text and "## Peak memory" in text
    assert "| blockwise_urpe |" in text and "![peak memory](memory.png)" in text
    if "cpp_urpe" in SMALL_ROWS:  # the profile's default row
        assert "## Where cpp URPE spends its time" in text and "`urpe_cpp::backward`" in text
    assert "## Under contention" not in text  # not asked for


# --------------------------------------------------------------------------------------------
# Rows: from the registry, each computing what its name says


@pytest.fixture
def dummy_backends():
    """Two extra backends, one for any device and one built for CUDA only; removed after."""
    calls = []

    def run(spec):
        calls.append(spec)
        return reference_run(spec)

    cuda_only = Capabilities("a test kernel", devices=("cuda",))
    with (
        registered(register_backend, Backend("bench_dummy", run)),
        registered(register_backend, Backend("bench_dummy_cuda", run, capabilities=cuda_only)),
    ):
        yield calls


def test_every_registered_backend_is_a_row(dummy_backends):
    cpu, cuda = rows.rows_for("cpu"), rows.rows_for("cuda")
    for name, backend in BACKENDS.items():
        if name == "sdpa":
            continue
        native = name in native_backends("cpu")  # built for the CPU and able to run here
        assert (f"{name}_urpe" in cpu) == native
        if name != "flex":  # flex_rpe is FlexAttention's own route, a baseline (below)
            assert (f"{name}_rpe" in cpu) == native
        assert (f"{name}_urpe" in cuda) == (backend.devices is None or "cuda" in backend.devices)
    assert "bench_dummy_urpe" in rows.default_rows("cpu", targets.named_rows("cpu"))
    assert "bench_dummy_cuda_urpe" not in cpu and "bench_dummy_cuda_urpe" in cuda
    # FlexAttention's own route keeps its name: the "flex" backend has no RPE row of its own.
    assert cuda["flex_rpe"].help.startswith("compiled FlexAttention")


def test_the_rows_are_chosen_and_checked_when_the_command_runs(dummy_backends, monkeypatch):
    """The flags offer rows without importing torch; what runs here is decided at run time: the
    targets' default rows, a backend registered before the run, and a row that cannot run here
    refused in one line (a C++ kernel that cannot be built, say)."""
    import argparse

    from urpe.bench import options
    from urpe.cli_types import UsageError

    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    args = parser.parse_args([])
    options.fill_defaults(args)
    assert args.rows == rows.default_rows("cpu", targets.named_rows("cpu"))
    assert "bench_dummy_urpe" in args.rows and "bench_dummy_cuda_urpe" in args.gpu_rows
    args = parser.parse_args(["--rows", "sdpa", "fused_urpe"])  # the old name of a row
    options.fill_defaults(args)
    assert args.rows == ["sdpa", "blockwise_urpe"]
    here = {name: row for name, row in rows.rows_for("cpu").items() if name != "blockwise_urpe"}
    everywhere = rows.rows_for
    monkeypatch.setattr(rows, "rows_for", lambda d: here if d == "cpu" else everywhere(d))
    with pytest.raises(UsageError, match="--rows: blockwise_urpe cannot run here; choose from"):
        options.fill_defaults(parser.parse_args(["--rows", "sdpa", "blockwise_urpe"]))


def test_a_registered_backend_is_timed_through_its_run(dummy_backends):
    chosen = [rows.rows_for("cpu")[name] for name in ("sdpa", "bench_dummy_urpe")]
    inputs = make_inputs(1, 2, 32, 8, torch.float32)
    quiet = measure.Method("cpu", repeats=2, progress=lambda line: None)
    records = measure.measure_setting(chosen, inputs, dict(length=32, dtype="float32"), quiet)
    by = {(r["name"], r["mode"]): r for r in records}
    assert set(by) == {(n, m) for n in ("sdpa", "bench_dummy_urpe") for m in ("fwd", "fwdbwd")}
    assert all(r["time_ms"] > 0 for r in records)
    assert by[("bench_dummy_urpe", "fwd")]["ratio_to_sdpa"] > 0
    # warm-up and two repeats, in each of two modes, all went through the backend
    assert len(dummy_backends) == 6 and dummy_backends[0].gate is not None


def test_a_failing_row_is_recorded_and_the_rest_measured():
    def broken(inputs, causal):
        raise RuntimeError("cannot build\nsecond line")

    chosen = [rows.rows_for("cpu")["sdpa"], rows.Row("broken", "fails", broken)]
    quiet = measure.Method("cpu", repeats=1, progress=lambda line: None)
    inputs = make_inputs(1, 1, 16, 8, torch.float32)
    records = measure.measure_setting(chosen, inputs, dict(length=16, dtype="float32"), quiet)
    failed = [r for r in records if r["name"] == "broken"]
    assert [r["skipped"] for r in failed] == ["RuntimeError: cannot build"] * 2
    assert all("time_ms" in r for r in records if r["name"] == "sdpa")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rows_compute_the_attention_they_name(device, monkeypatch):
    """Every row of the device, on CPU tensors (Triton under its interpreter), against the
    reference: URPE rows with B and C, RPE rows and the dense-bias and FlexAttention baselines
    with B alone, SDPA without either."""
    want = dict(sdpa="plain", sdpa_flash="plain", sdpa_dense_bias="rpe", flex_rpe="rpe")
    for causal in (False, True) if device == "cuda" else (False,):  # the CPU report: not causal
        # L=64: compiled FlexAttention on the CPU (torch 2.13) is wrong at lengths such as 40
        # or 200, even without a bias; the benchmark's lengths are powers of two. Detached:
        # FlexAttention refuses CPU leaves that require grad even under no_grad.
        inputs = {n: t.detach() for n, t in make_inputs(1, 2, 64, 16, torch.float32).items()}
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        bias, gate = Toeplitz(inputs["table_b"]), Toeplitz(inputs["table_c"])
        expected = {
            "urpe": reference_attention(q, k, v, bias=bias, gate=gate, is_causal=causal),
            "rpe": reference_attention(q, k, v, bias=bias, is_causal=causal),
            "plain": reference_attention(q, k, v, is_causal=causal),
        }
        monkeypatch.setattr(packing_rows, "DOCUMENT_LENGTHS", (3, 20))  # several per row
        for name, row in rows.rows_for(device).items():
            try:
                with torch.no_grad():
                    got = row.build(inputs, causal)()
            except ValueError as error:  # a backend that takes no documents or Decay yet
                assert name.startswith(("packed_", "decay_")), error
                assert "cannot run this call" in str(error)
                continue
            if name.startswith("packed_"):
                ids = inputs["document_ids"]
                assert ids.unique().numel() >= 4
                want_out = reference_attention(q, k, v, document_ids=ids, is_causal=causal)
            elif name.startswith("decay_"):
                decay = Decay(inputs["log_forget"])
                want_out = reference_attention(q, k, v, bias=decay, is_causal=causal)
            else:
                want_out = expected[want[name] if name in want else name.rsplit("_", 1)[1]]
            torch.testing.assert_close(got, want_out, atol=2e-5, rtol=2e-5, msg=name)


def test_dense_bias_is_the_toeplitz_bias_with_the_causal_mask():
    inputs = make_inputs(2, 3, 5, 4, torch.float32)
    dense = dense_bias(inputs, causal=True)
    table = inputs["table_b"]
    assert dense.shape == (2, 3, 5, 5) and dense.requires_grad and dense.is_leaf
    for i, j in ((0, 0), (3, 1), (4, 0)):
        assert dense[1, 2, i, j] == table[2, j - i + 4]
    assert dense[0, 0, 1, 3] == -math.inf


def test_length_limits_skip_rows_with_a_reason():
    class Limits:
        reference_max_length, dense_max_length, blockwise_max_length = 64, 32, None

    cpu = rows.rows_for("cpu")
    assert (
        rows.skip_reason(cpu["reference_urpe"], 128, Limits) == "reference_urpe skipped above L=64"
    )
    assert rows.skip_reason(cpu["sdpa_dense_bias"], 64, Limits) is not None
    assert rows.skip_reason(cpu["blockwise_urpe"], 10**6, Limits) is None  # no cap on the CPU
    assert rows.skip_reason(cpu["sdpa"], 10**6, Limits) is None


# --------------------------------------------------------------------------------------------
# Ratios and targets on known records


def _timed(name, mode, ms, length=2048, dtype="float32", **condition):
    return dict(name=name, mode=mode, length=length, dtype=dtype, time_ms=ms, **condition)


def test_ratios_divide_by_the_baseline_of_the_same_setting_and_condition():
    records = [
        _timed("sdpa", "fwd", 4.0),
        _timed("blockwise_urpe", "fwd", 6.0),
        _timed("sdpa", "fwdbwd", 10.0),
        _timed("blockwise_urpe", "fwdbwd", 25.0),
        _timed("blockwise_urpe", "fwd", 3.0, length=128),  # no SDPA at this length
        _timed("sdpa", "fwd", 1.0, dtype="bfloat16"),
        _timed("sdpa", "fwd", 2.0, threads=1, busy=True),
        _timed("blockwise_urpe", "fwd", 7.0, threads=1, busy=True),
        _timed("blockwise_urpe", "fwd", 7.0, threads=2, busy=True),  # no SDPA at 2 threads
        dict(name="reference_urpe", mode="fwd", length=2048, dtype="float32", skipped="too long"),
    ]
    measure.add_ratios(records, "sdpa")
    assert records[1]["ratio_to_sdpa"] == 1.5 and records[3]["ratio_to_sdpa"] == 2.5
    assert records[7]["ratio_to_sdpa"] == 3.5
    assert all("ratio_to_sdpa" not in records[i] for i in (4, 8, 9))


def test_cpu_targets_on_known_records():
    times = [
        _timed("sdpa", "fwdbwd", 10.0),
        _timed("blockwise_urpe", "fwdbwd", 14.0),
        _timed("sdpa_dense_bias", "fwdbwd", 40.0),
        _timed("blockwise_rpe", "fwdbwd", 13.0),
        _timed("sdpa", "fwd", 4.0),
        _timed("blockwise_urpe", "fwd", 6.0),
        _timed("blockwise_rpe", "fwd", 6.0),
        _timed("blockwise_urpe", "fwdbwd", 1.0, length=512),
    ]
    memory = [dict(name="blockwise_urpe", length=n, peak_mb=0.01 * n) for n in (512, 8192)]
    memory += [dict(name="reference_urpe", length=n, peak_mb=1e-4 * n * n) for n in (512, 1024)]
    e2e = [
        dict(name="urpe_auto", size="quick", time_ms=30.0),
        dict(name="nope_sdpa", size="quick", time_ms=20.0),
    ]
    result = {t["target"]: t for t in targets.cpu_targets(times, memory, e2e)}
    sdpa = result["blockwise URPE fwd+bwd / bias-free SDPA"]
    assert sdpa["value"] == pytest.approx(1.4) and sdpa["met"] is True
    assert result["blockwise URPE fwd / bias-free SDPA"]["met"] is False  # 1.5 > 1.3
    assert result["blockwise URPE fwd+bwd / SDPA dense bias"]["value"] == pytest.approx(0.35)
    assert result["blockwise URPE / blockwise RPE, fwd+bwd"]["value"] == pytest.approx(14 / 13)
    memory_ratio = result[
        "blockwise URPE peak memory / reference at L=8192 (extrapolated a + b L^2)"
    ]
    assert memory_ratio["value"] == pytest.approx(0.01 * 8192 / (1e-4 * 8192**2), rel=1e-6)
    growth = result["blockwise URPE memory growth L=512->8192 (linear: 16x, quadratic: 256x)"]
    assert growth["value"] == pytest.approx(16.0) and growth["met"] is True
    e2e_ratio = result["end-to-end step (quick): URPE auto / no-PE SDPA"]
    assert e2e_ratio["value"] == 1.5 and e2e_ratio["met"] is False
    assert not any("thread" in name for name in result)  # contention not measured: no rows


def test_contention_targets_are_judged_on_their_own_condition():
    idle = [_timed("sdpa", "fwdbwd", 10.0), _timed("cpp_urpe", "fwdbwd", 14.0)]
    contention = [
        _timed("sdpa", "fwdbwd", 10.0, threads=2, busy=False),
        _timed("cpp_urpe", "fwdbwd", 13.0, threads=2, busy=False),
        _timed("sdpa", "fwdbwd", 11.0, threads=2, busy=True),
        _timed("cpp_urpe", "fwdbwd", 33.0, threads=2, busy=True),
    ]
    result = {t["target"]: t for t in targets.cpu_targets(idle, [], [], contention)}
    busy = result["cpp URPE fwd+bwd / bias-free SDPA, 2 thread(s), one core busy"]
    assert busy["value"] == pytest.approx(3.0) and busy["met"] is False
    calm = result["cpp URPE fwd+bwd / bias-free SDPA, 2 thread(s), idle"]
    assert calm["value"] == pytest.approx(1.3) and calm["met"] is True
    assert result["cpp URPE fwd+bwd / bias-free SDPA, 1 thread(s), idle"]["value"] is None
    assert result["cpp URPE fwd+bwd / bias-free SDPA"]["value"] == pytest.approx(1.4)


def test_the_cpp_targets_judge_bfloat16_and_memory_on_their_own_rows():
    times = [
        _timed("sdpa", "fwdbwd", 10.0, dtype="bfloat16"),
        _timed("cpp_urpe", "fwdbwd", 17.0, dtype="bfloat16"),
        _timed("cpp_urpe", "fwd", 2.1),
        _timed("cpp_rpe", "fwd", 2.0),
    ]
    memory = [dict(name="cpp_urpe", length=n, peak_mb=0.02 * n) for n in (512, 8192)]
    memory += [dict(name="reference_urpe", length=8192, peak_mb=2000.0)]
    result = {t["target"]: t for t in targets.cpu_targets(times, memory, [])}
    bf16 = result["cpp URPE fwd+bwd / bias-free SDPA, bfloat16"]
    assert bf16["value"] == pytest.approx(1.7) and bf16["met"] is False
    assert result["cpp URPE / cpp RPE, fwd"]["value"] == pytest.approx(1.05)
    assert result["cpp URPE / cpp RPE, fwd+bwd"]["value"] is None  # not measured
    assert result["cpp URPE peak memory / reference at L=8192 (measured)"]["value"] == (
        pytest.approx(0.02 * 8192 / 2000.0)
    )
    assert "blockwise URPE peak memory / reference at L=8192 (measured)" not in result


def _gpu_record(name, mode, ms, length=4096, head_dim=64, causal=False, peak_mb=100.0):
    return dict(
        name=name,
        mode=mode,
        length=length,
        head_dim=head_dim,
        causal=causal,
        dtype="bfloat16",
        batch=4,
        heads=16,
        time_ms=ms,
        tflops=1.0,
        peak_mb=peak_mb,
    )


def test_gpu_targets_are_judged_on_the_worst_setting():
    records = []
    for length, urpe_ms, flex_ms in ((4096, 2.4, 2.0), (8192, 9.0, 6.0)):  # 1.2x, then 1.5x
        records += [
            _gpu_record("triton_urpe", "fwdbwd", urpe_ms, length, peak_mb=length / 16),
            _gpu_record("triton_urpe", "fwd", 1.0, length),
            _gpu_record("triton_rpe", "fwdbwd", urpe_ms / 1.05, length),
            _gpu_record("triton_rpe", "fwd", 0.8, length),  # gate costs 1.25x forward
            _gpu_record("flex_rpe", "fwdbwd", flex_ms, length),
            _gpu_record("sdpa_flash", "fwdbwd", 2.0, length),
            _gpu_record("sdpa_dense_bias", "fwdbwd", 12.0, length),  # 5x, then 1.33x
        ]
    result = {t["target"].split(" (")[0]: t for t in targets.gpu_targets(records)}
    flex = result["triton URPE fwd+bwd / flex RPE"]
    assert flex["value"] == pytest.approx(1.5) and flex["met"] is False
    assert flex["met_count"] == "1/2" and "L=8192" in flex["setting"]
    dense = result["speed-up of triton URPE over SDPA dense bias, fwd+bwd, L >= 4k"]
    assert dense["value"] == pytest.approx(12.0 / 9.0) and dense["met"] is False
    assert result["triton URPE / triton without gate, fwdbwd"]["met"] is True
    assert result["triton URPE / triton without gate, fwd"]["value"] == pytest.approx(1.25)
    memory = result["triton_urpe fwd+bwd peak memory linear in L"]
    assert memory["value"] == pytest.approx(1.0) and memory["met"] is True  # 256 -> 512 MB


def test_quadratic_gpu_memory_misses_the_linear_target():
    records = [
        _gpu_record("triton_urpe", "fwdbwd", 1.0, n, peak_mb=n * n / 1e5) for n in (1024, 4096)
    ]
    assert targets.gpu_memory_target(records)["value"] == pytest.approx(4.0)
    assert targets.gpu_memory_target(records)["met"] is False


def test_quadratic_fit_recovers_its_coefficients():
    points = [(n, 3.0 + 2e-4 * n * n) for n in (256, 512, 1024)]
    a, b = fit_quadratic(points)
    assert a == pytest.approx(3.0) and b == pytest.approx(2e-4)
    assert fit_quadratic(points[:1]) is None


# --------------------------------------------------------------------------------------------
# Reports from fixed results


def test_the_report_reproduces_benchmarks_md_from_its_json():
    """BENCHMARKS.md's CPU part is what `report.markdown` writes from benchmarks/attention.json,
    its targets recomputed from the stored records."""
    results = json.loads((ROOT / "benchmarks" / "attention.json").read_text())
    results["targets"] = targets.cpu_targets(
        results["times"], results["memory"], results["end_to_end"], results.get("contention", [])
    )
    published = (ROOT / "BENCHMARKS.md").read_text().split(gpu_section.SECTION_BEGIN)[0]
    assert report.markdown(results) == published.rstrip("\n") + "\n"


def test_contention_section_from_known_records():
    results = json.loads((ROOT / "benchmarks" / "attention.json").read_text())
    results["contention"] = [
        {**_timed(name, mode, ms * factor, threads=t, busy=b), "ratio_to_sdpa": factor}
        for t, b, factor in ((1, False, 1.0), (1, True, 1.0), (2, False, 1.0), (2, True, 1.0))
        for name, mode, ms in (("sdpa", "fwd", 4.0), ("sdpa", "fwdbwd", 10.0))
    ] + [
        {**_timed("blockwise_urpe", "fwdbwd", 31.0, threads=2, busy=True), "ratio_to_sdpa": 3.1},
        dict(
            name="blockwise_urpe",
            mode="fwd",
            length=2048,
            dtype="float32",
            threads=2,
            busy=True,
            skipped="failed",
        ),
    ]
    text = report.markdown(results)
    section = text.split("## Under contention")[1].split("\n## ")[0]
    assert "### float32, L=2048" in section
    assert (
        "| kernel | fwd, 1T idle | fwd, 1T busy | fwd, 2T idle | fwd, 2T busy | "
        "fwd+bwd, 1T idle | fwd+bwd, 1T busy | fwd+bwd, 2T idle | fwd+bwd, 2T busy |"
    ) in section
    assert "| blockwise_urpe |  |  |  | - |  |  |  | 3.10x (31.0) |" in section
    assert "| sdpa | 1.00x (4.0) |" in section


def test_gpu_section_is_written_between_markers_and_survives_a_cpu_report(tmp_path):
    path = tmp_path / "BENCH.md"
    path.write_text("# Benchmarks\n\nCPU tables\n")
    gpu_section.write_section(path, gpu_section.section_markdown([]))
    gpu_section.write_section(path, gpu_section.section_markdown([]))  # replaced, not appended
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nCPU tables\n")
    assert text.count(gpu_section.SECTION_BEGIN) == 1 and "Pending: no GPU run yet" in text
    rewritten = sections.keep_sections(path, "# Benchmarks\n\nnew CPU tables\n")
    assert "new CPU tables" in rewritten and "Pending: no GPU run yet" in rewritten
    assert "CPU tables\n" not in rewritten.replace("new CPU tables\n", "")


def test_gpu_report_from_saved_results(tmp_path, capsys):
    records = [
        _gpu_record("triton_urpe", "fwdbwd", 2.5),
        _gpu_record("sdpa_flash", "fwdbwd", 2.0),
        dict(
            name="reference",
            mode="fwdbwd",
            length=4096,
            head_dim=64,
            causal=False,
            dtype="bfloat16",
            skipped="out of memory",
        ),
    ]  # an older file's row name
    results = dict(
        date="2026-01-01 00:00 UTC",
        command="urpe bench attention --device cuda",
        device=dict(
            gpu="Test GPU", multiprocessors=1, memory_gb=1.0, torch="t", triton="t", cuda="c"
        ),
        times=records,
        training=[
            dict(
                name="urpe_auto",
                backend="triton",
                batch=128,
                length=128,
                dim=768,
                time_ms=30.0,
                ratio_to_nope_sdpa=1.2,
            )
        ],
    )
    saved = tmp_path / "gpu.json"
    saved.write_text(json.dumps(results))
    markdown = tmp_path / "BENCH.md"
    args = ["bench", "attention", "--gpu-report", str(saved), "--markdown", str(markdown)]
    assert main(args) == 0
    text = markdown.read_text()
    assert "| triton_urpe | 2.50 · 1 · 1.25x · 100 |" in text  # 2.5 ms / 2.0 ms
    assert "| reference_urpe | - |" in text and "Test GPU" in text
    assert "| urpe_auto | triton | 128 x 128, 768 | 30.00 | 1.20 |" in text
    assert "triton URPE fwd+bwd / SDPA-Flash (<=): 1.25" in capsys.readouterr().out


def test_gpu_report_rejects_a_file_that_is_not_results(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "attention", "--gpu-report", str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --------------------------------------------------------------------------------------------
# Contention: the busy core is real, and a run reports idle and busy side by side


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_busy_core_spins_a_pinned_child_for_the_block_only():
    core = contention.busy_core_index()
    with contention.busy_core(core) as pid:
        assert os.sched_getaffinity(pid) == {core}
        before = _cpu_seconds(pid)
        time.sleep(0.5)
        assert _cpu_seconds(pid) - before > 0.05  # it burns CPU (shared machine: a low bar)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_condition_sets_and_restores_the_thread_count():
    before = torch.get_num_threads()
    with contention.Condition(threads=1, busy=False).applied():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    assert [c.fields for c in contention.conditions([1, 2])] == [
        dict(threads=1, busy=False),
        dict(threads=1, busy=True),
        dict(threads=2, busy=False),
        dict(threads=2, busy=True),
    ]


def test_a_contention_run_reports_every_condition(tmp_path):
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "attention",
            "--lengths",
            "32",
            "--dtypes",
            "float32",
            "--rows",
            "sdpa",
            "blockwise_urpe",
            "--heads",
            "1",
            "--head-dim",
            "8",
            "--repeats",
            "1",
            "--memory-lengths",
            "--no-end-to-end",
            "--profile",
            "0",
            "--contention",
            "--contention-lengths",
            "32",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "BENCH.md"),
        ]
    )
    assert code == 0
    records = json.loads(out.read_text())["contention"]
    seen = {(r["name"], r["mode"], r["threads"], r["busy"]) for r in records}
    assert seen == {
        (n, m, t, b)
        for n in ("sdpa", "blockwise_urpe")
        for m in ("fwd", "fwdbwd")
        for t in (1, 2)
        for b in (False, True)
    }
    assert all(math.isfinite(r["ratio_to_sdpa"]) for r in records)
    assert "## Under contention" in (tmp_path / "BENCH.md").read_text()


# --------------------------------------------------------------------------------------------
# End to end, the command line, the GPU path without a GPU, and the package's imports


def test_end_to_end_times_each_model_against_no_positions():
    tiny = Size("tiny", batch=2, length=8, dim=16, heads=2, ffn=32, layers=1)
    records = end_to_end("cpu", repeats=1, warmup=1, progress=lambda m: None, sizes=[tiny])
    timed = {r["name"]: r for r in records if "time_ms" in r}
    assert {"urpe_auto", "rpe_auto", "nope_sdpa"} <= set(timed)
    assert (
        timed["nope_sdpa"]["ratio_to_nope_sdpa"] == 1.0 and timed["nope_sdpa"]["backend"] == "sdpa"
    )
    assert timed["urpe_auto"]["backend"] in BACKENDS and timed["urpe_auto"]["length"] == 8


def test_gpu_runs_check_the_urpe_rows_against_the_reference():
    from urpe.bench.cuda import check_outputs

    cpu = rows.rows_for("cpu")
    chosen = [cpu[name] for name in ("reference_urpe", "blockwise_urpe", "blockwise_rpe")]
    inputs = make_inputs(1, 2, 32, 8, torch.float32)
    records = [
        dict(name=row.name, mode=mode, time_ms=1.0) for row in chosen for mode in ("fwd", "fwdbwd")
    ]
    check_outputs(chosen, inputs, True, records)
    errors = {(r["name"], r["mode"]): r.get("error_vs_reference") for r in records}
    assert errors.pop(("blockwise_urpe", "fwd")) < 1e-5
    assert set(errors.values()) == {None}  # the reference itself, RPE rows, fwd+bwd: unchecked


@pytest.mark.parametrize(
    "flag",
    [
        ["--lengths", "0"],
        ["--heads", "-2"],
        ["--repeats", "x"],
        ["--rows", "no_such_row"],
        ["--gpu-rows", "sdpa"],
    ],
)
def test_bad_arguments_are_rejected_by_the_parser(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "attention", *flag])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a GPU-less machine")
def test_device_cuda_without_a_gpu_is_one_clear_error(capsys):
    # rows named as an older version named them still parse (reference -> reference_urpe)
    args = ["bench", "attention", "--device", "cuda", "--gpu-rows", "reference", "triton_urpe"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err


def test_bench_imports_nothing_from_experiments():
    modules = sorted(p.stem for p in (ROOT / "src" / "urpe" / "bench").glob("*.py"))
    code = (
        f"import importlib, sys\nfor m in {modules!r}:\n"
        "    importlib.import_module('urpe.bench.' + m)\n"
        "print([n for n in sys.modules if n.startswith('urpe.experiments')])"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_blockwise_kernel_assumes_no_cpu():
    """The pure-PyTorch blockwise kernel (a GPU benchmark row) builds every tensor on its inputs'
    device: on the meta device a stray CPU tensor would raise."""
    from urpe.kernels.blockwise import blockwise_attention

    q, k, v = (torch.randn(2, 2, 40, 16, device="meta", requires_grad=True) for _ in range(3))
    tables = [torch.randn(2, 11, device="meta", requires_grad=True) for _ in range(2)]
    for norm in ("softmax", "exp", "l2", "relu2"):
        out = blockwise_attention(
            q,
            k,
            v,
            bias=Toeplitz(tables[0]),
            gate=Toeplitz(tables[1]),
            is_causal=True,
            normalization=norm,
            block_q=16,
            block_k=16,
        )
        out.sum().backward()
        assert out.device.type == "meta" and tables[1].grad.device.type == "meta"
