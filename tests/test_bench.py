"""`urpe bench attention`: its rows come from the backend registry and compute what they name,
its pipeline times them and divides by the right baseline, and a tiny real run writes files of
the documented schema. The report built on it (targets, contention, BENCHMARKS.md) is
tests/test_bench_report.py.

No speed is asserted (timings on a shared machine are noise); the targets live in BENCHMARKS.md,
produced by the full run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from urpe.bench import measure, packing_rows, rows
from urpe.bench.inputs import dense_bias, make_inputs
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
    argv = ["bench", "attention", "--lengths", "48", "64", "--dtypes", "float32", "--rows"]
    argv += [*SMALL_ROWS, "--heads", "2", "--head-dim", "16", "--repeats", "2"]
    argv += ["--memory-lengths", "512", "--profile", "64", "--json", str(out / "bench.json")]
    assert main(argv) == 0
    return json.loads((out / "bench.json").read_text())


# --------------------------------------------------------------------------------------------
# A tiny real run: files of the documented schema, finite times


@pytest.mark.slow
def test_a_small_run_writes_the_documented_json(small_run):
    results = small_run
    assert {
        "date",
        "command",
        "shape",
        "repeats",
        "dtypes",
        "load_start",
        "times",
        "memory",
        "profile",
        "machine",
        "stolen",
    } <= set(results)
    assert results["shape"] == dict(batch=1, heads=2, head_dim=16)
    # the host's share of the CPU time while timing (/proc/stat's steal; None off Linux)
    assert results["stolen"] is None or 0.0 <= results["stolen"] <= 1.0
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


@pytest.mark.slow  # (a trained run's fixture)
def test_memory_is_measured_in_subprocesses(small_run):
    memory = {(r["name"], r["length"]): r for r in small_run["memory"]}
    tiled = {"reference_urpe", "blockwise_urpe", "blockwise_rpe", "cpp_urpe", "sdpa"}
    rows = tiled & set(SMALL_ROWS)
    assert set(memory) == {(n, 512) for n in rows}
    # The reference materialises (B, H, L, L) matrices: at L=512 with H=2 in float32 each
    # is 2 MB, and forward+backward keeps several.
    assert memory[("reference_urpe", 512)]["peak_mb"] > 4
    if "cpp_urpe" in SMALL_ROWS:  # the profile's default row
        assert small_run["profile"]["row"] == "cpp_urpe"
        assert "urpe_cpp::backward" in {op["op"] for op in small_run["profile"]["ops"]}


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
    assert "bench_dummy_urpe" in rows.default_rows("cpu")
    assert "bench_dummy_cuda_urpe" not in cpu and "bench_dummy_cuda_urpe" in cuda
    # FlexAttention's own route keeps its name: the "flex" backend has no RPE row of its own.
    assert cuda["flex_rpe"].help.startswith("compiled FlexAttention")


def test_the_rows_are_chosen_and_checked_when_the_command_runs(dummy_backends, monkeypatch):
    """The flags offer rows without importing torch; what runs here is decided at run time: the
    default rows, a backend registered before the run, and a row that cannot run here
    refused in one line (a C++ kernel that cannot be built, say)."""
    import argparse

    from urpe.bench import options
    from urpe.cli_types import UsageError

    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    args = parser.parse_args([])
    options.fill_defaults(args)
    assert args.rows == rows.default_rows("cpu")
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


@pytest.mark.slow
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
# Ratios


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


# --------------------------------------------------------------------------------------------
# The GPU path without a GPU, the command line, and the package's imports


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
