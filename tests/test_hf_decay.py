"""FoX forget gates through urpe.hf (`add_urpe(decay="fox")`): the attention equals a transcription
of the FoX paper's formula (Lin et al., ICLR 2025, Eq. 4-6: logits_ij + sum_{t=j+1..i} log f_t,
f_t = sigmoid(w . x_t + b)), decoding with any cache equals the full forward, and the decay
saves, loads and packs like the gates."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

import urpe.hf
from tests.hf_families import VOCAB, families
from tests.test_hf_packing import documents, packed_losses, padded_losses

FAMILIES = families()
DECODERS = ["llama", "qwen2"]


def fox_model(name: str, gate="toeplitz", dtype=torch.float64, **options):
    model = urpe.hf.add_urpe(FAMILIES[name].build("sdpa", dtype), gate=gate, decay="fox", **options)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # forget gates far from 1 (and gates from 1): decays that matter
        for n, p in model.named_parameters():
            if "urpe_forget" in n and n.endswith("bias"):
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 3)
            elif "urpe" in n:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model.eval()


def transcribed_decay(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """FoX's D_ij = sum_{t=j+1..i} log f_t for j <= i (0 above the diagonal, masked anyway),
    term by term: x (B, L, dim) -> (B, H, L, L)."""
    log_f = F.logsigmoid(x @ weight.T + bias)  # (B, L, H)
    b, length, heads = log_f.shape
    d = torch.zeros(b, heads, length, length, dtype=x.dtype)
    for i in range(length):
        for j in range(i + 1):
            for t in range(j + 1, i + 1):
                d[:, :, i, j] += log_f[:, t, :]
    return d


@pytest.mark.parametrize("name", DECODERS)
def test_fox_attention_equals_the_transcribed_formula(name):
    """The plain model, whose eager attention gets the transcribed D added to its mask, gives the
    same logits as the model with add_urpe(gate=None, decay="fox")."""
    fox = fox_model(name, gate=None)
    plain = FAMILIES[name].build("eager", torch.float64).eval()
    inputs = {}

    def keep_input(module, args, kwargs):
        inputs[module.layer_idx] = kwargs["hidden_states"] if not args else args[0]

    def transcription(module, query, key, value, attention_mask, **kwargs):
        forget = fox.model.layers[module.layer_idx].self_attn.urpe_forget.proj
        decay = transcribed_decay(inputs[module.layer_idx], forget.weight, forget.bias)
        return eager_attention_forward(module, query, key, value, attention_mask + decay, **kwargs)

    ids = torch.randint(2, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        without_decay = plain(ids).logits
    AttentionInterface.register("fox_transcription", transcription)
    AttentionMaskInterface.register("fox_transcription", eager_mask)
    for layer in plain.model.layers:
        layer.self_attn.register_forward_pre_hook(keep_input, with_kwargs=True)
    plain.set_attn_implementation("fox_transcription")
    with torch.no_grad():
        want = plain(ids).logits
        got = fox(ids).logits
    torch.testing.assert_close(got, want)
    assert (got - without_decay).abs().max() > 1e-2  # the decay matters at these gates


def _step_logits(model, ids: torch.Tensor, cache, chunks=(5, 1, 2, 1, 1)) -> torch.Tensor:
    """Logits of `ids` fed in chunks through `cache` (prefill, then one or a few at a time)."""
    out, start = [], 0
    for n in chunks:
        piece = ids[:, start : start + n]
        positions = torch.arange(start, start + n)
        out.append(
            model(piece, past_key_values=cache, use_cache=True, cache_position=positions).logits
        )
        start += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", DECODERS)
def test_cached_decoding_equals_the_full_forward(name, cache):
    model = fox_model(name)
    ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        store = (
            DynamicCache(config=model.config)
            if cache == "dynamic"
            else StaticCache(config=model.config, max_cache_len=16)
        )
        stepped = _step_logits(model, ids, store)
    torch.testing.assert_close(stepped, full)


@pytest.mark.parametrize("name", DECODERS)
def test_generate_with_a_cache_equals_generate_without(name):
    """Greedy, static-cache and beam-search generation (beam search reorders the cache, and the
    kept forget gates with it) give what recomputing every step without a cache gives."""
    model = fox_model(name)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    common = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False, pad_token_id=0
    )
    for extra in ({}, {"cache_implementation": "static"}, {"num_beams": 3}):
        cached = model.generate(ids, **common, **extra)
        uncached = model.generate(ids, **common, **extra, use_cache=False)
        assert torch.equal(cached, uncached), extra


def test_left_padding_leaves_each_prompt_as_it_is_alone():
    model = fox_model("llama")
    prompts = [torch.tensor([5, 9, 14, 3, 22]), torch.tensor([7, 30, 2])]
    alone = [
        model.generate(p[None], max_new_tokens=5, do_sample=False, pad_token_id=0)[0, len(p) :]
        for p in prompts
    ]
    ids = torch.stack([F.pad(p, (5 - len(p), 0)) for p in prompts])
    mask = torch.stack([torch.arange(5) >= 5 - len(p) for p in prompts]).long()
    batch = model.generate(
        ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    for row, want in zip(batch[:, 5:], alone, strict=True):
        assert torch.equal(row, want)


def test_a_deep_copied_prompt_cache_is_a_cache_of_its_own():
    """transformers' prompt reuse: fill a cache with a shared prefix once, then copy.deepcopy it
    per continuation. Cropping a copy leaves the original as it was, and beam search from a copy
    (repeated for the beams, then reordered at every step) gives the beams of generation without
    a cache."""
    model = fox_model("llama")
    ids = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    prefix = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :5], past_key_values=prefix, use_cache=True)
    common = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, num_beams=3)
    for length in (7, 9):  # two continuations of the same prefix
        prompt = ids[:, :length]
        beams = copy.deepcopy(prefix)
        beams.batch_repeat_interleave(3)
        reused = model.generate(prompt, past_key_values=beams, **common)
        assert torch.equal(reused, model.generate(prompt, use_cache=False, **common)), length
    cropped = copy.deepcopy(prefix)
    cropped.crop(-2)
    assert prefix.get_seq_length() == 5 and cropped.get_seq_length() == 3


def test_a_cache_filled_without_the_decay_is_refused():
    model = fox_model("llama")
    cache = DynamicCache(config=model.config)
    ids = torch.randint(2, VOCAB, (1, 4))
    plain = FAMILIES["llama"].build("sdpa", torch.float64)
    with torch.no_grad():
        plain(ids, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="forget gates urpe never saw"):
            model(ids, past_key_values=cache, use_cache=True)


def test_saved_decays_load_back_with_the_same_outputs(tmp_path):
    model = fox_model("llama")
    model.save_pretrained(tmp_path)
    loaded = urpe.hf.from_pretrained(tmp_path, type(model), dtype=torch.float64).eval()
    assert loaded.config.urpe["decay"] == {"name": "fox", "init_bias": 10.0}
    ids = torch.randint(2, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", DECODERS)
def test_packed_documents_match_padded_losses_with_a_decay(name):
    model = fox_model(name).train()
    docs = documents()
    torch.testing.assert_close(packed_losses(model, docs), padded_losses(model, docs))


def test_gradients_reach_the_forget_gates_and_the_init_is_near_the_base_model():
    model = urpe.hf.add_urpe(FAMILIES["llama"].build("sdpa", torch.float64), decay="fox")
    base = FAMILIES["llama"].build("sdpa", torch.float64)
    ids = torch.randint(2, VOCAB, (2, 12))
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "urpe_forget" in n]
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads)
    # f = sigmoid(10) at init: within 1e-3 of the model without the decay, yet not equal
    with torch.no_grad():
        diff = (model(ids).logits - base(ids).logits).abs().max()
    assert 0 < diff < 1e-3


def test_a_model_deep_copies_after_a_training_step():
    """Nothing with autograd history stays on the modules after a forward with gradients."""
    model = fox_model("llama").train()
    ids = torch.randint(2, VOCAB, (2, 8))
    model(ids, labels=ids).loss.backward()
    copied = copy.deepcopy(model).eval()
    with torch.no_grad():
        torch.testing.assert_close(copied(ids).logits, model.eval()(ids).logits)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(gate=None), "add nothing"),
        (dict(decay="alibi"), "computed from the layer's input"),
        (dict(decay="nope"), r"add_urpe decay must be one of \('fox',\), got 'nope'"),
        (dict(decay={"name": "fox", "slope": 1}), "has no option 'slope'"),
    ],
)
def test_bad_decay_options_are_refused_in_one_line(options, message):
    model = FAMILIES["llama"].build("sdpa", torch.float64)
    with pytest.raises(ValueError, match=message):
        urpe.hf.add_urpe(model, **options)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in DECODERS])
def test_every_supported_family_takes_a_decay(name):
    """GPT-2, Mistral, BART, T5 (T5's own bias joins the decay), GPT-NeoX and GPTBigCode give
    the same beams with and without a cache (greedy decoding with dynamic and static caches:
    test_hf.py); the encoders (BERT, RoBERTa: the decay mirrored for keys after the query) run;
    every family runs in bfloat16 too."""
    family = FAMILIES[name]
    model = fox_model(name)
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        if family.causal or family.seq2seq:
            prompt = ids if family.seq2seq else ids[:, :4]
            common = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
            cached = model.generate(prompt, **common, num_beams=2)
            assert torch.equal(
                cached, model.generate(prompt, **common, num_beams=2, use_cache=False)
            )
        else:
            hidden = model(ids).last_hidden_state
            assert hidden.isfinite().all()
            ungated = family.build("sdpa", torch.float64).eval()
            assert not torch.allclose(hidden, ungated(ids).last_hidden_state, atol=1e-3)
        low = urpe.hf.add_urpe(family.build("sdpa", torch.bfloat16), decay="fox")
        inputs = dict(decoder_input_ids=ids) if family.seq2seq else {}
        out = low(input_ids=ids, **inputs)
        first = out.logits if hasattr(out, "logits") else out.last_hidden_state
        assert first.dtype == torch.bfloat16 and first.isfinite().all()


@pytest.mark.slow
def test_compiled_static_cache_generation_equals_eager():
    """transformers' fast path: a static cache and a compiled forward (the forget-gate buffer is
    written in place beside the cache's own)."""
    model = fox_model("llama", dtype=torch.float32)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))
    common = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    eager = model.generate(ids, **common)
    model.forward = torch.compile(model.forward)
    assert torch.equal(model.generate(ids, **common), eager)


