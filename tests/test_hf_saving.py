"""Saving and loading models with URPE gates, and training gates beside LoRA adapters (PEFT)."""

from __future__ import annotations

import ast
import copy
import json
import logging
import re
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors import safe_open

import urpe.hf
from tests.hf_families import families, inputs, outputs

FAMILIES = families()
AUTO = {
    "llama": "AutoModelForCausalLM",
    "gpt2": "AutoModelForCausalLM",
    "t5": "AutoModelForSeq2SeqLM",
}


def perturbed(name: str, **options):
    family = FAMILIES[name]
    model = urpe.hf.add_urpe(family.build("sdpa", torch.float64), **options).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in urpe.hf.gate_parameters(model):
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return family, model


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama", {}),
        ("gpt2", {"layers": [1], "gate": {"name": "t5", "num_buckets": 8}}),
        ("t5", {"shared": True}),
    ],
)
def test_save_pretrained_and_from_pretrained_round_trip(tmp_path, caplog, name, options):
    family, model = perturbed(name, **options)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        saved = sorted(k for k in handle.keys() if "urpe" in k)
    gates = sorted(n for n, _ in model.named_parameters() if "urpe" in n)
    assert saved == gates
    assert json.loads((tmp_path / "config.json").read_text())["urpe"] == model.config.urpe

    auto = getattr(transformers, AUTO[name])
    with caplog.at_level(logging.WARNING):
        loaded = urpe.hf.from_pretrained(tmp_path, auto, dtype=torch.float64).eval()
    assert "urpe" not in caplog.text  # the gate keys are not reported as unexpected
    assert loaded.config._attn_implementation == "urpe_sdpa"
    assert loaded.config.urpe == model.config.urpe
    for (n, p), (m, q) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n
    feed, real = inputs(family)
    error = (outputs(family, model, feed) - outputs(family, loaded, feed))[real].abs().max().item()
    assert error <= 1e-12, error


@pytest.mark.parametrize("decay", [None, "fox"])
def test_a_family_saved_under_its_original_checkpoint_names_loads_its_gates(tmp_path, decay):
    # transformers runs EXAONE as a Llama but saves it under EXAONE's own names
    # (transformer.h.N.attn.attention), the gates with them; loading renames them back.
    config = transformers.AutoConfig.for_model(
        "exaone", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = urpe.hf.add_urpe(model.double(), decay=decay).eval()
    with torch.no_grad():
        for p in urpe.hf.gate_parameters(model):
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert any(k.startswith("transformer.h.") and "urpe_" in k for k in handle.keys())
    loaded = urpe.hf.from_pretrained(
        tmp_path, transformers.AutoModelForCausalLM, dtype=torch.float64
    ).eval()
    for (n, p), (m, q) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n


def test_from_pretrained_refuses_a_folder_without_urpe(tmp_path):
    FAMILIES["llama"].build("sdpa", torch.float32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no 'urpe' entry"):
        urpe.hf.from_pretrained(tmp_path, transformers.AutoModelForCausalLM)


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "huggingface.md"


def guide_modules_to_save() -> list[str]:
    """The modules_to_save list of the Hugging Face guide's PEFT example."""
    found = re.search(r"modules_to_save=(\[[^\]]*\])", GUIDE.read_text())
    assert found, "the guide's PEFT example names no modules_to_save"
    return ast.literal_eval(found.group(1))


@pytest.mark.parametrize("decay", [None, "fox"])
def test_lora_and_gates_train_together_and_save(tmp_path, decay):
    """With the guide's modules_to_save, every URPE parameter (gates C, FoX forget gates) trains
    beside the LoRA adapters, is saved with them and reloads to the same outputs."""
    family, model = perturbed("llama", decay=decay)
    model = model.float().train()
    initial = [p.detach().clone() for p in urpe.hf.gate_parameters(model)]
    assert set(guide_modules_to_save()) == set(urpe.hf.MODULE_NAMES)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=guide_modules_to_save(),
    )
    tuned = peft.get_peft_model(model, lora)
    trainable = {n for n, p in tuned.named_parameters() if p.requires_grad}
    urpe_names = {n for n in trainable if "urpe" in n}
    assert len(urpe_names) == len(initial) and any("lora_" in n for n in trainable)
    assert all("lora_" in n or "urpe" in n for n in trainable)

    before = {n: p.detach().clone() for n, p in tuned.named_parameters()}
    optimizer = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(2, 61, (2, 12))
    loss = tuned(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    changed = {n for n, p in tuned.named_parameters() if not torch.equal(p, before[n])}
    assert urpe_names <= changed  # the gates (and forget gates) train ...
    assert changed <= trainable  # ... and nothing frozen moved
    tuned.eval()
    expected = tuned(input_ids=ids).logits

    tuned.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as handle:
        assert sum("urpe" in k for k in handle.keys()) == len(initial)
    # Reload: the same base weights, gates added with the same options, then the adapter.
    base = urpe.hf.add_urpe(family.build("sdpa", torch.float64), decay=decay).float()
    with torch.no_grad():  # the perturbed gates were part of the base before LoRA was added
        for p, q in zip(urpe.hf.gate_parameters(base), initial, strict=True):
            p.copy_(q)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    assert torch.allclose(reloaded(input_ids=ids).logits, expected, atol=1e-6)
    merged = reloaded.merge_and_unload()
    assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-5)
    assert len(urpe.hf.gate_parameters(merged)) == len(initial)


def test_add_urpe_after_peft_is_refused_with_the_order_that_works():
    """Gates added to a model PEFT already wraps would train and then be left out of
    PeftModel.save_pretrained: refused, naming the order and modules_to_save."""
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    tuned = peft.get_peft_model(FAMILIES["llama"].build("sdpa", torch.float32), lora)
    for model in (tuned, tuned.base_model.model):  # the PeftModel, and the model inside it
        with pytest.raises(ValueError, match="add_urpe on the base model first") as caught:
            urpe.hf.add_urpe(model, decay="fox")
        assert "urpe_forget" in str(caught.value)
    assert not urpe.hf.gate_parameters(tuned)


def test_gates_follow_dtype_changes_and_deepcopy():
    _, model = perturbed("llama")
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert {p.dtype for p in urpe.hf.gate_parameters(half)} == {torch.bfloat16}
    ids = torch.randint(2, 61, (1, 5))
    assert half(input_ids=ids).logits.dtype == torch.bfloat16
