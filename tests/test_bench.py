"""`urpe bench attention` at toy sizes: it runs, its ratios are what it measured, files parse.

No speed is asserted here (timings on a shared machine are noise); the targets live in
BENCHMARKS.md, produced by the full run.
"""

import json

import pytest
import torch

from urpe.bench import attention as bench
from urpe.bench import gpu
from urpe.cli import main
from urpe.kernels import reference_attention


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "attention", "--lengths", "48", "96", "--dtypes", "float32",
                 "--rows", "sdpa", "sdpa_dense_bias", "reference_urpe", "fused_urpe", "fused_rpe",
                 "--heads", "2", "--head-dim", "16", "--repeats", "2",
                 "--memory-lengths", "256", "512", "--no-end-to-end", "--profile", "96",
                 "--json", str(out / "bench.json"), "--markdown", str(out / "BENCH.md"),
                 "--plot", str(out / "memory.png")])  # fmt: skip
    assert code == 0
    return out


def test_every_row_is_timed_with_a_ratio(small_run):
    results = json.loads((small_run / "bench.json").read_text())
    times = results["times"]
    for length in (48, 96):
        for mode in bench.MODES:
            rows = {r["name"]: r for r in times if r["length"] == length and r["mode"] == mode}
            assert set(rows) == {"sdpa", "sdpa_dense_bias", "reference_urpe", "fused_urpe",
                                 "fused_rpe"}  # fmt: skip
            assert rows["sdpa"]["ratio_to_sdpa"] == 1.0
            assert all(r["time_ms"] > 0 and r["ratio_to_sdpa"] > 0 for r in rows.values())


def test_ratios_divide_by_sdpa_of_the_same_length_dtype_and_mode():
    def timed(name, mode, ms, length=64, dtype="float32"):
        return dict(name=name, mode=mode, length=length, dtype=dtype, time_ms=ms)

    records = [timed("sdpa", "fwd", 4.0), timed("fused_urpe", "fwd", 6.0),
               timed("sdpa", "fwdbwd", 10.0), timed("fused_urpe", "fwdbwd", 25.0),
               timed("fused_urpe", "fwd", 3.0, length=128),  # no SDPA at this length
               timed("sdpa", "fwd", 1.0, dtype="bfloat16"),
               dict(name="reference_urpe", mode="fwd", length=64, dtype="float32",
                    skipped="too long")]  # fmt: skip
    bench.add_ratios(records)
    assert records[1]["ratio_to_sdpa"] == 1.5
    assert records[3]["ratio_to_sdpa"] == 2.5
    assert "ratio_to_sdpa" not in records[4] and "ratio_to_sdpa" not in records[6]


def test_memory_is_measured_in_subprocesses_and_plotted(small_run):
    results = json.loads((small_run / "bench.json").read_text())
    memory = {(r["name"], r["length"]): r for r in results["memory"]}
    # The reference materialises (B, H, L, L) matrices: at L=512 with H=2 in float32 each
    # is 2 MB, and forward+backward keeps several.
    assert memory[("reference_urpe", 512)]["peak_mb"] > 4
    assert all("peak_mb" in r for r in memory.values())
    assert (small_run / "memory.png").stat().st_size > 1000


def test_markdown_reports_targets_machine_and_tables(small_run):
    text = (small_run / "BENCH.md").read_text()
    assert "## Targets" in text and "## Time, float32" in text and "## Peak memory" in text
    assert "| fused_urpe |" in text and "cores" in text
    assert "![peak memory](memory.png)" in text
    assert "## Where fused URPE spends its time" in text and "`aten::bmm`" in text


def test_candidates_compute_the_same_attention():
    inputs = bench.make_inputs(1, 2, 40, 16, torch.float32)
    inputs["dense_bias"] = bench.dense_bias(inputs, 1)
    expected = reference_attention(
        inputs["q"], inputs["k"], inputs["v"], bias=bench.Toeplitz(inputs["table_b"])
    )
    for name in ("sdpa_dense_bias", "fused_rpe"):
        got = bench.candidate(name, inputs)()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    urpe = reference_attention(inputs["q"], inputs["k"], inputs["v"],
                               bias=bench.Toeplitz(inputs["table_b"]),
                               gate=bench.Toeplitz(inputs["table_c"]))  # fmt: skip
    torch.testing.assert_close(bench.candidate("fused_urpe", inputs)(), urpe, atol=1e-5, rtol=1e-4)


