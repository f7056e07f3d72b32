"""`urpe reproduce long-context` and `urpe evaluate long-context`: the command's names match the
registries, a tiny sweep writes results.json in its documented shape (and the figures), and the
evaluation runs on tiny Hugging Face folders with their own tokenizer and on a run of the sweep,
where it gives the recorded numbers again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from urpe.cli import main
from urpe.experiments.long_context.presets import (
    ALL_ENCODINGS,
    DEPTH_TASKS,
    PRESETS,
    TASKS,
    parse_long_context_variant,
)
from urpe.tasks.long_context import TASK_WORDS
from urpe.tasks.long_context import TASKS as REGISTRY

QUIET = ["--jobs", "1", "--threads", "1", "--accelerator", "cpu", "--no-progress"]


def test_the_command_knows_the_registered_tasks_and_every_encoding():
    assert TASKS == tuple(REGISTRY)
    assert set(DEPTH_TASKS) == {name for name, task in REGISTRY.items() if task.uses_depth}
    for name in ALL_ENCODINGS:
        parse_long_context_variant(name)
    for gated in ("rope+urpe", "alibi+urpe", "fox+urpe"):
        assert gated in PRESETS["quick"].variants
    with pytest.raises(ValueError, match="segment memory"):
        parse_long_context_variant("txl")


def test_bad_settings_are_one_line_naming_the_flag(tmp_path, capsys):
    assert (
        main(["reproduce", "long-context", "--variants", "rope+mem", "--out", str(tmp_path)]) == 2
    )
    assert "--variants" in capsys.readouterr().err
    argv = ["reproduce", "long-context", "--preset", "smoke", "--train-length", "16"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--train-length" in err and "too short" in err


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    from urpe.kernels.cpp.build import unavailable

    unavailable()  # the C++ kernel from the usual cache, not rebuilt in the tests' own cache
    path = tmp_path_factory.mktemp("long-context") / "notes.txt"
    path.write_text("the grass is green . the sky is blue . here we go .\n" * 300)
    return path


@pytest.fixture(autouse=True)
def _cache(text_file, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(text_file.parent / "cache"))


@pytest.fixture(scope="module")
def sweep(text_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    argv = [
        "reproduce", "long-context", "--preset", "smoke", "--variants", "ape,rope+urpe",
        "--steps", "2", "--text-steps", "2", "--warmup", "1", "--batch-size", "4",
        "--samples", "2", "--factors", "1,2", "--depths", "0,1", "--eval-tokens", "300",
        "--corpora", str(text_file), "--out", str(out), *QUIET,
    ]  # fmt: skip
    assert main(argv) == 0
    return out


@pytest.mark.slow  # trains 4 tiny models through Lightning: ~25 CPU-seconds with the next test
def test_a_sweep_writes_results_in_the_documented_shape(sweep, text_file):
    results = json.loads((sweep / "results.json").read_text())
    table = results["results"]
    assert set(table) == {*TASKS, f"perplexity/{text_file.name}"}
    for task in TASKS:
        assert set(table[task]) == {"ape", "rope+urpe"}
        assert results["metric"][task] == "accuracy"
        assert results["chance"][task] == REGISTRY[task].chance
        for variant, lengths in table[task].items():
            assert set(lengths) == {"64", "128"}
            for length, cell in lengths.items():
                if task in DEPTH_TASKS:
                    assert set(cell) == {"0", "1"}
                    values = list(cell.values())
                else:
                    values = [cell]
                for value in values:
                    if variant == "ape" and length == "128":
                        assert value is None  # learned positions end at the training length
                    else:
                        assert 0.0 <= value <= 1.0
    perplexity = table[f"perplexity/{text_file.name}"]
    assert perplexity["ape"]["128"] is None and perplexity["rope+urpe"]["128"] > 1.0
    assert "learned absolute positions end at 64" in json.dumps(results["notes"]["ape"])
    assert results["training_length"] == {"ape": 64, "rope+urpe": 64}
    for name in ("accuracy.png", *(f"needle_{t}.png" for t in DEPTH_TASKS), "results.md"):
        assert (sweep / name).stat().st_size > 0
    text = (sweep / "results.md").read_text()
    assert "## passkey" in text and "| ape | " in text and "n/a" in text


@pytest.mark.slow
def test_evaluating_a_task_run_gives_its_recorded_numbers(sweep, tmp_path, capsys):
    (run,) = [p for p in (sweep / "runs").iterdir() if p.name.startswith("tasks-rope+urpe")]
    (record,) = [
        json.loads(p.read_text()) for p in (sweep / "records").glob("*.json") if p.stem == run.name
    ]
    argv = ["evaluate", "long-context", str(run), "--factors", "1,2", "--depths", "0,1"]
    assert main([*argv, "--samples", "2", "--json", "--no-progress"]) == 0
    measured = json.loads(capsys.readouterr().out)["results"]
    for task, cells in record["result"]["accuracy"].items():
        assert measured[task]["rope+urpe"] == cells


def _tokenizer_folder(folder: Path) -> int:
    """A word-level Hugging Face tokenizer of the task words, saved in `folder`; its size."""
    import tokenizers
    import transformers

    words = ["[UNK]", *TASK_WORDS]
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    fast.save_pretrained(folder)
    return len(words)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_evaluate_runs_on_a_hugging_face_folder_with_its_tokenizer(
    family, text_file, tmp_path, capsys
):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / family
    vocab = _tokenizer_folder(folder)
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=vocab, n_positions=64, n_embd=32, n_layer=1, n_head=4
        )
        model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    out = tmp_path / "out"
    argv = ["evaluate", "long-context", str(folder), "--lengths", "64,128", "--samples", "2"]
    argv += ["--depths", "0.5", "--corpora", str(text_file), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "## passkey" in printed
    results = json.loads((out / "results.json").read_text())
    for task in TASKS:
        cells = results["results"][task][family]
        value = cells["64"]["0.5"] if task in DEPTH_TASKS else cells["64"]
        assert 0.0 <= value <= 1.0
        beyond = cells["128"]["0.5"] if task in DEPTH_TASKS else cells["128"]
        assert (beyond is None) == (family == "gpt2")  # GPT-2's table of positions ends at 64
    assert results["results"][f"perplexity/{text_file.name}"][family]["64"] > 1.0
    assert (out / "accuracy.png").exists() and (out / "needle_passkey.png").exists()


def test_evaluate_names_a_folder_without_a_model(tmp_path, capsys):
    assert main(["evaluate", "long-context", str(tmp_path / "nothing")]) == 2
    assert "MODEL" in capsys.readouterr().err
