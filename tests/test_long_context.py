"""The long-context tasks (urpe.tasks.long_context) and their scoring: every generator gives
exactly the length asked for, the same sample for the same seed, the answer once in the context
and the needle at the stated depth; a model that reads the answer off the context scores 1.0
and one that answers at random scores chance."""

from __future__ import annotations

import math

import pytest
import torch

from urpe.tasks.long_context import (
    DIGITS,
    KEYS,
    TASK_WORDS,
    TASKS,
    VALUES,
    AssociativeRecall,
    Copy,
    MultiKeyNeedle,
    Needle,
    Passkey,
    Pieces,
    TooShort,
    VariableTracking,
)

IDS = {word: i for i, word in enumerate(TASK_WORDS)}
PIECES = Pieces(lambda text: [IDS[w] for w in text.split()])
LENGTHS = (64, 100, 257)


def words(tokens: torch.Tensor) -> list[str]:
    return [TASK_WORDS[i] for i in tokens.tolist()]


def occurrences(haystack: list, needle: list) -> list[int]:
    """Where `needle` starts as a contiguous run inside `haystack`."""
    n = len(needle)
    return [i for i in range(len(haystack) - n + 1) if haystack[i : i + n] == needle]


def draw(task, length: int, seed: int = 0, depth: float | None = None):
    return task.sample(PIECES, length, torch.Generator().manual_seed(seed), depth)


@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("length", LENGTHS)
def test_every_task_has_the_exact_length_and_answers_inside_it(name, length):
    sample = draw(TASKS[name], length, seed=length)
    assert sample.tokens.shape == (length,) and sample.tokens.dtype == torch.long
    assert sample.answers, "every sample scores something"
    for start, end in sample.answers:
        assert 1 <= start < end <= length
    targets = sample.targets()
    scored = [p for start, end in sample.answers for p in range(start - 1, end - 1)]
    assert (targets[scored] == sample.tokens[[p + 1 for p in scored]]).all()
    assert int((targets != -100).sum()) == len(scored)


@pytest.mark.parametrize("name", list(TASKS))
def test_the_same_seed_gives_the_same_sample_and_another_seed_another(name):
    task = TASKS[name]
    depth = 0.3 if task.uses_depth else None
    first, again = draw(task, 128, 7, depth), draw(task, 128, 7, depth)
    assert torch.equal(first.tokens, again.tokens) and first.answers == again.answers
    assert not torch.equal(first.tokens, draw(task, 128, 8, depth).tokens)


def _context_and_answer(sample) -> tuple[list[str], list[str]]:
    (start, end), *_ = sample.answers
    tokens = words(sample.tokens)
    return tokens[:start], tokens[start:end]


@pytest.mark.parametrize("task", [Passkey(), Needle(), MultiKeyNeedle()], ids=lambda t: t.name)
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_a_needle_stands_once_at_its_depth(task, depth):
    for seed in range(5):
        sample = draw(task, 160, seed, depth)
        context, answer = _context_and_answer(sample)
        assert len(answer) == task.digits and all(w in DIGITS for w in answer)
        assert len(occurrences(context, answer)) == 1  # the value: in its needle, nowhere else
        (where,) = occurrences(context, answer)
        start = sample.needles[0]
        needle = context[start:]
        if task.name == "passkey":
            assert needle[: 4 + len(answer)] == ["the", "pass", "key", "is", *answer]
        else:
            key = needle[3]
            assert needle[: 5 + len(answer)] == ["the", "number", "for", key, "is", *answer]
            # the key is asked for, and no distractor has it
            assert context.count(key) == 3  # its needle and twice in the question
        assert where == start + (4 if task.name == "passkey" else 5)
        # Depth: round(depth * F) of the F filler tokens stand before the needle.
        needle_tokens = set()
        for other in sample.needles:
            size = 8 + len(answer) if task.name == "passkey" else 6 + len(answer)
            needle_tokens.update(range(other, other + size))
        query = len(context) - (10 if task.name == "passkey" else 12)
        filler = [p for p in range(query) if p not in needle_tokens]
        before = sum(1 for p in filler if p < start)
        assert before == round(depth * len(filler))
    expected = 1 if task.name == "passkey" else task.keys
    assert len(draw(task, 160, 0, 0.0).needles) == expected


def test_depth_zero_and_one_put_a_single_needle_first_and_right_before_the_question():
    first = draw(Passkey(), 128, 0, 0.0)
    assert first.needles == (0,)
    last = draw(Passkey(), 128, 0, 1.0)
    tokens = words(last.tokens)
    needle_end = last.needles[0] + 4 + 5 + 4  # "the pass key is" + 5 digits + ". remember it ."
    assert tokens[needle_end : needle_end + 4] == ["what", "is", "the", "pass"]


def test_associative_recall_asks_every_key_once_and_its_value_is_the_answer():
    task = AssociativeRecall(pairs=6)
    for seed in range(5):
        sample = draw(task, 96, seed)
        tokens = words(sample.tokens)
        head = tokens[:12]
        pairs = dict(zip(head[::2], head[1::2], strict=True))
        assert (
            len(pairs) == 6
            and all(k in KEYS for k in pairs)
            and all(v in VALUES for v in pairs.values())
        )
        assert len(sample.answers) == 6
        asked = []
        for start, end in sample.answers:
            key, value = tokens[start - 1], tokens[start:end]
            assert value == [pairs[key]]
            assert head.count(key) == 1 and head.count(value[0]) == 1
            asked.append(key)
        assert sorted(asked) == sorted(pairs)


