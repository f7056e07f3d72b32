"""The token streams a fine-tune trains and evaluates on, and which tokenizer makes them.

The rule, in order:
1. The model folder holds a tokenizer: a Hugging Face one (tokenizer.json, tokenizer_config.json,
   ... as `save_pretrained` writes them; loaded with AutoTokenizer, local files only) or a urpe
   one (a tokenizer.json with urpe's "kind"). The data set's text is read with urpe's corpus
   readers (`--dataset` takes the forms of `urpe reproduce lm`) and encoded with it; the token
   ids are cached under the urpe cache, keyed by the text's bytes and the folder's digest.
2. Otherwise urpe's own tokenizer for the corpus (`--tokenizer`: char, byte, bpe, word; default
   the corpus's own, as in `urpe reproduce lm`), whose ids index the model's embedding directly.
   That only makes sense when the model was trained on those ids (a model urpe trained, or one
   built from a config), and it must fit: a tokenizer with more ids than the model's vocabulary
   is one error naming both sizes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
)
MODEL_TOKENIZER_FORMAT = 1  # bump when the encoding of a data set with a folder's tokenizer changes
ENCODE_LINES = 4096


class DataError(ValueError):
    """A data set that cannot be used with this model; one line."""


@dataclass(frozen=True)
class Tokens:
    train: Tensor  # (N,) int64 each
    valid: Tensor
    test: Tensor
    vocab_size: int
    metric: str  # "bpc" (characters or bytes) or "perplexity"
    tokenizer: str  # how the ids were made, for the record

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the three splits' ids: the data a run sees, whatever file or tokenizer
        made it (part of a run's identity, so an edited text file is a new run)."""
        sha = hashlib.sha256()
        for split in (self.train, self.valid, self.test):
            sha.update(f"{len(split)}\0".encode())
            sha.update(split.to(torch.int64).contiguous().numpy().tobytes())
        return sha.hexdigest()


def tokenizer_source(model: Path) -> str | None:
    """Which tokenizer the model folder holds: "urpe", "hf", or None."""
    urpe_file = model / "tokenizer.json"
    if urpe_file.is_file():
        try:
            if "kind" in json.loads(urpe_file.read_text()):
                return "urpe"
        except (OSError, ValueError):
            pass
    return "hf" if any((model / name).is_file() for name in HF_TOKENIZER_FILES) else None


class _Encoder:
    """encode(text) -> (N,) ids with the folder's tokenizer; metric of its unit."""

    def __init__(self, model: Path, source: str):
        if source == "urpe":
            from ...data.text import load_tokenizer

            self.urpe = load_tokenizer(model)
            self.vocab_size = self.urpe.vocab_size
            self.metric = "bpc" if self.urpe.kind in ("char", "byte") else "perplexity"
        else:
            from transformers import AutoTokenizer

            self.urpe = None
            try:
                self.hf = AutoTokenizer.from_pretrained(model, local_files_only=True)
            except (OSError, ValueError, TypeError) as error:
                raise DataError(
                    f"the tokenizer in {model} cannot be loaded: "
                    f"{str(error).strip().splitlines()[0]}"
                ) from None
            self.vocab_size, self.metric = len(self.hf), "perplexity"

    def encode(self, text: str) -> Tensor:
        if self.urpe is not None:
            try:
                return self.urpe.encode(text).long()
            except ValueError as error:
                raise DataError(
                    f"the model's tokenizer cannot encode the data set: {error}"
                ) from None
        lines = text.splitlines(keepends=True)
        ids: list[int] = []
        for start in range(0, len(lines), ENCODE_LINES):
            pieces = self.hf(
                lines[start : start + ENCODE_LINES], add_special_tokens=False, verbose=False
            )["input_ids"]
            for piece in pieces:
                ids.extend(piece)
        return torch.tensor(ids, dtype=torch.long)


