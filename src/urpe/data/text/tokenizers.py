"""Tokenisers: characters, bytes, byte-level BPE and words, each saved as one JSON file.

Every tokenizer maps text to a 1-D int64 tensor of ids in [0, vocab_size) and back, and saves to /
loads from a directory (`tokenizer.json`, no pickle), so a checkpoint can carry it.
`load_tokenizer(directory)` reads any of them.

Round-trip guarantees (tested):
- `ByteTokenizer`: `decode(encode(text)) == text` for every string that is valid Unicode (no lone
  surrogates), and `decode_bytes(encode(data)) == data` for every byte string.
- `CharTokenizer`: `decode(encode(text)) == text` for every string made of its characters; any
  other character is an error naming it.
- `BPETokenizer` (byte-level BPE trained with HF `tokenizers`): `decode(encode(text)) == text`
  for every valid Unicode string, its training text included, since every byte is in its
  alphabet. Text is encoded line by line (merges never cross a newline), which keeps encoding of
  large corpora parallel and memory-light.
- `WordTokenizer` (WikiText / Transformer-XL convention: whitespace-split words, `<eos>` at the
  end of every line, `<unk>` for unknown words): round-trips text in normal form (lines of words
  separated by single spaces, each ending in a newline, no other whitespace, every word in the
  vocabulary); other text comes back in that normal form.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...progress import on_terminal
from .errors import INSTALL_LM, DatasetError

FILENAME = "tokenizer.json"
# Lines per `encode_batch` call: big enough to keep the Rust threads busy, small enough to bound
# the memory of the Python-side encodings.
_BATCH_LINES = 16384

Ids = Tensor | Sequence[int]


def _id_list(ids: Ids, vocab_size: int) -> list[int]:
    if isinstance(ids, Tensor):
        if ids.dim() > 1 or ids.is_floating_point():
            raise ValueError(
                f"ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}"
            )
        ids = ids.reshape(-1).tolist()  # a 0-d tensor is one id
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got {bad[0]}")
    return ids


def _hf_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DatasetError(
            f"BPE and word tokenizers need the HF 'tokenizers' package: {INSTALL_LM}"
        ) from None
    return tokenizers


class Tokenizer(ABC):
    """Text <-> ids. Subclasses register themselves in `TOKENIZERS` under `kind`."""

    kind: ClassVar[str]

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str) -> Tensor:
        """text -> ids, a (N,) int64 tensor."""

    @abstractmethod
    def decode(self, ids: Ids) -> str:
        """ids (N,) -> text."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """Everything needed to rebuild the tokenizer, as plain JSON (with "kind")."""

    @classmethod
    @abstractmethod
    def from_json(cls, data: dict[str, Any]) -> Tokenizer: ...

    #: What stands between a prompt and its continuation when both are shown as one text.
    separator: ClassVar[str] = ""

    def encode_prompt(self, text: str) -> Tensor:
        """`text` as the start of a text to be continued (ids (N,)); see `WordTokenizer`."""
        return self.encode(text)

    def unknown(self, text: str) -> list[str]:
        """The pieces of `text` this tokenizer cannot represent faithfully (none for most)."""
        return []

    def join(self, prompt: str, continuation: str) -> str:
        """Prompt and decoded continuation as one text, with `separator` between them where
        neither side brings whitespace of its own."""
        if not prompt or not continuation or prompt[-1].isspace() or continuation[0].isspace():
            return prompt + continuation
        return prompt + self.separator + continuation

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `directory/tokenizer.json`; returns its path."""
        path = Path(directory) / FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), ensure_ascii=True))
        return path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json(), sort_keys=True))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


TOKENIZERS: dict[str, type[Tokenizer]] = {}


def register(cls: type[Tokenizer]) -> type[Tokenizer]:
    TOKENIZERS[cls.kind] = cls
    return cls