def test_sliding_window_caches_past_the_window_equal_recomputing():
    """Mistral with a 4-token window: a dynamic and a static sliding-window cache (not yet full,
    filling, then rolling its slots), prompts of 2 and 7 tokens, give what recomputing every
    step gives."""
    family = FAMILIES["mistral"]
    config = family.config.__class__(**{**family.config.to_dict(), "sliding_window": 4})
    family = type(family)(**{**family.__dict__, "config": config})
    model = urpe.hf.add_urpe(family.build("sdpa", torch.float64), decay="fox")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "urpe_forget" in n and n.endswith("bias"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(9)) * 3)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(9))
    common = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for length in (7, 2):
            for extra in ({}, {"cache_implementation": "static"}):
                prompt = ids[:, :length]
                cached = model.eval().generate(prompt, **common, **extra)
                uncached = model.generate(prompt, **common, **extra, use_cache=False)
                assert torch.equal(cached, uncached), (length, extra)


def test_a_gate_whose_decay_was_removed_keeps_the_static_cache_positions():
    """One pre-hook records the call's layout and its forget gates: where a wrapper removed a
    module's urpe_forget, the gate alone runs, still at the static cache's positions."""
    model = fox_model("llama")
    for module in model.modules():
        if "urpe_forget" in module._modules:
            del module.urpe_forget
    ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids).logits
        stepped = _step_logits(model, ids, StaticCache(config=model.config, max_cache_len=16))
    torch.testing.assert_close(stepped, full)
