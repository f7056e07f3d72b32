"""`urpe evaluate` on a synthetic run reproduces its recorded accuracy on the held-out set and
measures other draws; a saved model round-trips through `save_model` / `load_model`; mistakes
are one line."""

import json

import lightning  # noqa: F401  (the train extra)
import pytest
import torch

from urpe.cli import main

from .tiny import LEARNS, run_tiny


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    run_tiny("synthetic", out, **LEARNS, steps=40)
    (record,) = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    return out, record


def test_evaluate_reproduces_the_recorded_accuracy(synthetic_run, capsys):
    out, record = synthetic_run
    capsys.readouterr()
    assert main(["evaluate", str(out / "runs" / record["id"]), "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "synthetic" and result["task"] == "etp"
    assert result["accuracy"] == pytest.approx(record["result"]["accuracy"], abs=1e-6)
    assert (
        main(["evaluate", str(out), "etp", "--seed", "5", "--sequences", "32", "--no-progress"])
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line.startswith("accuracy ") and "32 etp sequences (seed 5" in line


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["evaluate", "{missing}"], "argument RUN: "),
        (["evaluate", "{run}", "pi"], "argument DATA: pi needs 8 classes; the model has 11"),
        (["evaluate", "{run}", "nonsense"], "argument DATA: unknown task 'nonsense'"),
        (["predict", "{run}", "CCO"], "argument RUN: "),
    ],
)
def test_mistakes_are_one_line(argv, fragment, synthetic_run, tmp_path, capsys):
    out, record = synthetic_run
    values = {"missing": str(tmp_path / "nothing"), "run": str(out / "runs" / record["id"])}
    capsys.readouterr()
    code = main([a.format(**values) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_save_model_round_trips_a_language_model_with_its_tokenizer(tmp_path, capsys):
    from urpe import load_model, save_model
    from urpe.data.text import CharTokenizer
    from urpe.models import TransformerConfig
    from urpe.models.lm import LanguageModel
    from urpe.training.bundles import TextModel

    tokenizer = CharTokenizer("abcdefgh \n")
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=tokenizer.vocab_size, num_layers=1, dim=16, num_heads=2)
    model = LanguageModel(config, 16)
    save_model(model, tmp_path / "lm", tokenizer=tokenizer, run={"note": "my own loop"})
    loaded = load_model(tmp_path / "lm")
    assert isinstance(loaded, TextModel) and loaded.metric == "bpc"
    pairs = zip(model.state_dict().values(), loaded.model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert loaded.generate("abc", 5, temperature=0) == loaded.generate("abc", 5, temperature=0)
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh " * 20)
    score = loaded.score(text.read_text())
    assert score["tokens"] == 179 and score["bpc"] > 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "lm"), str(text), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["bpc"] == pytest.approx(score["bpc"])
    assert (
        main(
            [
                "generate",
                str(tmp_path / "lm"),
                "--prompt",
                "ab",
                "--max-new-tokens",
                "4",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "ab" + loaded.generate("ab", 4, temperature=0) + "\n"
    loaded.save(tmp_path / "again")  # a bundle saves with its tokenizer
    assert isinstance(load_model(tmp_path / "again"), TextModel)
