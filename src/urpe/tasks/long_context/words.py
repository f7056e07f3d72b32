"""The words long-context tasks are written in, and text pieces as token ids.

Every task is text: filler sentences, needles and queries built from the word lists below, with
numbers written as spaced digits ("7 1 4 3 2"), so that any tokenizer can read it (a character
model of Shakespeare, a byte or BPE model, a Hugging Face tokenizer) and a closed word vocabulary
(`TASK_WORDS`, one token per word) can be trained on it from scratch.

`Pieces(encode)` turns a piece of text into token ids once and remembers it. A task is assembled
from pieces, never from one long string, so its length in tokens is exact whatever the tokenizer
(filler is cut token by token) and a needle's tokens are the same wherever it stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# The haystack: the passkey test's repeated filler (Mohtashami & Jaggi 2023), as words.
FILLER = (
    "the grass is green .",
    "the sky is blue .",
    "the sun is yellow .",
    "here we go .",
    "there and back again .",
)
DIGITS = tuple("0123456789")
# Keys of needles and of associative recall, names of variables, words to copy.
KEYS = (
    "apple", "river", "stone", "cloud", "horse", "candle", "mirror", "garden",
    "window", "forest", "bridge", "castle", "dragon", "feather", "hammer", "island",
    "jacket", "kettle", "lemon", "marble", "needle", "orange", "pepper", "rabbit",
    "saddle", "tiger", "violin", "wagon", "anchor", "button", "carpet", "desert",
    "engine", "falcon", "ginger", "helmet", "jungle", "ladder", "meadow", "nickel",
    "oyster", "parrot", "quartz", "ribbon", "silver", "tunnel", "velvet", "walnut",
)  # fmt: skip
# Values of associative recall (no colour of the filler among them).
VALUES = (
    "red", "brown", "pink", "purple", "black", "white", "grey", "gold",
    "happy", "quiet", "brave", "calm", "eager", "fancy", "gentle", "jolly",
    "kind", "lucky", "proud", "shy", "silly", "witty", "zany", "bold",
    "cold", "warm", "dry", "wet", "soft", "hard", "tall", "short",
)  # fmt: skip
# The fixed words of the tasks' templates.
TEMPLATE = (
    "the", "pass", "key", "is", "remember", "it", "what", "?", ".", ":", "number", "for",
    "copy", "words", "again", "var", "which", "variables", "hold",
)  # fmt: skip


def task_words() -> tuple[str, ...]:
    """Every word any task writes, each once, in a fixed order (a closed vocabulary)."""
    filler = [w for sentence in FILLER for w in sentence.split()]
    return tuple(dict.fromkeys([*TEMPLATE, *filler, *DIGITS, *KEYS, *VALUES]))


TASK_WORDS = task_words()


def spaced_digits(number: Sequence[int]) -> str:
    """[7, 1, 4] -> "7 1 4"."""
    return " ".join(str(d) for d in number)


class Pieces:
    """Text pieces as token ids, each encoded once: `pieces("the pass key is")` -> ids.

    A piece is encoded with a leading space, as a run of words inside running text. `encode`
    raises ValueError for text its tokenizer cannot represent (a character it lacks); so does
    this, naming the piece. A piece that encodes to no token is an error too (it could not be
    placed or scored).
    """

    def __init__(self, encode: Callable[[str], Sequence[int]]):
        self._encode = encode
        self._cache: dict[str, tuple[int, ...]] = {}

    def __call__(self, words: str) -> tuple[int, ...]:
        ids = self._cache.get(words)
        if ids is None:
            try:
                ids = tuple(int(i) for i in self._encode(" " + words))
            except ValueError as error:
                raise ValueError(f"the tokenizer cannot encode {words!r}: {error}") from None
            if not ids:
                raise ValueError(f"the tokenizer encodes {words!r} to no tokens")
            self._cache[words] = ids
        return ids

    def filler(self) -> list[tuple[int, ...]]:
        """The filler sentences as ids, in order."""
        return [self(sentence) for sentence in FILLER]
