"""End to end through the real command: the probe separates URPE from RPE in seconds."""

import json

import pytest

from urpe.cli import main
from urpe.experiments.synthetic.report import claims, summarize
from urpe.experiments.synthetic.variants import VARIANTS, variant_config
from urpe.models import TransformerConfig

TINY = ["--seq-len", "8", "--steps", "150", "--batch-size", "32", "--layers", "2", "--dim", "32",
        "--heads", "4", "--ffn-dim", "64", "--lr", "3e-3", "--warmup", "15",
        "--eval-sequences", "256", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    code = main(["reproduce", "synthetic", "--tasks", "probe", "--variants", "rpe,urpe",
                 "--out", str(out), *TINY])  # fmt: skip
    assert code == 0
    return out


def test_urpe_passes_the_probe_and_rpe_stays_at_chance(probe_run):
    records = json.loads((probe_run / "results.json").read_text())
    accuracy = {r["variant"]: r["accuracy"] for r in records}
    assert accuracy["urpe"] >= 0.95
    # Rows of softmax sum to 1: identical tokens give identical outputs, one class everywhere.
    assert accuracy["rpe"] == pytest.approx(1 / 8)
    required = {"task", "variant", "seed", "vocab_size", "seq_len", "steps", "params", "accuracy",
                "seconds"}  # fmt: skip
    assert all(required <= set(r) for r in records)


def test_outputs_exist_and_parse(probe_run):
    text = (probe_run / "results.md").read_text()
    assert "| urpe |" in text and "| rpe |" in text and "## Claims" in text
    for name in ("accuracy.png", "learned_BC_probe.png"):
        data = (probe_run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert (probe_run / "logs").is_dir()
    assert list((probe_run / "logs").rglob("metrics.csv"))


def test_report_only_rebuilds_from_records(probe_run, capsys):
    assert main(["reproduce", "synthetic", "--out", str(probe_run), "--report-only"]) == 0
    assert "| urpe |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tasks", "pi,nonsense"], "unknown task nonsense"),
        (["--variants", "urpe,bogus"], "unknown variant bogus"),
        (["--vocab-size", "10,0"], "vocabulary sizes must be positive"),
        (["--dim", "30", "--heads", "4"], "divisible"),
    ],
)
def test_bad_values_give_one_line_errors(flags, message, tmp_path, capsys):
    assert main(["reproduce", "synthetic", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flag", [["--seq-len", "0"], ["--steps", "-3"], ["--lr", "x"]])
def test_bad_numbers_are_rejected_by_the_parser(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["reproduce", "synthetic", "--out", str(tmp_path), *flag])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_every_variant_builds_a_config():
    base = TransformerConfig(vocab_size=10, max_len=8)
    for name in VARIANTS:
        config = variant_config(name, base)
        assert config.absolute in (None, "learned", "sinusoidal")
    assert variant_config("urpe", base).gate == "toeplitz"
    assert variant_config("rpe", base).gate is None


def test_claims_are_checked_against_the_numbers():
    records = [
        dict(task="probe", variant="urpe", vocab_size=10, seq_len=8, steps=1, seed=0,
             accuracy=0.90, chance=0.125, seconds=1.0, params=1),
        dict(task="probe", variant="rpe", vocab_size=10, seq_len=8, steps=1, seed=0,
             accuracy=0.125, chance=0.125, seconds=1.0, params=1),
    ]  # fmt: skip
    held = {c["variant"]: c["held"] for c in claims(summarize(records))}
    assert held == {"urpe": False, "rpe": True}


def test_a_seed_fixes_the_run_exactly_on_cpu(tmp_path):
    def run(out):
        code = main(["reproduce", "synthetic", "--tasks", "etp", "--variants", "urpe",
                     "--out", str(out), *TINY, "--steps", "20", "--warmup", "2"])  # fmt: skip
        assert code == 0
        (record,) = json.loads((out / "results.json").read_text())
        return record["loss"], record["accuracy"]

    assert run(tmp_path / "a") == run(tmp_path / "b")
