"""Sampling on known distributions: greedy, top-k support, the top-p prefix, seeded draws and
empirical frequencies."""

import math

import pytest
import torch

from urpe.models.sampling import (
    generate_tokens,
    next_token_distribution,
    sample,
    top_k_mask,
    top_p_mask,
)

PROBS = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2])  # sorted: 1 (.4), 3 (.25), 4 (.2), 2, 0


def _logits(probs=PROBS):
    return probs.log() + 3.0  # any shift: softmax is invariant


def test_temperature_zero_is_greedy_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 5.0, 5.0]])
    assert sample(logits, temperature=0).tolist() == [1, 0]
    assert sample(logits, temperature=0, top_k=1, top_p=0.1).tolist() == [1, 0]


@pytest.mark.parametrize(
    ("p", "kept"),
    [
        (0.4, {1}),  # the first token alone reaches 0.4 exactly
        (0.41, {1, 3}),
        (0.65, {1, 3}),  # 0.4 + 0.25 = 0.65 exactly: no third token
        (0.66, {1, 3, 4}),
        (0.85, {1, 3, 4}),
        (0.86, {1, 2, 3, 4}),  # 0.85 falls short; with 0.1 more, 0.95 reaches it
        (1.0, {0, 1, 2, 3, 4}),
        (1e-6, {1}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(p, kept):
    distribution = next_token_distribution(_logits(), top_p=p)
    assert set(distribution.nonzero().flatten().tolist()) == kept
    mass = PROBS.double()[sorted(kept)].sum()
    assert torch.allclose(distribution[sorted(kept)], PROBS.double()[sorted(kept)] / mass)


def test_top_p_mask_is_the_smallest_prefix_on_random_distributions():
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        probs = torch.softmax(torch.randn(30, generator=generator, dtype=torch.float64) * 2, 0)
        p = float(torch.rand((), generator=generator, dtype=torch.float64))
        keep = top_p_mask(probs, p)
        kept_mass = probs[keep].sum()
        # Reaches p, and dropping its least probable member would not.
        assert kept_mass >= p - 1e-9
        assert kept_mass - probs[keep].min() < p
        # Every kept token is at least as probable as every dropped one.
        if (~keep).any():
            assert probs[keep].min() >= probs[~keep].max()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 9])
def test_top_k_never_samples_outside_the_k_largest(k):
    logits = torch.randn(64, 20, generator=torch.Generator().manual_seed(k))
    largest = logits.topk(min(k, 20), dim=-1).indices
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        drawn = sample(logits, temperature=2.0, top_k=k, generator=generator)  # flat: hard case
        assert (largest == drawn[:, None]).any(dim=1).all()
    assert top_k_mask(logits, k).sum(dim=-1).eq(min(k, 20)).all()


def test_top_k_keeps_exactly_k_under_ties():
    assert top_k_mask(torch.zeros(1, 6), 2).sum() == 2


def test_a_seed_fixes_the_draw_and_shapes_follow_the_logits():
    logits = torch.randn(3, 4, 50)
    first = sample(logits, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(7))
    again = sample(logits, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(7))
    other = sample(logits, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(8))
    assert first.shape == (3, 4) and first.dtype == torch.long
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert sample(torch.randn(50)).shape == ()


def test_empirical_frequencies_match_the_distribution():
    # temperature 0.5 squares and renormalises the probabilities; top_k=3 keeps ids 1, 3, 4.
    logits = _logits().expand(20000, -1)
    drawn = sample(logits, temperature=0.5, top_k=3, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=5).double() / len(drawn)
    expected = torch.zeros(5, dtype=torch.float64)
    expected[[1, 3, 4]] = PROBS.double()[[1, 3, 4]] ** 2
    expected /= expected.sum()
    assert counts[[0, 2]].sum() == 0
    assert torch.allclose(counts, expected, atol=0.015)  # 4 standard errors at n = 20000


def test_masked_vocabulary_entries_are_never_drawn():
    logits = torch.tensor([-math.inf, 0.0, -math.inf, 0.0]).expand(1000, -1)
    drawn = sample(logits, top_k=3, generator=torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {1, 3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample(torch.randn(5), **kwargs)


def test_bad_logits():
    with pytest.raises(ValueError, match="floating-point"):
        sample(torch.arange(5))
    with pytest.raises(ValueError, match="NaN"):
        sample(torch.tensor([0.0, math.nan]))
    with pytest.raises(ValueError, match="-inf everywhere"):
        sample(torch.full((2, 3), -math.inf))
    with pytest.raises(ValueError, match="greedy"):
        next_token_distribution(torch.randn(4), temperature=0)


class Bigram:
    """A model whose next-token logits depend on the last token only; records what it is fed."""

    def __init__(self, vocab: int = 7, seed: int = 0):
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
        self.fed: list[torch.Tensor] = []

    def __call__(self, new_tokens):
        self.fed.append(new_tokens)
        return self.table[new_tokens[:, -1]]


def test_generate_feeds_the_prompt_then_each_drawn_token():
    model = Bigram()
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    drawn = list(generate_tokens(model, prompt, 5, temperature=0))
    assert len(drawn) == 5 and all(t.shape == (2,) for t in drawn)
    assert torch.equal(model.fed[0], prompt)
    assert all(torch.equal(f, t[:, None]) for f, t in zip(model.fed[1:], drawn, strict=False))
    # Greedy follows the argmax chain from each row's last prompt token.
    last = prompt[:, -1]
    for token in drawn:
        last = model.table[last].argmax(dim=-1)
        assert torch.equal(token, last)


def test_generate_is_reproducible_with_a_seed():
    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        tokens = generate_tokens(Bigram(), torch.tensor([[0]]), 30, top_p=0.9, generator=generator)
        return torch.stack(list(tokens))

    assert torch.equal(run(3), run(3)) and not torch.equal(run(3), run(4))
    assert list(generate_tokens(Bigram(), torch.tensor([[0]]), 0)) == []


def test_generate_rejects_bad_input():
    with pytest.raises(ValueError, match="prompt"):
        next(generate_tokens(Bigram(), torch.tensor([1, 2]), 3))
    with pytest.raises(ValueError, match="at least one token"):
        next(generate_tokens(Bigram(), torch.zeros(1, 0, dtype=torch.long), 3))
    with pytest.raises(ValueError, match="max_new_tokens"):
        next(generate_tokens(Bigram(), torch.tensor([[1]]), -1))
    with pytest.raises(ValueError, match="must return"):
        next(generate_tokens(lambda t: torch.randn(5), torch.tensor([[1]]), 3))
