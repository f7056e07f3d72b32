"""`urpe bench attention` at toy sizes: it runs, its ratios are what it measured, files parse.

No speed is asserted here (timings on a shared machine are noise); the targets live in
BENCHMARKS.md, produced by the full run.
"""

import json

import pytest
import torch

from urpe.bench import attention as bench
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


def test_every_row_is_timed_and_ratios_divide_by_sdpa(small_run):
    results = json.loads((small_run / "bench.json").read_text())
    times = results["times"]
    for length in (48, 96):
        for mode in bench.MODES:
            rows = {r["name"]: r for r in times if r["length"] == length and r["mode"] == mode}
            assert set(rows) == {"sdpa", "sdpa_dense_bias", "reference_urpe", "fused_urpe",
                                 "fused_rpe"}  # fmt: skip
            base = rows["sdpa"]["time_ms"]
            assert rows["sdpa"]["ratio_to_sdpa"] == 1.0
            for r in rows.values():
                assert r["time_ms"] > 0
                assert r["ratio_to_sdpa"] == pytest.approx(r["time_ms"] / base)


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
