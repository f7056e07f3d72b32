"""End to end through the real command: the probe separates URPE from RPE in seconds."""

import json

import pytest
import torch

from urpe.cli import main
from urpe.experiments.synthetic.report import claims, summarize
from urpe.experiments.synthetic.variants import VARIANTS, variant_config
from urpe.models import TransformerConfig, TransformerEncoder

from .tiny import tiny_flags

# two layers of width 32 for 150 steps: enough to learn the tasks the tests check
TINY = tiny_flags(
    "synthetic",
    tasks=None,
    variants=None,
    seq_len=8,
    steps=150,
    batch_size=32,
    layers=2,
    dim=32,
    heads=4,
    ffn_dim=64,
    lr="3e-3",
    warmup=15,
    eval_sequences=256,
    checkpoint_every=None,
)


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    code = main(
        [
            "reproduce",
            "synthetic",
            "--tasks",
            "probe",
            "--variants",
            "rpe,urpe",
            "--out",
            str(out),
            *TINY,
        ]
    )
    assert code == 0
    return out


@pytest.mark.slow
def test_urpe_passes_the_probe_and_rpe_stays_at_chance(probe_run):
    rows = json.loads((probe_run / "results.json").read_text())
    accuracy = {r["variant"]: r["accuracy"] for r in rows}
    assert accuracy["urpe"] >= 0.95
    # Rows of softmax sum to 1: identical tokens give identical outputs, one class everywhere.
    assert accuracy["rpe"] == pytest.approx(1 / 8)
    for row in rows:
        config = row["record"]["config"]
        assert config["model"]["transformer"]["dim"] == 32 and config["optim"]["lr"] == 3e-3
        assert config["train"] == {"steps": 150, "batch_size": 32, "precision": "32-true"}


