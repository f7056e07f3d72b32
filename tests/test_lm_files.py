"""Your own text through `urpe reproduce lm`, `urpe evaluate` and `urpe generate`: a bare path
writes inside --out, a run is identified by the file's content (an edited file trains again, a
moved one does not), evaluate scores a file as the report does, and the flags a user gets wrong
are named."""

import json
import math
import shutil

import lightning  # noqa: F401  (the train extra)
import pytest
import torch

from urpe.cli import main
from urpe.data.text import ByteTokenizer, WordTokenizer, load_tokenizer
from urpe.training.bundles import TextModel, load_model

from .tiny import tiny_flags

TINY = tiny_flags("lm", steps=20, dim=32, ffn_dim=64, segment_length=32, checkpoint_every=10)


def _text(words: int = 3000, seed: int = 0) -> str:
    """ASCII prose-like text (bytes = characters)."""
    generator = torch.Generator().manual_seed(seed)
    vocabulary = "the cat sat on a mat and saw two dogs run by an old red barn".split()
    picks = torch.randint(0, len(vocabulary), (words,), generator=generator).tolist()
    lines = [" ".join(vocabulary[i] for i in picks[k : k + 12]) for k in range(0, words, 12)]
    return "\n".join(lines) + "\n"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """A run on a text file given as a bare relative path (the README form)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text(_text())
    monkeypatch.chdir(tmp_path)
    assert main(["reproduce", "lm", "--dataset", "data/corpus.txt", *TINY, "--out", "out"]) == 0
    return tmp_path / "out", data / "corpus.txt"


def _records(out):
    return [json.loads(p.read_text()) for p in sorted((out / "records").glob("*.json"))]


def test_bare_path_writes_inside_out_with_the_path_absolute_and_the_content_digested(trained):
    out, corpus = trained
    (record,) = _records(out)
    assert not list(corpus.parent.glob("*.json")) and not (out / "records" / "data").exists()
    config = record["config"]
    assert config["dataset"] == "text:sha256-" + config["data_sha256"][0][:12]
    assert config["locations"] == {"dataset": f"text:{corpus.resolve()}"}
    assert len(config["data_sha256"]) == 1 and len(config["data_sha256"][0]) == 64
    assert (out / "results.json").is_file()
    report = (out / "results.md").read_text()  # the file by its name, not its digest
    assert "| corpus.txt | rpe+urpe |" in report and "sha256" not in report


def test_resume_trusts_the_content_not_the_path(trained, capsys):
    out, corpus = trained
    argv = ["reproduce", "lm", *TINY, "--out", str(out), "--resume"]
    capsys.readouterr()
    moved = corpus.parent / "moved.txt"
    shutil.move(corpus, moved)
    assert main([*argv, "--dataset", str(moved)]) == 0
    assert "1 of 1 runs already recorded" in capsys.readouterr().err
    assert len(_records(out)) == 1
    moved.write_text(_text(seed=1))  # edited: other data, so another run
    assert main([*argv, "--dataset", str(moved)]) == 0
    assert "already recorded" not in capsys.readouterr().err
    assert len(_records(out)) == 2


def test_evaluate_scores_a_file_with_the_reports_sliding_rule(trained, capsys):
    out, corpus = trained
    (record,) = _records(out)
    data = corpus.read_bytes()
    n = len(data)
    valid = corpus.parent / "valid.txt"
    valid.write_bytes(data[n * 90 // 100 : n * 95 // 100])  # the run's validation split
    capsys.readouterr()
    assert main(["evaluate", str(out), str(valid), "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["metric"] == "bpc" and result["mode"] == "sliding" and result["context"] == 32
    sliding = record["result"]["extrapolation"]["sliding"]["1"]  # nats, factor 1 = context 32
    assert result["bpc"] == pytest.approx(sliding / math.log(2), rel=1e-5)
    assert result["tokens"] == len(valid.read_bytes()) - 1
    assert main(["evaluate", str(out), str(valid), "--mode", "chunks", "--no-progress"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("bpc ") and "chunks" in line and "\n" not in line


def test_loaded_run_generates_text_and_finds_its_tokenizer_from_a_step(trained):
    out, _ = trained
    (run_dir,) = (out / "runs").iterdir()
    step = run_dir / "checkpoints" / "step-00000020"
    assert isinstance(load_tokenizer(step), ByteTokenizer)  # two levels up: run_dir/tokenizer
    model = load_model(step)
    assert isinstance(model, TextModel) and model.metric == "bpc"
    text = model.generate("the cat", max_new_tokens=12, temperature=0)
    assert isinstance(text, str) and len(text.encode()) == 12
    ids = model.tokenizer.encode("the cat")[None, :]
    greedy = [int(t[0]) for t in model.model.generate(ids, 12, temperature=0)]
    assert text == model.tokenizer.decode(greedy)
    assert model.vocab_size == 256 and model(ids)[0].shape == (1, 7, 256)  # the module's


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (
            ["--dataset", "shakespeare", "--tokenizer", "bpe", "--vocab-size", "100"],
            "argument --vocab-size: a bpe vocab_size must be at least 257",
        ),
        (
            ["--dataset", "shakespeare", "--tokenizer", "char", "--vocab-size", "300"],
            "argument --vocab-size: vocab_size applies to the bpe and word",
        ),
    ],
)
def test_tokenizer_settings_blame_their_own_flag(flags, fragment, tmp_path, capsys):
    code = main(["reproduce", "lm", *flags, "--steps", "2", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and err.count("\n") == 1


def test_word_prompts_warn_about_unknown_words_and_continue_with_a_space(tmp_path, capsys):
    from urpe.models import TransformerConfig
    from urpe.models.lm import LanguageModel
    from urpe.training.checkpoint import save_model

    tokenizer = WordTokenizer.train(_text(300))
    assert tokenizer.unknown("the zebra sat on a unicorn zebra") == ["zebra", "unicorn"]
    ids = tokenizer.encode_prompt("the cat")
    assert tokenizer.decode(ids) == "the cat" and tokenizer.eos_id not in ids.tolist()
    assert tokenizer.encode_prompt("the cat\n").tolist()[-1] == tokenizer.eos_id
    assert tokenizer.join("the cat", "sat") == "the cat sat"
    assert tokenizer.join("the cat\n", "sat") == "the cat\nsat"
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=tokenizer.vocab_size, num_layers=1, dim=16, num_heads=2)
    save_model(LanguageModel(config, 16), tmp_path / "m", tokenizer=tokenizer)
    capsys.readouterr()
    argv = ["generate", str(tmp_path / "m"), "--prompt", "the zebra", "--max-new-tokens", "3"]
    assert main([*argv, "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "not in the vocabulary" in line]
    assert len(warnings) == 1 and "zebra" in warnings[0]
    shown = captured.out
    assert shown.startswith("the zebra ") or shown.startswith("the zebra\n"), shown
    assert not shown.startswith("the zebra<")


def test_a_file_of_blank_lines_is_refused_before_training(tmp_path, capsys):
    """It used to train and report a loss on nothing but newlines."""
    blank = tmp_path / "blank.txt"
    blank.write_text("\n" * 4000 + "  \r\n\t\n")
    code = main(["reproduce", "lm", "--dataset", str(blank), *TINY, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"argument --dataset: {blank} holds no text (only blank lines or spaces)" in err
    assert not (tmp_path / "o" / "records").exists()


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """An untrained byte-level language model saved as a run would be (no training needed)."""
    from urpe.models import TransformerConfig
    from urpe.models.lm import LanguageModel
    from urpe.training.checkpoint import save_model

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=256, num_layers=1, dim=16, num_heads=2)
    folder = tmp_path_factory.mktemp("byte") / "model"
    save_model(LanguageModel(config, 16), folder, tokenizer=ByteTokenizer())
    return folder


def test_evaluate_reads_a_file_as_training_does(byte_model, tmp_path, capsys, monkeypatch):
    """A byte-level model trains on any file's bytes (Latin-1 too); evaluate used to refuse
    such a file as "not UTF-8" and now scores its bytes, as the training split would be."""
    monkeypatch.delenv("URPE_CACHE_DIR")  # no data is cached: the user's built kernel serves
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Grüße aus Köln, à bientôt. ".encode("latin-1") * 8)
    capsys.readouterr()
    assert main(["evaluate", str(byte_model), str(latin1), "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = load_model(byte_model).score(latin1.read_bytes())
    assert result["tokens"] == len(latin1.read_bytes()) - 1
    assert result["bpc"] == pytest.approx(expected["bpc"], rel=1e-6)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n")
    code = main(["evaluate", str(byte_model), str(blank)])
    err = capsys.readouterr().err
    assert code == 2 and "argument DATA: " in err and "holds no text" in err
    assert err.count("\n") == 1
