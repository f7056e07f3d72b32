"""The inspection tools of the synthetic experiment and the vocab preset."""

import json
import math

import pytest
import torch

from urpe.experiments.synthetic.experiment import plan
from urpe.experiments.synthetic.inspect import (
    attention_weights,
    position_probe,
    value_agreement,
)
from urpe.experiments.synthetic.inspect import main as inspect_main
from urpe.experiments.synthetic.presets import PRESETS
from urpe.experiments.synthetic.variants import variant_config
from urpe.models import TransformerConfig
from urpe.training import EncoderTokenClassifier


def _written_out_weights(mixer, x: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + b(j - i)) * c(j - i) from the layer's parameters, by hand."""
    b, n, _ = x.shape
    h, d = mixer.num_heads, mixer.head_dim
    q = (x @ mixer.q_proj.weight.T + mixer.q_proj.bias).view(b, n, h, d).transpose(1, 2)
    k = (x @ mixer.k_proj.weight.T + mixer.k_proj.bias).view(b, n, h, d).transpose(1, 2)
    bias_table, gate_table = mixer.position.table, mixer.gate.table  # (H, 2K + 1)
    K = (bias_table.shape[1] - 1) // 2
    out = torch.empty(b, h, n, n, dtype=x.dtype)
    for i in range(n):
        for j in range(n):
            offset = max(-K, min(K, j - i)) + K
            out[:, :, i, j] = (q[:, :, i] * k[:, :, j]).sum(-1) / math.sqrt(d) + bias_table[
                :, offset
            ]
    out = out.softmax(-1)
    for i in range(n):
        for j in range(n):
            out[:, :, i, j] *= gate_table[:, max(-K, min(K, j - i)) + K]
    return out


@pytest.mark.parametrize("length", [5, 8])
def test_attention_weights_are_the_urpe_formula(length):
    torch.manual_seed(0)
    config = variant_config(
        "urpe", TransformerConfig(vocab_size=7, max_len=8, num_layers=2, dim=16, num_heads=2)
    )
    model = EncoderTokenClassifier(config, 5).double()
    with torch.no_grad():  # a trained-looking B and C, not the initial ones
        model.encoder.layers[0].mixer.position.table.normal_(0, 1.0)
        model.encoder.layers[0].mixer.gate.table.uniform_(0.3, 1.7)
    inputs = []
    model.encoder.layers[1].mixer.register_forward_hook(lambda m, a, o: inputs.append(a[0]))
    tokens = torch.randint(0, 7, (3, length))
    weights = attention_weights(model, tokens)
    assert len(weights) == 2 and weights[1].shape == (3, 2, length, length)
    # B and C are shared by the layers: layer 1 reads the tables set through layer 0.
    expected = _written_out_weights(model.encoder.layers[1].mixer, inputs[0])
    torch.testing.assert_close(weights[1], expected)
    # Rows no longer sum to 1 once C is not all ones.
    assert (weights[1].sum(-1) - 1).abs().max() > 0.05


def test_position_probe_tells_a_position_code_from_noise():
    torch.manual_seed(0)
    n = 12
    one_hot = torch.eye(n).expand(40, n, n) + 0.05 * torch.randn(40, n, n)
    scalar = torch.arange(n, dtype=torch.float64)[None, :, None].expand(40, n, 3)
    scalar = scalar + 0.01 * torch.randn(40, n, 3)
    noise = torch.randn(40, n, 16)
    assert position_probe(one_hot)["r2"] > 0.95 and position_probe(one_hot)["exact"] == 1.0
    # A clean monotone scalar code is read exactly; a noisy one (spread over about 3 positions) is
    # still linear in the index but no longer tells neighbours apart.
    assert position_probe(scalar) == {"r2": pytest.approx(1, abs=0.01), "exact": 1.0}
    blurred = scalar + 1.5 * torch.randn(40, n, 1)
    assert position_probe(blurred)["r2"] > 0.7 and position_probe(blurred)["exact"] < 0.5
    assert position_probe(noise)["r2"] < 0.1 and position_probe(noise)["exact"] < 0.3
    with pytest.raises(ValueError, match="at least 2"):
        position_probe(noise[:1])