def test_copy_answers_are_the_first_copy_word_for_word():
    sample = draw(Copy(), 101, 3)
    tokens = words(sample.tokens)
    answered = [tokens[start] for start, _ in sample.answers]
    again = tokens.index("again")
    copied = tokens[tokens.index("copy") + 2 : again]
    assert answered == copied and tokens[again + 2 :] == copied
    assert len(copied) == (101 - 4) // 2


def test_variable_tracking_answers_the_chain_that_holds_the_value():
    task = VariableTracking()
    for seed in range(5):
        sample = draw(task, 128, seed)
        tokens = words(sample.tokens)
        query = len(tokens) - 3 - task.hops - 1 - task.digits - 1
        assert tokens[query : query + 3] == ["which", "variables", "hold"]
        value = tokens[query + 3 : query + 3 + task.digits]
        context = tokens[:query]
        assert len(occurrences(context, value)) == 1
        # Follow the assignments in order: who holds the value.
        holds: dict[str, list[str]] = {}
        i = 0
        while i < len(context):
            if context[i] == "var" and context[i + 2] == "is":  # "var x is", not "is var x ."
                name = context[i + 1]
                if context[i + 3] == "var":
                    holds[name] = holds[context[i + 4]]
                else:
                    holds[name] = context[i + 3 : i + 3 + task.digits]
            i += 1
        chain = [name for name, held in holds.items() if held == value]
        assert [tokens[start] for start, _ in sample.answers] == chain
        assert len(chain) == task.hops + 1


@pytest.mark.parametrize("name", list(TASKS))
def test_a_length_too_short_for_the_fixed_parts_says_so(name):
    with pytest.raises(TooShort, match="too short"):
        draw(TASKS[name], 5)


def test_a_tokenizer_that_cannot_write_a_word_is_named():
    def no_q(text: str) -> list[int]:
        if "q" in text:
            raise ValueError("no 'q'")
        return [0] * len(text)

    with pytest.raises(ValueError, match="cannot encode 'quartz'"):
        Pieces(no_q)("quartz")


def test_pieces_of_a_subword_tokenizer_keep_exact_lengths():
    # A tokenizer with several tokens per word: lengths are still exact (filler is cut).
    pieces = Pieces(lambda text: [ord(c) % 97 for c in text])
    for name, task in TASKS.items():
        sample = task.sample(pieces, 300, torch.Generator().manual_seed(1))
        assert sample.tokens.numel() == 300, name


# ------------------------------------------------------------------------------------- scoring
class NextToken(torch.nn.Module):
    """Reads the answer off the sequence itself: logits one-hot on the true next token."""

    vocab_size = len(TASK_WORDS)
    memory_length = 0

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, tokens, memory=None, use_memory=False):
        following = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # (B, L)
        return torch.nn.functional.one_hot(following, self.vocab_size).float(), None


class Induction(NextToken):
    """A causal rule that copies: after the longest earlier match (up to 5 tokens) of the text
    just read, predict what followed it."""

    def forward(self, tokens, memory=None, use_memory=False):
        out = torch.zeros(*tokens.shape, self.vocab_size)
        for b, row in enumerate(tokens.tolist()):
            for i in range(len(row)):
                best, guess = 0, 0
                for j in range(i):
                    k = 0
                    while k < 5 and j - k >= 0 and row[j - k] == row[i - k]:
                        k += 1
                    if k >= best and k > 0:
                        best, guess = k, row[j + 1]
                out[b, i, guess] = 1.0
        return out, None


class Guess(NextToken):
    """Answers uniformly at random from `alphabet` at every position."""

    def __init__(self, alphabet: list[str]):
        super().__init__()
        self.alphabet = torch.tensor([IDS[w] for w in alphabet])
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, tokens, memory=None, use_memory=False):
        logits = torch.full((*tokens.shape, self.vocab_size), -1.0)
        noise = torch.rand(*tokens.shape, len(self.alphabet), generator=self.generator)
        logits[..., self.alphabet] = noise
        return logits, None


def _accuracy(module, task, length=96, samples=8, depth=None):
    from urpe.experiments.long_context.evaluation import Reader, task_accuracy

    reader = Reader(module, lambda text: [IDS[w] for w in text.split()])
    return task_accuracy(reader, task, PIECES, length, depth, samples, seed=0)


@pytest.mark.parametrize("name", list(TASKS))
def test_a_model_that_predicts_the_next_token_scores_one(name):
    depth = 0.5 if TASKS[name].uses_depth else None
    assert _accuracy(NextToken(), TASKS[name], depth=depth) == 1.0


@pytest.mark.parametrize("name", ["passkey", "needle", "multikey", "mqar", "copy"])
def test_a_causal_model_that_copies_what_followed_scores_one(name):
    # The answer can be read off the context, by a causal rule, at any depth.
    task = TASKS[name]
    for depth in [0.0, 0.6, 1.0] if task.uses_depth else [None]:
        assert _accuracy(Induction(), task, length=80, samples=3, depth=depth) == 1.0


@pytest.mark.parametrize(
    "task, alphabet",
    [
        (Passkey(digits=1), DIGITS),
        (Needle(digits=1), DIGITS),
        (MultiKeyNeedle(keys=3, digits=1), DIGITS),
        (AssociativeRecall(pairs=4), VALUES),
        (Copy(), KEYS),
        (VariableTracking(), KEYS),
    ],
    ids=lambda x: getattr(x, "name", ""),
)
def test_a_model_that_answers_at_random_scores_chance(task, alphabet):
    samples = 600
    accuracy = _accuracy(Guess(list(alphabet)), task, length=64, samples=samples)
    units = samples * len(draw(task, 64).answers)
    sd = math.sqrt(task.chance * (1 - task.chance) / units)
    assert abs(accuracy - task.chance) < 4 * sd + 1e-9, (accuracy, task.chance)
    assert task.chance == pytest.approx(1 / len(alphabet))
