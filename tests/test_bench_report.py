"""BENCHMARKS.md's attention report (benchmarks/harness, `make bench`): its targets and reports
follow from known records, the busy-core condition really loads a core, and a tiny real run
writes the report, the plot and the JSON beside `urpe bench attention`'s records."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from harness import attention_report, contention, gpu_section, report, scripts, sections, targets
from harness.end_to_end import Size, end_to_end
from harness.targets import fit_quadratic
from urpe.bench import rows
from urpe.kernels import BACKENDS

ROOT = Path(__file__).resolve().parent.parent
SMALL_ROWS = [
    name
    for name in ("sdpa", "blockwise_urpe", "cpp_urpe")
    if name in rows.rows_for("cpu")  # cpp: where built
]  # (tests/test_bench.py runs `urpe bench attention` itself on more rows, with a profile)


def bench_attention(argv: list[str]) -> int:
    """benchmarks/bench_attention.py with these arguments (its defaults write no files)."""
    parser = scripts.parser("bench_attention.py", "the attention report")
    attention_report.add_arguments(parser)
    return scripts.main(parser, attention_report.run, argv)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--lengths", "48", "--dtypes", "float32", "--rows", *SMALL_ROWS, "--heads", "2"]
    argv += ["--head-dim", "16", "--repeats", "1", "--memory-lengths", "256"]
    argv += ["--no-end-to-end", "--profile", "0", "--json", str(out / "bench.json")]
    argv += ["--markdown", str(out / "BENCH.md"), "--plot", str(out / "memory.png")]
    assert bench_attention(argv) == 0
    return out


@pytest.mark.slow
def test_a_small_run_writes_targets_report_and_plot(small_run):
    results = json.loads((small_run / "bench.json").read_text())
    assert {"times", "memory", "end_to_end", "machine", "targets", "plot"} <= set(results)
    for t in results["targets"]:
        assert set(t) >= {"target", "value", "limit", "met"}
    assert (small_run / "memory.png").stat().st_size > 1000
    text = (small_run / "BENCH.md").read_text()
    assert "## Targets" in text and "## Time, float32" in text and "## Peak memory" in text
    assert "| blockwise_urpe |" in text and "![peak memory](memory.png)" in text
    assert "## Under contention" not in text  # not asked for


def test_the_default_rows_hold_every_row_a_target_compares():
    """`urpe bench attention`'s default rows are what the report's targets need."""
    for device in ("cpu", "cuda"):
        default = set(rows.default_rows(device))
        available = set(rows.rows_for(device))
        assert targets.named_rows(device) & available <= default


# --------------------------------------------------------------------------------------------
# Targets on known records


def _timed(name, mode, ms, length=2048, dtype="float32", **condition):
    return dict(name=name, mode=mode, length=length, dtype=dtype, time_ms=ms, **condition)


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
    assert bench_attention(["--gpu-report", str(saved), "--markdown", str(markdown)]) == 0
    text = markdown.read_text()
    assert "| triton_urpe | 2.50 · 1 · 1.25x · 100 |" in text  # 2.5 ms / 2.0 ms
    assert "| reference_urpe | - |" in text and "Test GPU" in text
    assert "| urpe_auto | triton | 128 x 128, 768 | 30.00 | 1.20 |" in text
    assert "triton URPE fwd+bwd / SDPA-Flash (<=): 1.25" in capsys.readouterr().out


def test_gpu_report_rejects_a_file_that_is_not_results(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench_attention(["--gpu-report", str(bad)]) == 2
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
    code = bench_attention(
        [
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
# End to end


def test_end_to_end_times_each_model_against_no_positions():
    tiny = Size("tiny", batch=2, length=8, dim=16, heads=2, ffn=32, layers=1)
    records = end_to_end("cpu", repeats=1, warmup=1, progress=lambda m: None, sizes=[tiny])
    timed = {r["name"]: r for r in records if "time_ms" in r}
    assert {"urpe_auto", "rpe_auto", "nope_sdpa"} <= set(timed)
    assert (
        timed["nope_sdpa"]["ratio_to_nope_sdpa"] == 1.0 and timed["nope_sdpa"]["backend"] == "sdpa"
    )
    assert timed["urpe_auto"]["backend"] in BACKENDS and timed["urpe_auto"]["length"] == 8
