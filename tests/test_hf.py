"""urpe.hf on tiny Llama (GQA), Qwen2 (GQA), GPT-2, BERT, RoBERTa, Mistral, BART and T5 models
built from configs: identity at init against the same attn_implementation, gradients, a perturbed
gate checked against a hand-written softmax(.) * C, cached generation, and the refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

import urpe.hf
from tests.hf_families import VOCAB, families, inputs, outputs
from urpe.hf import attention as hf_attention

FAMILIES = families()
NAMES = list(FAMILIES)
IMPLEMENTATIONS = ["eager", "sdpa"]


def tolerance(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-5


def pair(name: str, implementation: str, **options):
    """(baseline, the same weights with URPE gates) in the family's comparison dtype."""
    family = FAMILIES[name]
    base = family.build(implementation, family.dtype(implementation))
    gated = urpe.hf.add_urpe(copy.deepcopy(base), **options)
    return family, base, gated


def perturb(model, scale: float = 0.3) -> None:
    """Gates away from 1 and forget gates (FoX, if any) far from 1: a wrong offset or a wrong
    decay would change the outputs."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "urpe_forget" in n and n.endswith("bias"):
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 3)
            elif "urpe" in n:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", NAMES)
def test_identity_at_init(name, implementation, mode):
    family, base, gated = pair(name, implementation)
    assert gated.config._attn_implementation == f"urpe_{implementation}"
    getattr(base, mode)()
    getattr(gated, mode)()
    feed, real = inputs(family)
    expected, got = outputs(family, base, feed), outputs(family, gated, feed)
    error = (expected - got)[real].abs().max().item()
    assert error <= tolerance(expected.dtype), error


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_every_gate_and_match_the_baseline(name):
    family, base, gated = pair(name, "sdpa")
    base.train()
    gated.train()
    feed, real = inputs(family)
    weights = torch.randn(outputs(family, base, feed).shape, dtype=torch.float64)
    for model in (base, gated):
        ((outputs(family, model, feed) * weights)[real]).sum().backward()
    gates = {n: p for n, p in gated.named_parameters() if "urpe" in n}
    assert gates
    for n, p in gates.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n
    # With C = 1 every weight of the model gets the baseline's gradient (T5: its bias table too).
    base_grads = dict(base.named_parameters())
    for n, p in gated.named_parameters():
        if n in gates or p.grad is None:
            continue
        assert torch.allclose(p.grad, base_grads[n].grad, rtol=1e-9, atol=1e-10), n
    if name == "t5":
        table = gated.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        assert table.grad.abs().sum() > 0


def _capture_first_gated_call(model, run):
    """Run `run()`; return the first gated attention call (module, q, k, v, mask, kwargs, out)."""
    calls = []
    original = hf_attention.urpe_attention_forward

    def spy(base, module, query, key, value, mask, **kwargs):
        out = original(base, module, query, key, value, mask, **kwargs)
        if hf_attention.gate_of(module) is not None and not calls:
            calls.append((module, query, key, value, mask, kwargs, out[0]))
        return out

    hf_attention.urpe_attention_forward = spy
    try:
        run()
    finally:
        hf_attention.urpe_attention_forward = original
    return calls[0]


def handwritten(module, q, k, v, mask, kwargs) -> torch.Tensor:
    """softmax(scaling q k^T + position_bias + mask) * C, then @ v, for one call (no cache)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    lq, lk = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) * kwargs["scaling"]
    if kwargs.get("position_bias") is not None:
        scores = scores + kwargs["position_bias"]
    if mask is None:
        if kwargs.get("is_causal", module.is_causal) and lq > 1:
            keep = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            scores = scores.masked_fill(~keep, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    table = hf_attention.gate_of(module).table  # (H, 2K+1)
    reach = (table.shape[1] - 1) // 2
    offsets = torch.arange(lk)[None, :] - torch.arange(lk - lq, lk)[:, None]  # key - query
    gate = table[:, offsets.clamp(-reach, reach) + reach]  # (H, Lq, Lk)
    return ((weights * gate) @ v).transpose(1, 2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", NAMES)
def test_perturbed_gate_changes_outputs_and_matches_handwritten(name, implementation):
    family, base, gated = pair(name, implementation)
    base.eval()
    gated.eval()
    perturb(gated)
    feed, real = inputs(family)
    expected = outputs(family, base, feed)
    got = []
    module, q, k, v, mask, kwargs, out = _capture_first_gated_call(
        gated, lambda: got.append(outputs(family, gated, feed))
    )
    assert (expected - got[0])[real].abs().max() > 1e-3
    reference = handwritten(module, q, k, v, mask, kwargs)
    if family.causal:  # rows of left-padded queries see no key: compare real queries only
        real_q = feed["attention_mask"].bool()
        reference, out = reference[real_q], out[real_q]
    error = (reference - out).abs().max().item()
    assert error <= tolerance(q.dtype), error


def generate_both(model, feed, **kwargs):
    common = dict(
        max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    with_cache = model.generate(**feed, **common, **kwargs)
    kwargs.pop("cache_implementation", None)
    without = model.generate(**feed, **common, **kwargs, use_cache=False)
    return with_cache, without


def score_error(first, second) -> float:
    pairs = zip(first.scores, second.scores, strict=True)
    return max((a - b).abs().max().item() for a, b in pairs)


GENERATING = [n for n, f in FAMILIES.items() if f.causal or f.seq2seq]


def _generate_cached_and_uncached(gated, feed, cache: str):
    gated.eval()
    perturb(gated)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    with_cache, without = generate_both(gated, feed, pad_token_id=0, **extra)
    assert torch.equal(with_cache.sequences, without.sequences)
    error = score_error(with_cache, without)
    assert error <= 1e-9, error


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("decay", [None, "fox"])
@pytest.mark.parametrize("name", GENERATING)
def test_cached_generate_equals_uncached_in_every_family(name, decay, cache):
    """Greedy generation with a KV cache gives the scores generation without one gives, in every
    family, with a gate and with FoX forget gates too, however the family passes the cache to
    its attention (GPT-NeoX and GPTBigCode: layer_past=); prompts with padding."""
    family, _, gated = pair(name, "sdpa", decay=decay)
    feed, _ = inputs(family)
    feed = {k: v for k, v in feed.items() if k != "decoder_input_ids"}
    _generate_cached_and_uncached(gated, feed, cache)


# Unpadded prompts: an empty static cache's prefill runs without a mask (the causal flag).
@pytest.mark.parametrize(("name", "cache"), [("llama", "static"), ("gpt2", "dynamic")])
def test_cached_generate_equals_uncached_without_padding(name, cache):
    family, _, gated = pair(name, "sdpa")
    feed, _ = inputs(family)
    _generate_cached_and_uncached(gated, {"input_ids": feed["input_ids"][1:]}, cache)


@pytest.mark.parametrize(("name", "cache"), [("llama", "static"), ("llama", "dynamic")])
@pytest.mark.parametrize("decay", [None, "fox"])
def test_cached_generate_past_the_gates_reach_equals_uncached(name, cache, decay):
    """A gate that reaches K = 2 offsets: every decoding step's keys run past it, so the C++
    forward reads the table in place with its columns clamped (`Term::clamped_row`), while
    generation without a cache gets its rows built; the scores are the same."""
    family, _, gated = pair(name, "sdpa", decay=decay, max_distance=2)
    feed, _ = inputs(family)
    _generate_cached_and_uncached(gated, feed, cache)


def test_sliding_window_is_honoured_and_cached_generate_matches():
    t = transformers
    config = t.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
    )
    torch.manual_seed(0)
    base = t.Qwen2ForCausalLM(config)
    base.set_attn_implementation("sdpa")
    base = base.double().eval()
    gated = urpe.hf.add_urpe(copy.deepcopy(base)).eval()
    ids = torch.randint(2, VOCAB, (2, 10))
    assert (base(ids).logits - gated(ids).logits).abs().max() <= 1e-10
    perturb(gated)
    with_cache, without = generate_both(gated, {"input_ids": ids}, pad_token_id=0)
    assert torch.equal(with_cache.sequences, without.sequences)
    assert score_error(with_cache, without) <= 1e-9


def test_options_shared_buckets_layers():
    _, _, gated = pair("llama", "sdpa", shared=True, gate={"name": "t5", "num_buckets": 8})
    names = [n for n, _ in gated.named_parameters() if "urpe" in n]
    assert names == ["urpe_gate.table"] and gated.urpe_gate.table.shape == (4, 8)
    # The door's default reach of the buckets (the context) is recorded with the spec.
    t5 = {"name": "t5", "num_buckets": 8, "bucket_max_distance": 64}
    assert gated.config.urpe["gate"] == t5 and gated.urpe_gate.bucket_max_distance == 64
    family, base, gated = pair("gpt2", "sdpa", layers=[1], max_distance=5)
    names = [n for n, _ in gated.named_parameters() if "urpe" in n]
    assert names == ["transformer.h.1.attn.urpe_gate.table"]
    assert gated.config.urpe["layers"] == [1] and gated.config.urpe["max_distance"] == 5
    perturb(gated)
    feed, real = inputs(family)
    assert (outputs(family, base, feed) - outputs(family, gated, feed))[real].abs().max() > 1e-3


def test_default_reach_follows_the_context_length():
    _, _, gpt2 = pair("gpt2", "sdpa")
    assert gpt2.config.urpe["max_distance"] == 63  # n_positions 64
    _, _, t5 = pair("t5", "sdpa")
    assert t5.config.urpe["max_distance"] == 16  # T5: relative_attention_max_distance
    config = transformers.GPT2Config(n_positions=4096)
    assert urpe.hf.default_max_distance(config) == 1024


def test_t5_gates_self_attention_only_and_refuses_cross_attention():
    _, _, gated = pair("t5", "sdpa")
    gated_names = [n for n, _ in gated.named_modules() if n.endswith("urpe_gate")]
    assert len(gated_names) == 4  # 2 encoder + 2 decoder self-attention modules
    assert not any("EncDecAttention" in n for n in gated_names)
    base = FAMILIES["t5"].build("sdpa", torch.float32)
    with pytest.raises(ValueError, match="cross-attention module of T5ForConditionalGeneration"):
        urpe.hf.add_urpe(base, layers=["decoder.block.0.layer.1.EncDecAttention"])


def test_unsupported_model_raises_one_error_naming_the_class():
    config = transformers.DebertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
    )
    model = transformers.DebertaModel(config)
    with pytest.raises(urpe.hf.UnsupportedModelError, match="DebertaModel"):
        urpe.hf.add_urpe(model)


def test_a_config_shared_with_another_model_stays_as_it_was(tmp_path):
    """Two models built from one config object: add_urpe on one leaves the other (and the
    config) as they were; every module of the gated one reads its own copy."""
    config = copy.deepcopy(FAMILIES["llama"].config)
    config._attn_implementation = "sdpa"
    gated, baseline = transformers.LlamaForCausalLM(config), transformers.LlamaForCausalLM(config)
    urpe.hf.add_urpe(gated)
    for model in (baseline, None):
        seen = config if model is None else model.config
        assert not hasattr(seen, "urpe") and seen._attn_implementation == "sdpa"
    assert gated.model.layers[0].self_attn.config is gated.config is not config
    assert gated.config._attn_implementation == "urpe_sdpa"
    baseline.save_pretrained(tmp_path)
    assert "urpe" not in json.loads((tmp_path / "config.json").read_text())
    urpe.hf.add_urpe(baseline)  # not "already has URPE gates"


def test_refusals():
    base = FAMILIES["llama"].build("sdpa", torch.float32)
    gated = urpe.hf.add_urpe(base)
    with pytest.raises(ValueError, match="already has URPE gates"):
        urpe.hf.add_urpe(gated)
    other = FAMILIES["llama"].build("sdpa", torch.float32)
    other.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        urpe.hf.add_urpe(other)
    with pytest.raises(ValueError, match="out of range"):
        urpe.hf.add_urpe(FAMILIES["llama"].build("sdpa", torch.float32), layers=[5])
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        urpe.hf.add_urpe(
            FAMILIES["llama"].build("sdpa", torch.float32), max_distance=4, num_buckets=8
        )