def _with_model_tokenizer(dataset: str, model: Path, source: str, digest: str) -> Tokens:
    from safetensors.torch import load_file, save_file

    from ...data.text import SPLITS, cache_root
    from ...data.text.cache import cached_entry, file_sha256
    from ...data.text.corpora import CORPORA, parse_spec

    name, path = parse_spec(dataset)
    files = CORPORA[name].locate(path)
    encoder = _Encoder(model, source)
    inputs = {
        "corpus": name,
        "sources": [file_sha256(f) for f in files],
        "model": digest,
        "format": MODEL_TOKENIZER_FORMAT,
    }

    def build(directory: Path) -> dict:
        parts = CORPORA[name].read(files, False, False)
        tokens = {s: encoder.encode(p) for s, p in zip(SPLITS, parts, strict=True)}
        save_file(tokens, str(directory / "tokens.safetensors"))
        return {"tokens": {s: len(t) for s, t in tokens.items()}}

    entry, _ = cached_entry(
        cache_root() / "finetune",
        name,
        inputs,
        build,
        on_rebuild=lambda m: print(m, file=sys.stderr),
    )
    splits = load_file(str(entry / "tokens.safetensors"))
    return Tokens(
        splits["train"],
        splits["valid"],
        splits["test"],
        encoder.vocab_size,
        encoder.metric,
        f"{source} tokenizer of the model folder",
    )


def load_tokens(
    dataset: str,
    tokenizer: str | None,
    vocab_size: int | None,
    model: Path,
    digest: str,
    model_vocab: int,
) -> Tokens:
    """Token ids of the data set's three splits under the rule above (DataError, or the data
    package's DatasetError, with one line on failure)."""
    source = tokenizer_source(model)
    if source is not None:
        if tokenizer is not None or vocab_size is not None:
            raise DataError(
                f"{model} has its own tokenizer, which is used: drop --tokenizer and --vocab-size"
            )
        tokens = _with_model_tokenizer(dataset, model, source, digest)
    else:
        from ...data.text import load_corpus

        corpus = load_corpus(dataset, tokenizer=tokenizer, vocab_size=vocab_size, progress=False)
        kind = type(corpus.tokenizer).kind
        tokens = Tokens(
            corpus.train.long(),
            corpus.valid.long(),
            corpus.test.long(),
            corpus.vocab_size,
            corpus.metric,
            f"urpe {kind} tokenizer (the model folder has none)",
        )
    if tokens.vocab_size > model_vocab:
        too_many = (
            f"the {tokens.tokenizer} has {tokens.vocab_size} ids, more than the model's "
            f"vocabulary of {model_vocab}"
        )
        if source is not None:
            raise DataError(f"{too_many}: the folder's tokenizer does not belong to its model")
        raise DataError(f"{too_many}; what fits: {fitting_tokenizers(dataset, model_vocab)}")
    return tokens


def save_tokenizer(
    model: Path, dataset: str, tokenizer: str | None, vocab_size: int | None, destination: Path
) -> None:
    """Write the tokenizer that made a run's ids (the rule above) into `destination`, the
    fine-tuned model's folder, so that it is used as a model folder is: the folder's own (urpe's
    tokenizer.json copied, a Hugging Face one saved by its `save_pretrained`), else urpe's
    tokenizer for the corpus (a tokenizer.json that `tokenizer_source` reads as urpe's)."""
    source = tokenizer_source(model)
    if source == "urpe":
        shutil.copyfile(model / "tokenizer.json", destination / "tokenizer.json")
    elif source == "hf":
        _Encoder(model, source).hf.save_pretrained(destination)
    else:
        from ...data.text import load_corpus

        corpus = load_corpus(dataset, tokenizer=tokenizer, vocab_size=vocab_size, progress=False)
        corpus.tokenizer.save(destination)


def fitting_tokenizers(dataset: str, model_vocab: int) -> str:
    """urpe's tokenizers whose ids fit a vocabulary of `model_vocab` on this data set, as flags:
    char needs one id per distinct character, byte 256, bpe at least 257, word at least 3."""
    from ...data.text import DatasetError, load_corpus

    fits = []
    try:  # cached, like any corpus: following the advice reuses it
        characters = load_corpus(dataset, tokenizer="char", progress=False).vocab_size
    except DatasetError:
        characters = None
    if characters is not None and characters <= model_vocab:
        fits.append(f"--tokenizer char ({characters} ids, the data set's characters)")
    if model_vocab >= 256:
        fits.append("--tokenizer byte (256 ids)")
    if model_vocab >= 257:
        fits.append(f"--tokenizer bpe --vocab-size {model_vocab}")
    if model_vocab >= 3:
        fits.append(
            f"--tokenizer word --vocab-size {model_vocab} (the {model_vocab - 2} most "
            "frequent words, <eos> and <unk>)"
        )
    choices = ", ".join(fits) if fits else "none of urpe's tokenizers"
    return f"{choices}; or a model folder with its own tokenizer"