def test_inspect_command_reports_a_trained_run(tiny_run, tmp_path, capsys):
    out = tiny_run("synthetic", steps=4, dim=8, eval_sequences=8, checkpoint_every=None)
    run_dir = next((out / "runs").iterdir())
    assert inspect_main([str(run_dir), "--sequences", "4", "--json", str(tmp_path / "i.json")]) == 0
    text = capsys.readouterr().out
    assert "weight on 2k+1" in text and "R^2" in text
    assert (tmp_path / "i.json").exists()
    assert "shared value component" in text
    assert len(json.loads((tmp_path / "i.json").read_text())[0]["value_agreement"]) == 2
    # One step-N checkpoint folder is read as well as the run folder.
    (step,) = (run_dir / "checkpoints").iterdir()
    assert inspect_main([str(step), "--sequences", "4"]) == 0
    png = tmp_path / "curves.png"
    assert inspect_main([str(run_dir), "--curves", str(png), "--labels", "width 8"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert inspect_main([str(run_dir), "--curves", str(png), "--labels", "a,b"]) == 2
    assert "2 labels for 1 runs" in capsys.readouterr().err
    assert inspect_main([str(tmp_path / "nowhere")]) == 2
    assert "error" in capsys.readouterr().err


def test_vocab_preset_covers_the_papers_vocabularies():
    preset = PRESETS["vocab"]
    assert preset.vocab_sizes == (10, 1000, 10000) and preset.seq_len >= 32
    specs = plan(preset, "32-true")
    assert len(specs) == 3 * 4 * 3 * 3
    assert {s.config["vocab_size"] for s in specs} == {10, 1000, 10000}
    assert {s.config["model"]["transformer"]["vocab_size"] for s in specs} == {10, 1000, 10000}


@pytest.mark.parametrize("variant", ["rpe", "urpe"])
def test_repeated_tokens_carry_position_only_when_the_row_sum_is_broken(variant, monkeypatch):
    """Su's probe input through an untrained model: rpe gives every position the same state (up
    to float rounding, which the probe must not count), urpe's gate makes position readable."""
    from urpe.experiments.synthetic import inspect as inspect_module

    torch.manual_seed(0)
    config = variant_config(
        variant, TransformerConfig(vocab_size=50, max_len=16, num_layers=2, dim=32, num_heads=4)
    )
    model = EncoderTokenClassifier(config, 16)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "table"):
                module.table.normal_(1.0, 0.5)
        # A value component shared by all tokens: URPE's row sums scale it, so position becomes
        # linearly readable across tokens (trained PI models learn such a component).
        for layer in model.encoder.layers:
            layer.mixer.v_proj.bias.normal_(0.0, 10.0)
    tokens = torch.randint(0, 50, (200, 16))
    repeated = tokens[:, :1].expand_as(tokens).contiguous()
    last = inspect_module.hidden_states(model, repeated)[-1]
    probe = position_probe(last)
    if variant == "rpe":
        assert probe["exact"] < 0.2 and probe["r2"] < 0.1
    else:
        assert probe["exact"] > 0.5


def _agreement_by_hand(model, tokens: torch.Tensor, ridge: float = 1e-6) -> list[float]:
    """m^T (S + ridge tr(S)/d I)^-1 m per head, from the embedding table and W_v, in NumPy."""
    import numpy as np

    encoder, mixer = model.encoder, model.encoder.layers[0].mixer
    with torch.no_grad():
        table = encoder.embed_norm(encoder.embed.weight)  # (V, E): post-LN, no absolute term
        values = table[tokens.flatten()] @ mixer.v_proj.weight.T + mixer.v_proj.bias
    values = values.double().numpy()  # (N, E)
    out = []
    for h in range(mixer.num_heads):
        v = values[:, h * mixer.head_dim : (h + 1) * mixer.head_dim]
        m = v.mean(0)
        s = np.cov(v, rowvar=False, bias=True)
        s = s + ridge * np.trace(s) / len(m) * np.eye(len(m))
        out.append(float(m @ np.linalg.solve(s, m)))
    return out


def test_value_agreement_is_the_shared_value_component():
    torch.manual_seed(0)
    config = variant_config(
        "urpe", TransformerConfig(vocab_size=300, max_len=12, num_layers=2, dim=16, num_heads=2)
    )
    model = EncoderTokenClassifier(config, 5)
    tokens = torch.randint(0, 300, (64, 12))
    expected = _agreement_by_hand(model, tokens)
    assert value_agreement(model, tokens) == pytest.approx(expected, rel=1e-3)
    # Many tokens filling the head share little; a shared value bias is what position rides on.
    assert max(expected) < 10
    with torch.no_grad():
        model.encoder.layers[0].mixer.v_proj.bias.mul_(100)
    assert min(value_agreement(model, tokens)) > 100 * max(expected)


def test_value_agreement_is_huge_when_few_tokens_leave_a_direction_free():
    torch.manual_seed(0)
    config = variant_config(
        "urpe", TransformerConfig(vocab_size=4, max_len=12, num_layers=1, dim=32, num_heads=2)
    )
    model = EncoderTokenClassifier(config, 5)
    # 4 tokens: their centred values span 3 of a head's 16 dimensions.
    assert min(value_agreement(model, torch.randint(0, 4, (64, 12)))) > 1e4


def test_without_the_embedding_norm_all_tokens_start_with_one_shared_value():
    """Issue 12's mechanism: with LayerNorm'd embeddings a large vocabulary's values share
    little at initialisation; without it (urpe-raw-embed) the tokens start small and every
    value is mostly the projection bias, so the row-sum position code starts clean."""
    tokens = torch.randint(0, 1000, (64, 16), generator=torch.Generator().manual_seed(1))
    agreement = {}
    for name in ("urpe", "urpe-raw-embed"):
        torch.manual_seed(0)
        base = TransformerConfig(vocab_size=1000, max_len=16, num_layers=1, dim=32, num_heads=2)
        config = variant_config(name, base)
        model = EncoderTokenClassifier(config, 5)
        assert isinstance(model.encoder.embed_norm, torch.nn.Identity) == (name != "urpe")
        agreement[name] = value_agreement(model, tokens)
    assert max(agreement["urpe"]) < 5 and min(agreement["urpe-raw-embed"]) > 100


def test_a_probe_run_is_measured_on_random_tokens(tiny_run, tmp_path):
    # The probe's own input repeats one token: its values would share everything trivially.
    out = tiny_run(
        "synthetic",
        tasks="probe",
        steps=4,
        dim=8,
        eval_sequences=8,
        vocab_size=50,
        checkpoint_every=None,
    )
    run_dir = next((out / "runs").iterdir())
    assert (
        inspect_main([str(run_dir), "--sequences", "64", "--json", str(tmp_path / "i.json")]) == 0
    )
    (result,) = json.loads((tmp_path / "i.json").read_text())
    assert result["task"] == "probe" and max(result["value_agreement"]) < 100