def test_quadratic_fit_recovers_its_coefficients():
    points = [(n, 3.0 + 2e-4 * n * n) for n in (256, 512, 1024)]
    a, b = bench.fit_quadratic(points)
    assert a == pytest.approx(3.0) and b == pytest.approx(2e-4)
    assert bench.fit_quadratic(points[:1]) is None


def test_targets_compare_measured_values_with_limits():
    def timed(name, mode, ms):
        return dict(name=name, mode=mode, length=2048, dtype="float32", time_ms=ms)

    times = [timed("sdpa", "fwdbwd", 10.0), timed("fused_urpe", "fwdbwd", 14.0),
             timed("sdpa_dense_bias", "fwdbwd", 40.0), timed("fused_rpe", "fwdbwd", 13.0),
             timed("sdpa", "fwd", 4.0), timed("fused_urpe", "fwd", 6.0),
             timed("fused_rpe", "fwd", 6.0)]  # fmt: skip
    memory = [dict(name="fused_urpe", length=n, peak_mb=0.01 * n) for n in (512, 8192)]
    memory += [dict(name="reference_urpe", length=n, peak_mb=1e-4 * n * n) for n in (512, 1024)]
    rows = {r["target"].split(" (")[0]: r for r in bench.targets(times, memory, [])}
    assert rows["fused URPE fwd+bwd / bias-free SDPA"]["value"] == pytest.approx(1.4)
    assert rows["fused URPE fwd+bwd / bias-free SDPA"]["met"] is True
    assert rows["fused URPE fwd / bias-free SDPA"]["met"] is False  # 1.5 > 1.3
    assert rows["fused URPE / fused RPE, fwd+bwd"]["value"] == pytest.approx(14 / 13)
    ratio = next(r for t, r in rows.items() if t.startswith("fused URPE peak memory"))
    assert ratio["value"] == pytest.approx(0.01 * 8192 / (1e-4 * 8192**2), rel=1e-6)


@pytest.mark.parametrize("flag", [["--lengths", "0"], ["--heads", "-2"], ["--repeats", "x"]])
def test_bad_sizes_are_rejected_by_the_parser(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "attention", *flag])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The GPU section (`--device cuda`): its arithmetic and report on known numbers; the run itself
# needs a GPU (benchmarks/README.md has the command).


def test_flop_count_of_attention():
    # 4 * 1 * 1 * 1024 * 1024 * 64 = 268,435,456 multiply-adds x 2 for q k^T and P V
    assert gpu.attention_flops(1, 1, 1024, 1024, 64, False, "fwd") == 268_435_456
    assert gpu.attention_flops(1, 1, 1024, 1024, 64, True, "fwd") == 134_217_728
    assert gpu.attention_flops(2, 3, 1024, 1024, 64, False, "fwdbwd") == 5_637_144_576


def _gpu_record(name, mode, ms, length=4096, head_dim=64, causal=False, peak_mb=100.0):
    return dict(name=name, mode=mode, length=length, head_dim=head_dim, causal=causal,
                dtype="bfloat16", batch=4, heads=16, time_ms=ms, tflops=1.0,
                peak_mb=peak_mb)  # fmt: skip


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
    result = {t["target"].split(" (")[0]: t for t in gpu.targets(records)}
    flex = result["triton URPE fwd+bwd / flex RPE"]
    assert flex["value"] == pytest.approx(1.5) and flex["met"] is False
    assert flex["met_count"] == "1/2" and "L=8192" in flex["setting"]
    dense = result["speed-up of triton URPE over SDPA dense bias, fwd+bwd, L >= 4k"]
    assert dense["value"] == pytest.approx(12.0 / 9.0) and dense["met"] is False
    assert result["triton URPE / triton without gate, fwdbwd"]["met"] is True
    assert result["triton URPE / triton without gate, fwd"]["value"] == pytest.approx(1.25)
    memory = next(t for t in gpu.targets(records) if "memory" in t["target"])
    assert memory["value"] == pytest.approx(1.0) and memory["met"] is True  # 256 -> 512 MB


def test_quadratic_memory_misses_the_linear_target():
    records = [_gpu_record("triton_urpe", "fwdbwd", 1.0, n, peak_mb=n * n / 1e5)
               for n in (1024, 4096)]  # fmt: skip
    assert gpu.memory_target(records)["value"] == pytest.approx(4.0)
    assert gpu.memory_target(records)["met"] is False


