"""The shared sweep runner: identity, resume, atomic records, parallel = sequential, reports
that never average different settings."""

import json

import pytest

from urpe.cli import main
from urpe.experiments.runner import RunSpec, config_digest
from urpe.experiments.synthetic.report import rows, summarize

TINY = ["--tasks", "pi,probe", "--variants", "nope,urpe", "--seq-len", "6", "--steps", "12",
        "--batch-size", "8", "--layers", "1", "--dim", "16", "--heads", "2", "--ffn-dim", "16",
        "--eval-sequences", "32", "--no-progress", "--threads", "1",
        "--checkpoint-every", "0"]  # fmt: skip


def _sweep(out, *flags):
    assert main(["reproduce", "synthetic", "--out", str(out), *TINY, *flags]) == 0
    return {
        r["id"]: r for r in (json.loads(p.read_text()) for p in (out / "records").glob("*.json"))
    }


def test_identity_is_the_whole_config():
    a = RunSpec("x", {"model": {"dim": 16}, "seed": 0})
    b = RunSpec("x", {"seed": 0, "model": {"dim": 16}})  # key order does not matter
    c = RunSpec("x", {"model": {"dim": 64}, "seed": 0})
    assert a.id == b.id != c.id and a.id.startswith("x-")
    assert config_digest(a.config) == config_digest(b.config)


def test_parallel_sweep_equals_sequential(tmp_path):
    sequential = _sweep(tmp_path / "seq", "--jobs", "1")
    parallel = _sweep(tmp_path / "par", "--jobs", "2")
    assert sequential.keys() == parallel.keys() and len(sequential) == 4
    for key, record in sequential.items():
        assert record["result"] == parallel[key]["result"]
    assert {r["execution"]["jobs"] for r in parallel.values()} == {2}


def test_resume_skips_only_exact_matches_and_reports_them_apart(tmp_path, capsys):
    out = tmp_path / "out"
    first = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe")
    again = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe", "--resume")
    assert again == first  # nothing retrained: the record file is untouched
    assert "1 of 1 runs already recorded" in capsys.readouterr().err
    # A different width is a different run: --resume trains it, and the report keeps them apart.
    both = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe", "--resume",
                  "--dim", "8")  # fmt: skip
    assert len(both) == 2
    table = rows(list(both.values()))
    labels = sorted(r["label"] for r in table)
    assert labels == ["urpe (model.transformer.dim=16)", "urpe (model.transformer.dim=8)"]
    assert all(s["n"] == 1 for s in summarize(table).values())
    text = (out / "results.md").read_text()
    assert "| urpe (model.transformer.dim=8) |" in text and "(n=2)" not in text


@pytest.mark.parametrize("damage", [b"", b'{"format": "urpe-record/2", "id": "x", "conf', b"\x80"])
def test_a_corrupt_record_is_named_and_its_run_trained_again(tmp_path, capsys, damage):
    out = tmp_path / "out"
    (record,) = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe").values()
    path = out / "records" / f"{record['id']}.json"
    path.write_bytes(damage)
    capsys.readouterr()
    again = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe", "--resume")
    err = capsys.readouterr().err
    assert str(path) in err and "training probe-urpe" in err and "Traceback" not in err
    assert again[record["id"]]["result"] == record["result"]


def test_a_sequential_sweep_gives_back_the_callers_thread_count(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _sweep(tmp_path / "out", "--jobs", "1", "--variants", "urpe", "--tasks", "probe")
        assert torch.get_num_threads() == 2  # the sweep ran with --threads 1
    finally:
        torch.set_num_threads(before)