def find_tokenizer_file(path: str | os.PathLike) -> Path:
    """The tokenizer.json that `path` means: the file itself, or `tokenizer.json` or
    `tokenizer/tokenizer.json` in `path` or in one of its two parents (a training run keeps it
    in its run folder, two levels above a `checkpoints/step-N` directory). The first candidate
    when none exists (for the error message)."""
    path = Path(path)
    if not path.is_dir():
        return path
    for folder in (path, path.parent, path.parent.parent):
        for candidate in (folder / FILENAME, folder / "tokenizer" / FILENAME):
            if candidate.is_file():
                return candidate
    return path / FILENAME


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Read a tokenizer that `Tokenizer.save` wrote: its directory, the JSON file itself, or a
    checkpoint or run folder it sits beside (see `find_tokenizer_file`)."""
    path = find_tokenizer_file(directory)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"no tokenizer at {path}") from None
    except (OSError, ValueError) as error:
        raise DatasetError(f"cannot read the tokenizer at {path}: {error}") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in TOKENIZERS:
        raise DatasetError(f"{path} is not a urpe tokenizer (kind {kind!r})")
    try:
        return TOKENIZERS[kind].from_json(data)
    except (KeyError, TypeError, ValueError) as error:
        raise DatasetError(f"the tokenizer at {path} is corrupt: {error}") from None


@register
class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (enwik8 style): vocabulary 256, lossless for any text or bytes."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str | bytes) -> Tensor:
        if isinstance(text, str):
            try:
                text = text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(f"text is not valid Unicode: {error}") from None
        if not isinstance(text, bytes | bytearray):
            raise TypeError(f"expected str or bytes, got {type(text).__name__}")
        if not text:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()

    def decode_bytes(self, ids: Ids) -> bytes:
        """ids -> the exact byte string."""
        if isinstance(ids, Tensor) and ids.dim() == 1 and not ids.is_floating_point():
            if ids.numel() and (ids.min() < 0 or ids.max() > 255):
                raise ValueError("token ids must lie in [0, 256)")
            return bytes(ids.to(torch.uint8).tolist())
        return bytes(_id_list(ids, 256))

    def decode(self, ids: Ids, errors: str = "replace") -> str:
        """ids -> text; bytes that are not valid UTF-8 (a model may sample them) become U+FFFD
        under the default `errors="replace"`, or raise with `errors="strict"`."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ByteTokenizer:
        return cls()


@register
class CharTokenizer(Tokenizer):
    """One token per Unicode character of a fixed alphabet (ids in sorted character order)."""

    kind = "char"

    def __init__(self, characters: Iterable[str]):
        chars = sorted(set(characters))
        if not chars or any(len(c) != 1 for c in chars):
            raise ValueError("a character tokenizer needs a non-empty set of single characters")
        self.characters = "".join(chars)
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        """The alphabet of `text`."""
        return cls(set(text))

    @property
    def vocab_size(self) -> int:
        return len(self.characters)

    def encode(self, text: str) -> Tensor:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - set(self._ids))
            shown = ", ".join(repr(c) for c in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ValueError(
                f"characters not in this tokenizer's alphabet of {self.vocab_size}: {shown}{more}"
            ) from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: Ids) -> str:
        return "".join(self.characters[i] for i in _id_list(ids, self.vocab_size))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "characters": self.characters}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CharTokenizer:
        tokenizer = cls(data["characters"])
        if tokenizer.characters != data["characters"]:
            raise ValueError("characters must be sorted and unique")
        return tokenizer


class _HuggingFaceTokenizer(Tokenizer):
    """Shared parts of the tokenizers backed by an HF `tokenizers.Tokenizer`."""

    def __init__(self, backend: Any):
        self.backend = backend

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "huggingface": json.loads(self.backend.to_str())}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tokenizer:
        hf = _hf_tokenizers()
        try:
            backend = hf.Tokenizer.from_str(json.dumps(data["huggingface"]))
        except Exception as error:  # the Rust side raises its own exception type
            raise ValueError(str(error).splitlines()[0]) from None
        return cls(backend)

    def _encode_lines(self, lines: list[str], progress: bool, eos: int | None = None) -> Tensor:
        from ...progress import progress_bar

        chunks: list[Tensor] = []
        bar = progress_bar(
            total=len(lines), unit="line", desc=f"{self.kind} encode", enabled=progress
        )
        for start in range(0, len(lines), _BATCH_LINES):
            batch = lines[start : start + _BATCH_LINES]
            for encoding in self.backend.encode_batch(batch, add_special_tokens=False):
                ids = encoding.ids if eos is None else [*encoding.ids, eos]
                chunks.append(torch.tensor(ids, dtype=torch.long))
            bar.update(len(batch))
        bar.close()
        return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)


