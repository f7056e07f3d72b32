"""The causal-LM objective and the commands: a CI-sized run on real text lowers the validation
loss, the report is written, `urpe generate` streams text from the checkpoint, resume with
segment memory is exact, and bad input is one line."""

import json
import math

import lightning  # noqa: F401  (an extra `make test` installs: missing, it fails here)
import pytest
import torch

from urpe.cli import main
from urpe.data.text import load_corpus
from urpe.models import TransformerConfig
from urpe.models.lm import LanguageModel
from urpe.training.lm import CausalLM, SegmentStream, evaluate, held_out_segments

from .tiny import tiny_config, tiny_flags

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.py)


SMALL = tiny_flags(
    "lm",
    variants=None,
    steps=40,
    dim=32,
    ffn_dim=64,
    segment_length=32,
    memory_length=16,
    batch_size=8,
    eval_tokens=1500,
    factors="1,2",
    val_every=20,
    checkpoint_every=None,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    assert main(["reproduce", "lm", "--variants", "txl+urpe", *SMALL, "--out", str(out)]) == 0
    (record_path,) = (out / "records").glob("*.json")
    return out, json.loads(record_path.read_text())


def test_training_on_real_text_lowers_the_validation_loss(trained):
    out, record = trained
    config, result = record["config"], record["result"]
    torch.manual_seed(config["seed"])  # the run's initial weights (seed_everything(seed))
    untrained = LanguageModel.from_model_config(config["model"])
    valid = load_corpus("shakespeare", progress=False).valid[: config["eval"]["tokens"] + 1]
    before = evaluate(untrained, valid, 32, use_memory=True)["loss"]
    assert result["val_tokens"] == config["eval"]["tokens"]
    assert result["val_loss"] < before - 0.5, (before, result["val_loss"])
    val_curve = [loss for _, loss in result["curve"]["val"]]
    assert len(val_curve) == 2 and val_curve[-1] < val_curve[0]
    assert set(result["extrapolation"]) == {"chunks", "sliding", "memory"}
    assert set(result["extrapolation"]["memory"]) == {"1", "2"}
    assert result["tokens_per_second"] > 0 and result["params"] > 0
    for name in ("results.json", "results.md", "curves.png", "extrapolation.png"):
        assert (out / name).stat().st_size > 0
    text = (out / "results.md").read_text()
    assert "txl+urpe" in text and "Extrapolation" in text and "bpc" in text


def test_generate_streams_text_from_the_checkpoint(trained, capsys):
    out, record = trained
    (run_dir,) = (out / "runs").iterdir()
    capsys.readouterr()
    args = ["generate", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "3"]
    assert main(args) == 0
    cached = capsys.readouterr().out
    assert cached.startswith("ROMEO:") and len(cached) == len("ROMEO:") + 40 + 1
    assert main([*args, "--no-cache"]) == 0  # same text without the KV cache
    assert capsys.readouterr().out == cached
    checkpoint = next((run_dir / "checkpoints").iterdir())
    assert main(["generate", str(checkpoint), "--temperature", "0", "--max-new-tokens", "5"]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "{missing}"], "argument CHECKPOINT"),
        (["generate", "{run}", "--prompt", "\u20ac"], "argument --prompt"),
        (["generate", "{run}", "--top-p", "1.5"], "argument --top-p"),
        (["generate", "{run}", "--top-k", "100000"], "argument --top-k"),
        (["generate", "{run}", "--max-new-tokens", "-1"], "argument --max-new-tokens"),
        (["reproduce", "lm", "--variants", "rpe+bogus"], "argument --variants"),
        (["reproduce", "lm", "--preset", "paper"], "argument --dataset"),
        (["reproduce", "lm", "--dataset", "{missing}", "--out", "{out}"], "argument --dataset"),
        (["reproduce", "lm", "--dim", "30", "--heads", "4"], "argument --dim"),
    ],
)
def test_bad_input_is_one_line(trained, argv, message, tmp_path, capsys):
    out, _ = trained
    (run_dir,) = (out / "runs").iterdir()
    values = {
        "missing": str(tmp_path / "nothing"),
        "run": str(run_dir),
        "out": str(tmp_path / "out"),
    }
    argv = [a.format(**values) for a in argv]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as error:  # argparse's own errors exit from inside the parser
        code = error.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _fit(run_dir, steps, total, tokens, memory_restore=True, monkeypatch=None):
    import lightning as L

    from urpe.training import StepDataModule, TrainConfig, fit, quiet_lightning
    from urpe.training.optim import OptimConfig

    quiet_lightning()
    L.seed_everything(0, verbose=False)
    config = tiny_config(position="txl", gate="toeplitz", norm_first=True)
    model = LanguageModel(config, 8, 8)
    objective = CausalLM(model, OptimConfig(lr=1e-2, total_steps=total))
    data = StepDataModule(
        SegmentStream(tokens[:-200], 4, 8),
        held_out_segments(tokens[-200:], 4, 8),
        eval_batch_size=None,
    )
    settings = TrainConfig(
        max_steps=steps, val_every=steps, accelerator="cpu", devices=1, seed=0, log_every=1
    )
    fit(objective, data, settings, run_dir, resume=True)
    return model, objective


def test_resume_with_memory_is_exact(tmp_path, monkeypatch):
    tokens = torch.randint(0, 11, (2000,))
    straight, whole = _fit(tmp_path / "a", 8, 8, tokens)
    _fit(tmp_path / "b", 4, 8, tokens)  # interrupted after 4 updates (checkpoint at 4)
    resumed, part = _fit(tmp_path / "b", 8, 8, tokens)
    assert part.curve["train"] == whole.curve["train"] and len(part.step_seconds) == 8
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    # The memory in the checkpoint matters: resuming without it trains to other weights.
    _fit(tmp_path / "c", 4, 8, tokens)
    original = CausalLM.on_load_checkpoint

    def forget_memory(self, checkpoint):
        original(self, checkpoint)
        self._memory = {}

    monkeypatch.setattr(CausalLM, "on_load_checkpoint", forget_memory)
    forgetful, _ = _fit(tmp_path / "c", 8, 8, tokens)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            straight.state_dict().values(), forgetful.state_dict().values(), strict=True
        )
    )


def test_report_metric_and_evaluate_modes():
    from urpe.training.lm import report_metric

    assert report_metric(math.log(2), "bpc") == pytest.approx(1.0)
    assert report_metric(math.log(20), "perplexity") == pytest.approx(20.0)
    model = LanguageModel(TransformerConfig(vocab_size=7, num_layers=1, dim=8, num_heads=2), 4, 4)
    tokens = torch.randint(0, 7, (37,))
    for mode, memory in (("chunks", False), ("chunks", True), ("sliding", False)):
        result = evaluate(model, tokens, 8, mode=mode, use_memory=memory, batch_size=3)
        assert result["tokens"] == 36  # every target exactly once
    # Sliding windows of the whole stream score every target with all earlier tokens when the
    # window covers the stream: equal to one forward pass.
    full = evaluate(model, tokens, 64, mode="sliding")["loss"]
    logits, _ = model(tokens[None, :-1])
    expected = torch.nn.functional.cross_entropy(logits[0], tokens[1:]).item()
    assert full == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError):
        evaluate(model, tokens, 8, mode="sliding", use_memory=True)


@pytest.mark.parametrize("argv", [["generate", "--help"], ["reproduce", "lm", "--help"]])
def test_help_explains(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--prompt" in text if argv[0] == "generate" else "--variants" in text
