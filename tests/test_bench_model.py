"""The model benchmark (benchmarks/bench_model.py, issue 28): a tiny real run measures every
row of every group under both conditions and reports every target; baselines compute the same
thing as the rows they are compared with; ratios and targets follow from known records; the
model section goes between its markers and survives the other reports.

No speed is asserted (timings on a shared machine are noise); the numbers live in
BENCHMARKS.md, written by the full run (`make bench-model`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness import (
    attention_calls,
    generation,
    model,
    model_report,
    model_targets,
    processes,
    scripts,
    timed,
)
from harness.contention import Condition
from harness.model_groups import GROUP_NAMES, Group
from harness.model_sizes import QUICK
from harness.sections import GPU, MODEL, keep_sections
from urpe.kernels import Toeplitz, native_backends, reference_attention

ROOT = Path(__file__).resolve().parent.parent
CPP = "cpp" in native_backends("cpu")
LM_VARIANTS = ("urpe", "txl+urpe", "rope+urpe", "alibi+urpe", "t5+urpe")
# group -> (cases, row names, modes) that a run measures; hf_compiled has a slow test of its own.
EXPECTED = {
    "calls": (
        ("decode", "decode_gqa", "decode_long"),
        (
            "sdpa",
            *(f"{b}_{t}" for b in ("auto", "reference", "cpp") for t in ("none", "gate", "bias")),
        ),
        ("fwd",),
    ),
    "short": (
        ("causal", "not_causal"),
        (
            "sdpa",
            "auto_urpe",
            "auto_rpe",
            *(("cpp_urpe",) if CPP else ()),
            "blockwise_urpe",
            "reference_urpe",
        ),
        ("fwd", "fwdbwd"),
    ),
    "bf16": (("bf16",), ("sdpa", *(("cpp_urpe",) if CPP else ()), "auto_urpe"), ("fwd",)),
    "decoder": (("batch 1", "batch 4"), ("urpe", "rpe", "nope"), ("generate",)),
    "hf_generate": (("batch 1", "batch 4"), ("base", "base copy", "urpe"), ("generate",)),
    "hf_train": (("train",), ("base", "urpe"), ("train",)),
    "end_to_end": (
        ("quick", "long"),
        ("urpe_auto", "rpe_auto", "nope_sdpa", "xtransformers_t5"),
        ("train",),
    ),
    "lm_speed": (LM_VARIANTS, ("base", "urpe"), ("train",)),
}
BASELINES = dict(
    calls="sdpa",
    short="sdpa",
    bf16="sdpa",
    decoder="rpe",
    hf_generate="base",
    hf_train="base",
    end_to_end="nope_sdpa",
    lm_speed="base",
)
PRELUDE = "# Benchmarks\n\nthe CPU report\n"


def bench_model(argv: list[str]) -> int:
    """benchmarks/bench_model.py with these arguments (its defaults write no files)."""
    parser = scripts.parser("bench_model.py", "the model benchmark")
    model.add_arguments(parser)
    return scripts.main(parser, model.run, argv)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("bench_model")
    (out / "BENCH.md").write_text(PRELUDE + "\n" + GPU.begin + "\nGPU figures\n" + GPU.end + "\n")
    code = bench_model(
        [
            "--quick",
            "--threads",
            "1",
            "--repeats",
            "1",
            "--groups",
            *EXPECTED,
            "--json",
            str(out / "model.json"),
            "--markdown",
            str(out / "BENCH.md"),
        ]
    )
    assert code == 0
    return json.loads((out / "model.json").read_text()), (out / "BENCH.md").read_text()


def _measured(records: list[dict], group: str) -> set[tuple]:
    return {(r["case"], r["name"], r["mode"], r["busy"]) for r in records if r["group"] == group}


# --------------------------------------------------------------------------------------------
# A tiny real run


def test_a_quick_run_measures_every_row_of_every_group_idle_and_busy(quick_run):
    results, _ = quick_run
    assert list(results["groups"]) == list(EXPECTED)
    assert results["conditions"] == [dict(threads=1, busy=False), dict(threads=1, busy=True)]
    for group, (cases, names, modes) in EXPECTED.items():
        want = {(c, n, m, b) for c in cases for n in names for m in modes for b in (False, True)}
        assert _measured(results["records"], group) == want, group
    skipped = {r["name"] for r in results["records"] if "time_ms" not in r}
    unbuilt = set() if CPP else {"cpp_none", "cpp_gate", "cpp_bias"}
    assert skipped <= {"xtransformers_t5"} | unbuilt


def test_every_time_is_compared_with_its_group_baseline(quick_run):
    results, _ = quick_run
    timed_records = [r for r in results["records"] if "time_ms" in r]
    base = {
        (r["group"], r["case"], r["mode"], r["busy"]): r["time_ms"]
        for r in timed_records
        if r["name"] == BASELINES[r["group"]]
    }
    for r in timed_records:
        assert math.isfinite(r["time_ms"]) and r["time_ms"] > 0
        time = base[(r["group"], r["case"], r["mode"], r["busy"])]
        assert r["ratio"] == pytest.approx(r["time_ms"] / time)
        assert r["extra_us"] == pytest.approx(1e3 * (r["time_ms"] - time))


def test_every_target_is_judged_idle_and_busy_and_reported(quick_run):
    results, text = quick_run
    labels = [t.target for t in model_targets.targets()]
    assert [t["target"] for t in results["targets"]] == labels
    assert len(labels) == 3 + 2 + 1 + 2 + 2 + 2 + 1 + 2 + len(LM_VARIANTS) + 4
    for t in results["targets"]:
        assert set(t["values"]) == {"idle", "one core busy"}
        if "static cache" in t["target"] or "compiled" in t["target"]:  # not in this run
            assert t["values"] == {"idle": None, "one core busy": None} and t["met"] is None
        elif t["limit"] is None:  # a control: measured, judged against nothing
            assert t["target"].startswith("control:") and t["met"] is None
            assert None not in t["values"].values()
            assert f"| {t['target']} |" in text and text.count(" | - | - |") >= 2
        elif CPP or "cpp" not in t["target"]:
            assert None not in t["values"].values() and t["met"] in (True, False), t
        assert f"| {t['target']} |" in text
    for info in results["groups"].values():
        assert f"### {info['title']}" in text


def test_the_model_section_goes_between_markers_and_the_rest_stays(quick_run, tmp_path):
    results, text = quick_run
    assert text.startswith(PRELUDE) and "\nGPU figures\n" in text
    assert text.count(MODEL.begin) == 1 and text.rstrip().endswith(MODEL.end)
    assert MODEL.find(text) == model_report.section_markdown(results).rstrip("\n")
    path = tmp_path / "BENCH.md"
    path.write_text(text)
    MODEL.write(path, model_report.section_markdown(results))  # replaced, not appended
    assert path.read_text() == text


def test_a_cpu_report_keeps_the_gpu_and_model_sections(tmp_path):
    path = tmp_path / "BENCH.md"
    path.write_text("# old report\n")
    MODEL.write(path, f"{MODEL.begin}\nmodel rows\n{MODEL.end}\n")
    GPU.write(path, f"{GPU.begin}\nGPU rows\n{GPU.end}\n")
    rewritten = keep_sections(path, "# new report\n")
    assert rewritten == (
        f"# new report\n\n{GPU.begin}\nGPU rows\n{GPU.end}\n\n"
        f"{MODEL.begin}\nmodel rows\n{MODEL.end}\n"
    )
    assert keep_sections(tmp_path / "absent.md", "# new report\n") == "# new report\n"


# --------------------------------------------------------------------------------------------
# The baselines are the same computation without URPE


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_decoding_rows_compute_the_attention_they_name(kv_heads):
    """At Lq=1 SDPA without a mask is urpe's causal attention without terms; every URPE row
    equals the reference with its terms (GQA too)."""
    inputs = attention_calls.decode_inputs(4, kv_heads, 16, 8)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    gqa = kv_heads != 4
    terms = dict(
        none={},
        gate=dict(gate=Toeplitz(inputs["table_c"])),
        bias=dict(bias=Toeplitz(inputs["table_b"])),
    )
    with torch.no_grad():
        for row in attention_calls.DECODE_ROWS:
            if row.name.startswith("cpp") and not CPP:
                continue
            term = "none" if row.name == "sdpa" else row.name.rsplit("_", 1)[1]
            want = reference_attention(q, k, v, is_causal=True, enable_gqa=gqa, **terms[term])
            got = row.build(inputs, True)()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=row.name)
    assert not torch.allclose(terms["gate"]["gate"].dense(1, 16), torch.ones(1, 4, 1, 16))


def test_the_gated_decoder_starts_as_its_baseline():
    """The gate starts at ones: URPE and RPE decoders generate the same tokens, so their
    generation times compare the same work."""
    prompt = generation.prompts(QUICK, QUICK.decoder.vocab)[4]
    window = QUICK.prompt + QUICK.new_tokens
    tokens = {
        name: torch.stack(
            list(
                generation.language_model(QUICK.decoder, name, window).generate(
                    prompt, 5, temperature=0
                )
            )
        )
        for name in ("urpe", "rpe")
    }
    assert torch.equal(tokens["urpe"], tokens["rpe"])


def test_the_hf_pair_differs_only_by_add_urpe():
    pytest.importorskip("transformers")
    from harness.hf_llama import llama_pair

    pair = llama_pair(QUICK.decoder, context=32)
    base, gated = (dict(m.named_parameters()) for m in (pair["base"], pair["urpe"]))
    assert set(base) < set(gated) and all("urpe" in n for n in set(gated) - set(base))
    assert all(torch.equal(base[n], gated[n]) for n in base)
    prompt = torch.randint(0, QUICK.decoder.vocab, (2, 5), generator=torch.Generator())
    out = [
        m.eval().generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        for m in pair.values()
    ]
    assert torch.equal(out[0], out[1])


# --------------------------------------------------------------------------------------------
# Ratios, targets and reports from known records


def _record(group, case, name, ms, busy=False, mode="fwd", **more):
    return dict(
        group=group, case=case, name=name, mode=mode, threads=2, busy=busy, time_ms=ms, **more
    )


def test_ratios_divide_by_the_baseline_of_the_same_case_mode_and_condition():
    records = [
        _record("calls", "decode", "sdpa", 0.010),
        _record("calls", "decode", "auto_gate", 0.030),
        _record("calls", "decode", "sdpa", 0.020, busy=True),
        _record("calls", "decode", "auto_gate", 0.025, busy=True),
        _record("calls", "decode_long", "auto_gate", 0.5),  # no baseline in its case
        _record("other", "decode", "auto_gate", 0.5),  # a group without a baseline
    ]
    timed.compare(records, {"calls": "sdpa"})
    assert records[1]["ratio"] == pytest.approx(3.0)
    assert records[1]["extra_us"] == pytest.approx(20.0)
    assert records[3]["extra_us"] == pytest.approx(5.0)
    assert "ratio" not in records[4] and "ratio" not in records[5]


def test_a_target_holds_only_when_met_under_every_condition_measured():
    idle, busy = dict(threads=2, busy=False), dict(threads=2, busy=True)
    target = model_targets.Target("t", "calls", "decode", "auto_gate", "fwd", 25, "extra_us")
    records = [
        _record("calls", "decode", "auto_gate", 0.03, extra_us=20.0),
        _record("calls", "decode", "auto_gate", 0.04, busy=True, extra_us=30.0),
    ]
    judged = target.judge(records, [idle, busy])
    assert judged["values"] == {"idle": 20.0, "one core busy": 30.0} and judged["met"] is False
    assert target.judge(records, [idle])["met"] is True
    assert target.judge(records[:1], [idle, busy])["values"]["one core busy"] is None
    assert target.judge([], [idle, busy])["met"] is None
    control = model_targets.Target("c", "calls", "decode", "auto_gate", "fwd", None, "extra_us")
    judged = control.judge(records, [idle, busy])
    assert judged["values"] == {"idle": 20.0, "one core busy": 30.0} and judged["met"] is None


def test_a_failing_group_is_reported_and_the_rest_measured():
    """A group that cannot be built is reported with the reason; one that fails under the
    second condition keeps what it measured under the first."""

    class Built:
        about = "two trivial calls."
        conditions_left = 1

        def measure(self, repeats, progress):
            if self.conditions_left == 0:
                raise RuntimeError("lost the model")
            self.conditions_left -= 1
            calls = {("sdpa", "fwd"): lambda: None, ("auto_none", "fwd"): lambda: sum(range(99))}
            return timed.Timed({"decode": calls}, {"decode": "no shape"}).measure(repeats, progress)

    def broken(sizes, progress):
        raise RuntimeError("no such model\nsecond line")

    registry = {
        "broken": Group("Broken", "x", broken),
        "calls": Group("Calls", "sdpa", lambda s, p: Built(), unit="us"),
    }
    conditions = [Condition(1, busy=False), Condition(1, busy=True)]
    results = model.measure_groups(registry, list(registry), QUICK, conditions, 2, lambda m: None)
    assert results["groups"]["broken"]["failed"] == "RuntimeError: no such model"
    assert results["groups"]["calls"]["failed"] == "RuntimeError: lost the model"
    measured = {(r["name"], r["busy"]) for r in results["records"]}
    assert measured == {("sdpa", False), ("auto_none", False)}
    results.update(
        date="today",
        command="urpe bench model",
        sizes_name="quick",
        repeats=2,
        load_start=(0.0, 0.0, 0.0),
        busy_core=1,
        conditions=[c.fields for c in conditions],
        machine=dict(
            cpu="cpu",
            cores=2,
            threads=1,
            capability="AVX2",
            torch="2",
            transformers=None,
            python="3",
            load_average=(0.0, 0.0, 0.0),
        ),
    )
    results["targets"] = model_targets.judge(results["records"], results["conditions"])
    text = model_report.section_markdown(results)
    assert "### Broken\n\nStopped: RuntimeError: no such model." in text
    assert "two trivial calls. Baseline: `sdpa`. Cases: decode: no shape." in text
    assert "| row | decode, idle | decode, one core busy |" in text
    assert "| auto_none | " in text and "\n\nStopped: RuntimeError: lost the model." in text
    assert "| one decoding call, no terms: us over SDPA | " in text


def test_runs_in_several_processes_merge_to_medians_and_ranges():
    """Each figure of several runs is the median over them with its range; a record that one
    run lacks (its group failed there) is kept as measured; a group failed in any run is
    reported failed, with the most steal any run saw."""
    runs = [
        [_record("calls", "decode", "auto_gate", t, extra_us=e, ratio=r)]
        for t, e, r in ((0.03, 20.0, 3.0), (0.01, 5.0, 1.5), (0.02, 9.0, 2.0))
    ]
    runs[0].append(_record("calls", "decode_long", "auto_gate", 0.5))
    merged = processes.merged_records(runs)
    assert len(merged) == 2
    gate, long = merged
    assert gate["time_ms"] == pytest.approx(0.02) and gate["time_ms_range"] == [0.01, 0.03]
    assert gate["extra_us"] == 9.0 and gate["extra_us_range"] == [5.0, 20.0]
    assert gate["ratio"] == 2.0 and gate["ratio_range"] == [1.5, 3.0]
    assert long["time_ms"] == 0.5 and "time_ms_range" not in long
    judged = model_targets.Target("t", "calls", "decode", "auto_gate", "fwd", 10, "extra_us")
    judged = judged.judge(merged, [dict(threads=2, busy=False)])
    assert judged["values"] == {"idle": 9.0} and judged["ranges"] == {"idle": [5.0, 20.0]}
    assert model_report.spread(judged, "idle") == " (+5.0 us to +20.0 us)"
    info = [
        dict(records=[], groups=dict(calls=dict(title="C", stolen={"idle": 0.01}))),
        dict(records=[], groups=dict(calls=dict(title="C", failed="E: x", stolen={"idle": 0.2}))),
    ]
    assert model.merged_runs(info)["groups"] == dict(
        calls=dict(title="C", failed="E: x", stolen={"idle": 0.2})
    )


def test_a_run_in_two_fresh_processes_reports_the_median_and_range(tmp_path):
    """--processes 2: two spawned interpreters each measure the group; the JSON keeps both
    ends of every figure, the section says how it was measured and shows the range."""
    (tmp_path / "BENCH.md").write_text(PRELUDE + "\n")
    argv = ["--quick", "--threads", "1", "--repeats", "1", "--groups", "calls"]
    argv += ["--conditions", "idle", "--processes", "2", "--json", str(tmp_path / "m.json")]
    assert bench_model([*argv, "--markdown", str(tmp_path / "BENCH.md")]) == 0
    results = json.loads((tmp_path / "m.json").read_text())
    assert results["processes"] == 2
    timed_records = [r for r in results["records"] if "time_ms" in r]
    assert timed_records and all(len(r["time_ms_range"]) == 2 for r in timed_records)
    for r in timed_records:
        low, high = r["time_ms_range"]
        assert low <= r["time_ms"] <= high
    text = (tmp_path / "BENCH.md").read_text()
    assert "made in 2 fresh processes" in text
    assert "| one decoding call, no terms: us over SDPA | " in text and " us to " in text


@pytest.mark.parametrize(
    "flag", [["--groups", "nothing"], ["--repeats", "0"], ["--conditions", "idle", "idle"]]
)
def test_bad_arguments_are_one_line_errors(flag, capsys):
    try:
        code = bench_model(flag)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


def test_benchmarks_md_model_section_is_its_json():
    """The model section of BENCHMARKS.md is what `section_markdown` writes from
    benchmarks/model.json, its targets judged again from the stored records."""
    results = json.loads((ROOT / "benchmarks" / "model.json").read_text())
    results["targets"] = model_targets.judge(results["records"], results["conditions"])
    published = MODEL.find((ROOT / "BENCHMARKS.md").read_text())
    assert published == model_report.section_markdown(results).rstrip("\n")
    assert list(results["groups"]) == list(GROUP_NAMES)


# --------------------------------------------------------------------------------------------
# Slow: the compiled group


@pytest.mark.slow
def test_the_compiled_group_runs_transformers_static_cache_path(tmp_path):
    """hf_compiled through torch.compile's eager backend (traced, no code generated)."""
    pytest.importorskip("transformers")
    path = tmp_path / "model.json"
    code = bench_model(
        [
            "--quick",
            "--threads",
            "1",
            "--repeats",
            "1",
            "--groups",
            "hf_compiled",
            "--conditions",
            "idle",
            "--compile-backend",
            "eager",
            "--json",
            str(path),
        ]
    )
    assert code == 0
    results = json.loads(path.read_text())
    names = ("base", "base copy", "urpe")
    want = {(c, n, "generate", False) for c in ("batch 1", "batch 4") for n in names}
    assert _measured(results["records"], "hf_compiled") == want
    assert "compiled (eager)" in results["groups"]["hf_compiled"]["about"]
    judged = [t for t in results["targets"] if "static cache" in t["target"]]
    assert len(judged) == 2 and all(t["values"]["idle"] is not None for t in judged)