@register
class BPETokenizer(_HuggingFaceTokenizer):
    """Byte-level BPE (GPT-2's scheme) trained with HF `tokenizers`; lossless on any text."""

    kind = "bpe"

    @classmethod
    def train(
        cls,
        text: str | Iterable[str],
        vocab_size: int = 8192,
        min_frequency: int = 2,
        progress: bool = False,
    ) -> BPETokenizer:
        """Learn merges from `text` (a string, or an iterable of strings such as lines) until the
        vocabulary (256 bytes + merges) reaches `vocab_size`."""
        if vocab_size < 257:
            raise ValueError(f"a BPE vocabulary needs more than the 256 bytes, got {vocab_size}")
        hf = _hf_tokenizers()
        backend = hf.Tokenizer(hf.models.BPE())
        # use_regex: GPT-2's split into words, numbers, punctuation and whitespace runs.
        backend.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=progress and on_terminal(),  # its bar: a terminal's only
        )
        lines = text.splitlines(keepends=True) if isinstance(text, str) else text
        backend.train_from_iterator(lines, trainer=trainer)
        return cls(backend)

    def encode(self, text: str, progress: bool = False) -> Tensor:
        if not isinstance(text, str):
            raise TypeError(f"expected str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"text is not valid Unicode: {error}") from None
        return self._encode_lines(text.splitlines(keepends=True), progress)

    def decode(self, ids: Ids) -> str:
        return self.backend.decode(_id_list(ids, self.vocab_size), skip_special_tokens=False)


@register
class WordTokenizer(_HuggingFaceTokenizer):
    """Whitespace-separated words with `<eos>` closing every line (WikiText / Transformer-XL)."""

    kind = "word"
    EOS, UNK = "<eos>", "<unk>"

    @classmethod
    def train(
        cls,
        text: str | Iterable[str],
        max_vocab_size: int | None = None,
        min_frequency: int = 0,
        progress: bool = False,
    ) -> WordTokenizer:
        """The words of `text` (most frequent first, capped at `max_vocab_size` with the two
        specials) plus `<eos>` and `<unk>`."""
        hf = _hf_tokenizers()
        backend = hf.Tokenizer(hf.models.WordLevel(unk_token=cls.UNK))
        backend.pre_tokenizer = hf.pre_tokenizers.WhitespaceSplit()
        trainer = hf.trainers.WordLevelTrainer(
            # The trainer's own default caps the vocabulary at 30,000 words.
            vocab_size=max_vocab_size or 2**31 - 1,
            min_frequency=min_frequency,
            special_tokens=[cls.EOS, cls.UNK],
            show_progress=progress and on_terminal(),  # its bar: a terminal's only
        )
        lines = text.splitlines() if isinstance(text, str) else text
        backend.train_from_iterator(lines, trainer=trainer)
        return cls(backend)

    separator = " "

    @property
    def eos_id(self) -> int:
        return self.backend.token_to_id(self.EOS)

    def encode_prompt(self, text: str) -> Tensor:
        """Like `encode`, but a last line without a newline stays open (no `<eos>` after it),
        so the continuation goes on in that line instead of starting a new one."""
        ids = self.encode(text)
        if ids.numel() and not text.endswith("\n") and int(ids[-1]) == self.eos_id:
            ids = ids[:-1]
        return ids

    def unknown(self, text: str) -> list[str]:
        """Distinct words of `text` outside the vocabulary (each becomes `<unk>`), in order."""
        vocabulary = self.backend.get_vocab(with_added_tokens=True)
        return list(dict.fromkeys(w for w in text.split() if w not in vocabulary))

    def encode(self, text: str, progress: bool = False) -> Tensor:
        if not isinstance(text, str):
            raise TypeError(f"expected str, got {type(text).__name__}")
        return self._encode_lines(text.splitlines(), progress, eos=self.eos_id)

    def decode(self, ids: Ids) -> str:
        eos = self.eos_id
        pieces: list[str] = []
        line: list[str] = []
        for i in _id_list(ids, self.vocab_size):
            if i == eos:
                pieces.append(" ".join(line) + "\n")
                line = []
            else:
                line.append(self.backend.id_to_token(i))
        return "".join(pieces) + " ".join(line)
