"""What keeps a gated transformers model honest: attention variants urpe does not compute are
refused by `add_urpe` itself (not at the first forward), `set_attn_implementation` after
`add_urpe` keeps the gates in force (or refuses), and a saved folder says how to load it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

import urpe.hf
from tests.hf_families import VOCAB, families, inputs, outputs

FAMILIES = families()
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def perturb(model, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in urpe.hf.gate_parameters(model):
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def gemma2(softcapping: float | None):
    config = transformers.Gemma2Config(
        **TINY, max_position_embeddings=64, attn_logit_softcapping=softcapping
    )
    model = transformers.Gemma2ForCausalLM(config)
    model.set_attn_implementation("eager")  # Gemma 2 has no sdpa path
    return model


def gpt_oss():
    config = transformers.GptOssConfig(**TINY, num_local_experts=2, num_experts_per_tok=1)
    model = transformers.GptOssForCausalLM(config)
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize(
    ("build", "feature", "name"),
    [
        (lambda: gemma2(50.0), "logit soft-capping", "Gemma2ForCausalLM"),
        (gpt_oss, "attention sinks", "GptOssForCausalLM"),
    ],
)
def test_attention_variants_urpe_does_not_compute_are_refused_by_add_urpe(build, feature, name):
    model = build()
    with pytest.raises(urpe.hf.UnsupportedModelError) as caught:
        urpe.hf.add_urpe(model)
    message = str(caught.value)
    assert feature in message and name in message and "\n" not in message
    assert not urpe.hf.gate_parameters(model)  # refused before anything was attached
    assert model.config._attn_implementation == "eager" and not hasattr(model.config, "urpe")


def test_gemma2_without_soft_capping_is_gated():
    model = gemma2(None).double().eval()
    ids = torch.randint(2, VOCAB, (2, 7))
    expected = model(ids).logits
    gated = urpe.hf.add_urpe(copy.deepcopy(model)).eval()
    assert (gated(ids).logits - expected).abs().max() <= 1e-6  # its eager softmax: float32


SWITCHES = [("eager", "sdpa"), ("sdpa", "eager")]


@pytest.mark.parametrize(("first", "then"), SWITCHES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_set_attn_implementation_after_add_urpe_keeps_the_gates(name, first, then):
    family = FAMILIES[name]
    dtype = family.dtype("eager")  # comparable under both implementations
    gated = urpe.hf.add_urpe(family.build(first, dtype))
    perturb(gated)
    plain = family.build(then, dtype).eval()
    feed, real = inputs(family)
    before = outputs(family, gated.eval(), feed)
    gated.set_attn_implementation(then)
    assert gated.config._attn_implementation == f"urpe_{then}"
    assert gated.config.urpe["attn_implementation"] == then  # saved and reloaded as such
    for module in gated.modules():  # T5's stacks carry copies of the config
        own = getattr(getattr(module, "config", None), "_attn_implementation", None)
        assert own is None or own.startswith("urpe_"), (type(module).__name__, own)
    after = outputs(family, gated, feed)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    assert (after - before)[real].abs().max() <= tolerance
    assert (after - outputs(family, plain, feed))[real].abs().max() > 1e-3  # the gates still act
    gated.train()
    outputs(family, gated, feed)[real].square().sum().backward()
    for parameter in urpe.hf.gate_parameters(gated):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


@pytest.mark.parametrize("request_", ["flex_attention", {"": "flash_attention_2"}])
def test_set_attn_implementation_refuses_what_urpe_cannot_run(request_):
    gated = urpe.hf.add_urpe(FAMILIES["llama"].build("sdpa", torch.float32))
    with pytest.raises(ValueError, match="URPE gates, which run on 'eager' or 'sdpa'") as caught:
        gated.set_attn_implementation(request_)
    assert "LlamaForCausalLM" in str(caught.value) and "\n" not in str(caught.value)
    assert gated.config._attn_implementation == "urpe_sdpa"  # nothing changed


def test_set_attn_implementation_survives_deepcopy_and_reloading(tmp_path):
    gated = urpe.hf.add_urpe(FAMILIES["gpt2"].build("sdpa", torch.float64))
    copied = copy.deepcopy(gated)
    copied.set_attn_implementation("eager")
    assert copied.config._attn_implementation == "urpe_eager"
    assert gated.config._attn_implementation == "urpe_sdpa"  # the copy's switch is its own
    gated.save_pretrained(tmp_path)
    loaded = urpe.hf.from_pretrained(tmp_path, transformers.AutoModelForCausalLM)
    loaded.set_attn_implementation("eager")
    assert loaded.config._attn_implementation == "urpe_eager"


def test_a_saved_folder_says_how_to_load_it(tmp_path):
    gated = urpe.hf.add_urpe(FAMILIES["llama"].build("sdpa", torch.float32))
    gated.save_pretrained(tmp_path)
    entry = json.loads((tmp_path / "config.json").read_text())["urpe"]
    assert "urpe.hf.from_pretrained" in entry["load"]
    assert "without" in entry["load"] and "LlamaForCausalLM" in entry["load"]
    card = (tmp_path / "README.md").read_text()
    assert "urpe.hf.from_pretrained" in card and "without" in card and "urpe_gate" in card
    loaded = urpe.hf.from_pretrained(tmp_path, transformers.AutoModelForCausalLM)
    assert loaded.config.urpe == gated.config.urpe
    # A card of the user's own is left as it is.
    (tmp_path / "README.md").write_text("my card\n")
    gated.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my card\n"


def test_from_pretrained_refuses_an_implementation_that_bypasses_the_gates(tmp_path):
    urpe.hf.add_urpe(FAMILIES["llama"].build("sdpa", torch.float32)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="URPE gates, which run on 'eager' or 'sdpa'"):
        urpe.hf.from_pretrained(
            tmp_path, transformers.AutoModelForCausalLM, attn_implementation="flex_attention"
        )