@pytest.mark.slow  # (a trained run's fixture)
def test_outputs_exist_and_parse(probe_run):
    text = (probe_run / "results.md").read_text()
    assert "| urpe |" in text and "| rpe |" in text and "## Claims" in text
    for name in ("accuracy.png", "learned_BC_probe.png"):
        data = (probe_run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert len(list((probe_run / "runs").glob("*/logs/metrics.csv"))) == 2
    assert len(list((probe_run / "runs").glob("*/checkpoints/step-00000150"))) == 2


@pytest.mark.slow  # (a trained run's fixture)
def test_report_only_rebuilds_from_records(probe_run, capsys):
    assert main(["reproduce", "synthetic", "--out", str(probe_run), "--report-only"]) == 0
    assert "| urpe |" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_breaks_row_sum_matches_what_the_model_does(name):
    """The theory label of each variant, checked on its model: with random weights, identical
    tokens give position-dependent outputs exactly when the variant breaks the row sum."""
    torch.manual_seed(0)
    config = variant_config(
        name, TransformerConfig(vocab_size=4, max_len=8, num_layers=2, dim=16, num_heads=2)
    )
    model = TransformerEncoder(config).double().eval()
    with torch.no_grad():
        for parameter in model.parameters():  # e.g. C away from its all-ones start
            parameter.normal_(0, 0.5)
        out = model(torch.zeros(1, 8, dtype=torch.long))  # (1, 8, E)
    spread = (out - out[:, :1]).abs().max().item()
    if VARIANTS[name].breaks_row_sum:
        assert spread > 1e-3
    else:
        assert spread < 1e-9


def test_claims_are_checked_against_the_numbers():
    rows = [
        dict(
            task="probe",
            variant="urpe",
            vocab_size=10,
            seq_len=8,
            steps=1,
            seed=0,
            accuracy=0.90,
            chance=0.125,
            seconds=1.0,
            params=1,
        ),
        dict(
            task="probe",
            variant="rpe",
            vocab_size=10,
            seq_len=8,
            steps=1,
            seed=0,
            accuracy=0.125,
            chance=0.125,
            seconds=1.0,
            params=1,
        ),
    ]
    held = {c["variant"]: c["held"] for c in claims(summarize(rows))}
    assert held == {"urpe": False, "rpe": True}


@pytest.mark.slow
def test_a_seed_fixes_the_run_exactly_on_cpu(tmp_path):
    def run(out):
        code = main(
            [
                "reproduce",
                "synthetic",
                "--tasks",
                "etp",
                "--variants",
                "urpe",
                "--out",
                str(out),
                *TINY,
                "--steps",
                "20",
                "--warmup",
                "2",
            ]
        )
        assert code == 0
        (row,) = json.loads((out / "results.json").read_text())
        return row["loss"], row["accuracy"]

    assert run(tmp_path / "a") == run(tmp_path / "b")


def test_migrate_converts_an_old_record_and_checks_the_unrecorded_width(tmp_path):
    from urpe.experiments.synthetic.migrate import migrate
    from urpe.experiments.synthetic.report import rows
    from urpe.training.models import EncoderTokenClassifier

    config = variant_config(
        "urpe",
        TransformerConfig(vocab_size=10, max_len=8, num_layers=1, dim=16, num_heads=2, ffn_dim=64),
    )
    params = sum(p.numel() for p in EncoderTokenClassifier(config, 8).parameters())
    old = dict(
        task="pi",
        variant="urpe",
        seed=1,
        vocab_size=10,
        seq_len=8,
        steps=50,
        params=params,
        accuracy=0.75,
        loss=0.5,
        chance=0.125,
        seconds=3.0,
        batch_size=16,
        lr=0.002,
        warmup=5,
        num_layers=1,
        dim=16,
        num_heads=2,
        eval_sequences=64,
        threads=1,
        run="pi-urpe-V10-L8-S50-seed1",
    )
    records = tmp_path / "records"
    records.mkdir()
    (records / "pi-urpe-V10-L8-S50-seed1.json").write_text(json.dumps(old))
    torch.save(
        {"B": torch.ones(2, 8, 8), "C": torch.ones(2, 8, 8)},
        records / "pi-urpe-V10-L8-S50-seed1.pt",
    )
    bad = {**old, "params": params + 1, "run": "pi-urpe-V10-L8-S50-seed2", "seed": 2}
    (records / "pi-urpe-V10-L8-S50-seed2.json").write_text(json.dumps(bad))
    converted, problems = migrate(tmp_path)
    assert converted == 1 and len(problems) == 1 and "seed2.json: not converted" in problems[0]
    (new,) = [
        json.loads(p.read_text())
        for p in records.glob("*-*-*.json")
        if "format" in json.loads(p.read_text())
    ]
    assert new["config"]["model"]["transformer"]["ffn_dim"] == 64  # recovered from the count
    assert new["config"]["data"]["stream"] == "per-process/0"
    assert (records / f"{new['id']}.safetensors").exists()
    assert not (records / "pi-urpe-V10-L8-S50-seed1.pt").exists()
    (row,) = rows([new])
    assert (row["accuracy"], row["seed"], row["steps"]) == (0.75, 1, 50)


def test_a_record_of_a_variant_this_urpe_does_not_know_is_still_reported(
    probe_run, tmp_path, capsys
):
    # Sweeps may share an OUT: a newer urpe can leave a record of a variant added since.
    import shutil

    out = tmp_path / "out"
    shutil.copytree(probe_run / "records", out / "records")
    for path in (out / "records").glob("*urpe*.json"):
        record = json.loads(path.read_text())
        record["config"]["variant"] = "urpe-from-the-future"
        path.write_text(json.dumps(record))
    assert main(["reproduce", "synthetic", "--out", str(out), "--report-only"]) == 0
    text = (out / "results.md").read_text()
    assert "| urpe-from-the-future | ? |" in text and "| rpe | no |" in text
    assert "Traceback" not in capsys.readouterr().err