def test_gpu_section_is_written_between_markers_and_survives_a_cpu_report(tmp_path):
    path = tmp_path / "BENCH.md"
    path.write_text("# Benchmarks\n\nCPU tables\n")
    gpu.write_section(path, gpu.section_markdown([]))
    gpu.write_section(path, gpu.section_markdown([]))  # replaced, not appended twice
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nCPU tables\n") and text.count(gpu.SECTION_BEGIN) == 1
    assert "Pending: no GPU run yet" in text
    rewritten = gpu.keep_section(path, "# Benchmarks\n\nnew CPU tables\n")
    assert "new CPU tables" in rewritten and "Pending: no GPU run yet" in rewritten
    assert "CPU tables\n" not in rewritten.replace("new CPU tables\n", "")


def test_gpu_report_from_saved_results(tmp_path, capsys):
    records = [_gpu_record("triton_urpe", "fwdbwd", 2.5), _gpu_record("sdpa_flash", "fwdbwd", 2.0),
               dict(name="reference", mode="fwdbwd", length=4096, head_dim=64, causal=False,
                    dtype="bfloat16", skipped="out of memory")]  # fmt: skip
    results = dict(date="2026-01-01 00:00 UTC", command="urpe bench attention --device cuda",
                   device=dict(gpu="Test GPU", multiprocessors=1, memory_gb=1.0, torch="t",
                               triton="t", cuda="c"),
                   times=records, training=[dict(name="urpe_auto", backend="triton", batch=128,
                                                 length=128, dim=768, time_ms=30.0,
                                                 ratio_to_nope_sdpa=1.2)])  # fmt: skip
    saved = tmp_path / "gpu.json"
    saved.write_text(json.dumps(results))
    markdown = tmp_path / "BENCH.md"
    assert (
        main(["bench", "attention", "--gpu-report", str(saved), "--markdown", str(markdown)]) == 0
    )
    text = markdown.read_text()
    assert "| triton_urpe | 2.50 · 1 · 1.25x · 100 |" in text  # 2.5 ms / 2.0 ms
    assert "| reference | - |" in text and "Test GPU" in text
    assert "| urpe_auto | triton | 128 x 128, 768 | 30.00 | 1.20 |" in text
    assert "triton URPE fwd+bwd / SDPA-Flash (<=): 1.25" in capsys.readouterr().out


def test_gpu_report_rejects_a_file_that_is_not_results(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "attention", "--gpu-report", str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a GPU-less machine")
def test_device_cuda_without_a_gpu_is_one_clear_error(capsys):
    assert main(["bench", "attention", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err


def test_gpu_rows_compute_the_intended_attention():
    """The GPU rows that can run here (Triton under the interpreter, the fused kernel, SDPA with
    the causal mask folded into the dense bias) against the reference, in float32."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for causal in (False, True):
        inputs = gpu.make_inputs(1, 2, 40, 16, torch.float32, device)
        inputs["dense_bias"] = gpu._dense_bias(inputs, causal)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        bias, gate = bench.Toeplitz(inputs["table_b"]), bench.Toeplitz(inputs["table_c"])
        urpe = reference_attention(q, k, v, bias=bias, gate=gate, is_causal=causal)
        rpe = reference_attention(q, k, v, bias=bias, is_causal=causal)
        for name, expected in (("triton_urpe", urpe), ("triton_rpe", rpe), ("fused_urpe", urpe),
                               ("sdpa_dense_bias", rpe), ("reference", urpe)):  # fmt: skip
            got = gpu.candidate(name, inputs, causal)()
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5, msg=name)


def test_the_fused_kernel_assumes_no_cpu():
    """The pure-PyTorch fused kernel (a GPU benchmark row) builds every tensor on its inputs'
    device: on the meta device a stray CPU tensor would raise."""
    from urpe.kernels.fused import fused_attention

    q, k, v = (torch.randn(2, 2, 40, 16, device="meta", requires_grad=True) for _ in range(3))
    tables = [torch.randn(2, 11, device="meta", requires_grad=True) for _ in range(2)]
    for norm in ("softmax", "exp", "l2", "relu2"):
        out = fused_attention(q, k, v, bias=bench.Toeplitz(tables[0]),
                              gate=bench.Toeplitz(tables[1]), is_causal=True,
                              normalization=norm, block_q=16, block_k=16)  # fmt: skip
        out.sum().backward()
        assert out.device.type == "meta" and tables[1].grad.device.type == "meta"
