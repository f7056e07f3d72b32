"""LanguageModel: cached generation against uncached and full forward passes for every variant,
segment memory at its true positions, memory used and never differentiated."""

import pytest
import torch

from urpe.experiments.lm.variants import DEFAULT_VARIANTS, parse_variant
from urpe.models import TransformerConfig
from urpe.models.lm import IncrementalState, LanguageModel

from .tiny import tiny_config

VOCAB, L = 13, 5


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.py)


VARIANTS = [
    *DEFAULT_VARIANTS,
    "rope+urpe",
    "alibi+urpe",
    "t5+urpe",
    "ape+mem",
    "rpe+urpe+mem",
    "kerple+mem",
    "fire+urpe",
    "shaw+urpe+mem",
    "sinusoidal+urpe+mem",
]


def build(variant: str, memory: int | None = None, norm_first: bool = True) -> LanguageModel:
    """A small float64 model whose gate, bias and every other table hold random values (a gate
    of ones would hide a wrong C)."""
    v = parse_variant(variant)
    base = tiny_config(vocab_size=VOCAB, num_layers=2, norm_first=norm_first, tie_embeddings=False)
    m = (L if v.memory else 0) if memory is None else memory
    model = LanguageModel(v.config(base), L, m).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name or "position" in name or "absolute" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def stream_forward(model: LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    """The training path: consecutive segments of L with memory carried (B, N, V)."""
    memory, out = None, []
    for start in range(0, tokens.shape[1], model.segment_length):
        logits, memory = model(tokens[:, start : start + model.segment_length], memory)
        out.append(logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_uncached_and_the_forward_pass(variant):
    model = build(variant)
    tokens = torch.randint(0, VOCAB, (2, 2 * L + 2))
    cached, uncached = IncrementalState(model, True), IncrementalState(model, False)
    with torch.no_grad():
        # Token by token, and in uneven chunks that cross segment boundaries.
        one = torch.cat([cached.feed(tokens[:, i : i + 1]) for i in range(tokens.shape[1])], 1)
        chunks = [tokens[:, :3], tokens[:, 3:9], tokens[:, 9:]]
        two = torch.cat([uncached.feed(c) for c in chunks], dim=1)
        torch.testing.assert_close(one, two, rtol=1e-10, atol=1e-10)
        # Within the first segment: the plain full forward pass.
        torch.testing.assert_close(one[:, :L], model.decoder(tokens[:, :L]), rtol=1e-10, atol=1e-10)
        if model.memory_length:
            torch.testing.assert_close(one, stream_forward(model, tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_keys_sit_at_their_true_positions(variant):
    # With M = L and two segments, segment 2 attends to exactly the states a causal forward pass
    # over both segments gives segment 1's tokens: the logits must agree with that pass.
    model = build(variant, memory=L)
    tokens = torch.randint(0, VOCAB, (3, 2 * L))
    with torch.no_grad():
        torch.testing.assert_close(
            stream_forward(model, tokens), model.decoder(tokens), rtol=1e-10, atol=1e-10
        )


def test_post_ln_memory_and_cache_agree_too():
    model = build("txl+urpe", norm_first=False)
    tokens = torch.randint(0, VOCAB, (2, 3 * L))
    with torch.no_grad():
        state = IncrementalState(model, True)
        one = torch.cat([state.feed(tokens[:, i : i + 1]) for i in range(tokens.shape[1])], 1)
        torch.testing.assert_close(one, stream_forward(model, tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", ["txl", "txl+urpe", "rope+urpe+mem"])
def test_memory_is_used(variant):
    model = build(variant)
    first, second = torch.randint(0, VOCAB, (2, 2, L))
    other = (first + 1) % VOCAB
    with torch.no_grad():
        _, memory = model(first)
        _, memory_other = model(other)
        with_memory, _ = model(second, memory)
        with_other, _ = model(second, memory_other)
        alone, _ = model(second)
    # The previous segment changes the next segment's predictions...
    assert (with_memory - with_other).abs().max() > 1e-3
    assert (with_memory - alone).abs().max() > 1e-3
    # ...and memory=None at a stream's start equals no memory at all.
    torch.testing.assert_close(model(second, None)[0], alone)


def test_memory_receives_no_gradient():
    model = build("txl+urpe").train()
    first, second = torch.randint(0, VOCAB, (2, 2, L))
    _, memory = model(first)
    assert all(not m.requires_grad and m.grad_fn is None for m in memory)
    embedded = []
    hook = model.decoder.embed.register_forward_hook(lambda mod, inp, out: embedded.append(out))
    _, memory = model(first)
    logits, _ = model(second, memory)
    hook.remove()
    (grad,) = torch.autograd.grad(logits.sum(), embedded[0], allow_unused=True)
    assert grad is None  # segment 1's embeddings get nothing from segment 2's loss
    assert memory[0].shape == (2, L, 16)


def test_memory_is_capped_at_M():
    model = build("txl", memory=3)
    memory = None
    for _ in range(3):
        _, memory = model(torch.randint(0, VOCAB, (2, L)), memory)
        assert [tuple(m.shape) for m in memory] == [(2, 3, 16)] * 2


def test_generate_streams_the_same_tokens_with_and_without_cache():
    model = build("txl+urpe")
    prompt = torch.randint(0, VOCAB, (2, 3))
    runs = []
    for use_cache in (True, False):
        generator = torch.Generator().manual_seed(5)
        tokens = list(
            model.generate(
                prompt, 3 * L, temperature=1.0, top_k=5, generator=generator, use_cache=use_cache
            )
        )
        runs.append(torch.stack(tokens, 1))
    assert runs[0].shape == (2, 3 * L)
    assert torch.equal(runs[0], runs[1])
    greedy = torch.stack(list(model.generate(prompt, 2, temperature=0)), 1)
    full = model.decoder(torch.cat([prompt, greedy[:, :1]], 1))
    assert torch.equal(greedy[:, 1], full[:, -1].argmax(-1))


def test_config_round_trip_and_bad_arguments():
    model = build("rope+urpe+mem")
    again = LanguageModel.from_model_config(model.model_config())
    assert again.model_config() == model.model_config()
    assert model.config.max_len == L + L
    base = TransformerConfig(vocab_size=VOCAB, dim=16, num_heads=2)
    for bad in ({"segment_length": 0}, {"segment_length": 4, "memory_length": -1}):
        with pytest.raises(ValueError):
            LanguageModel(base, **bad)
    for name in ("rpe+urpe+urpe", "bogus", "rpe+gate", ""):
        with pytest.raises(ValueError, match="unknown variant"):
            parse_variant(name)
