"""The Python API takes what the commands take: `urpe.load_model` resolves a sweep folder by the
commands' rule (and says which run it took), and `TextModel.generate` takes a prompt as text, a
list of ids, or a tensor of ids (one row or a batch)."""

import json
import re
import warnings

import pytest
import torch

import urpe
from urpe.cli import main
from urpe.training.bundles import TextModel


def _best_lm_run(out):
    records = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    assert len(records) == 2
    return min(records, key=lambda r: r["result"]["val_loss"])


@pytest.mark.parametrize("loader", ["urpe.load_model", "urpe.training.load_model"])
def test_load_model_takes_a_sweep_folder_like_the_commands(loader, lm_sweep):
    out, _ = lm_sweep
    load = urpe.load_model if loader == "urpe.load_model" else urpe.training.load_model
    best = _best_lm_run(out)
    note = re.escape(f"using run {best['id']} (") + ".*the best of 2"
    with pytest.warns(UserWarning, match=note) as said:
        from_sweep = load(out)
    assert said[0].filename == __file__  # the warning points at the caller's line
    assert isinstance(from_sweep, TextModel)
    from_run = load(out / "runs" / best["id"])
    pairs = zip(from_sweep.state_dict().values(), from_run.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_the_commands_take_the_run_load_model_takes(lm_sweep, capsys):
    out, text = lm_sweep
    best = _best_lm_run(out)
    capsys.readouterr()
    assert main(["evaluate", str(out), str(text), "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert f"using run {best['id']}" in captured.err
    assert f"/runs/{best['id']}/" in json.loads(captured.out)["checkpoint"]


def test_a_single_run_needs_no_note(lm_sweep):
    out, _ = lm_sweep
    best = _best_lm_run(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        urpe.load_model(out / "runs" / best["id"])


def test_a_folder_without_finished_runs_is_named(tmp_path):
    (tmp_path / "records").mkdir()
    with pytest.raises(FileNotFoundError, match="no finished run with a checkpoint under runs/"):
        urpe.load_model(tmp_path)


@pytest.fixture(scope="module")
def text_model(lm_sweep):
    out, _ = lm_sweep
    return urpe.load_model(out / "runs" / _best_lm_run(out)["id"])


def test_generate_takes_text_ids_or_a_tensor(text_model):
    prompt = "the cat"
    expected = text_model.generate(prompt, 8, temperature=0)
    ids = text_model.tokenizer.encode(prompt)  # (P,)
    assert isinstance(expected, str) and len(expected.encode()) == 8
    assert text_model.generate(ids, 8, temperature=0) == expected
    assert text_model.generate(ids.tolist(), 8, temperature=0) == expected
    assert text_model.generate(ids.to(torch.int32), 8, temperature=0) == expected


def test_generate_continues_each_row_of_a_batch(text_model):
    first, second = text_model.tokenizer.encode("the cat"), text_model.tokenizer.encode("a dog s")
    batch = torch.stack([first, second])  # (2, P)
    continuations = text_model.generate(batch, 6, temperature=0)
    assert continuations == [
        text_model.generate("the cat", 6, temperature=0),
        text_model.generate("a dog s", 6, temperature=0),
    ]
    assert text_model.generate(batch.tolist(), 6, temperature=0) == continuations
    assert text_model.generate([first, second], 6, temperature=0) == continuations
    assert text_model.generate(first[None, :], 6, temperature=0) == continuations[:1]


@pytest.mark.parametrize(
    "prompt, fragment",
    [
        (torch.tensor([], dtype=torch.long), "no tokens"),
        (torch.tensor([1.0, 2.0]), "integer"),
        ([1.5, 2.0], "integer"),
        ([], "no tokens"),
        (torch.tensor([1, 300]), "ids must lie in [0, 256)"),
        ([[1, 2], [3]], "same length"),
        (["the cat", "a dog"], "one text at a time"),
        (torch.zeros(1, 1, 2, dtype=torch.long), "(P,) or (B, P)"),
        ("", "empty"),
    ],
)
def test_generate_names_a_prompt_it_cannot_take(prompt, fragment, text_model):
    with pytest.raises(ValueError) as error:
        text_model.generate(prompt, 2)
    assert fragment in str(error.value)


def test_loading_a_trained_model_reads_its_config_once(lm_sweep, monkeypatch):
    """`urpe.load_model` and the commands' `find_trained` resolve a checkpoint once and pass its
    config.json down, instead of reading it again at every layer (three times before)."""
    from urpe.experiments.trained import find_trained
    from urpe.training import checkpoint

    out, _ = lm_sweep
    run = out / "runs" / _best_lm_run(out)["id"]
    reads = []
    read_json = checkpoint.read_json

    def counting(path, *args, **kwargs):
        reads.append(path.name)
        return read_json(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "read_json", counting)
    trained = find_trained(run, "lm", say=lambda line: None)
    assert isinstance(trained.model, TextModel) and reads.count("config.json") == 1
    reads.clear()
    assert isinstance(urpe.load_model(run), TextModel) and reads.count("config.json") == 1
