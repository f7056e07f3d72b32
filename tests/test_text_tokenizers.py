"""Tokenizers: round trips (bytes: any text; BPE: its training text and more), JSON save/load,
and errors for input outside a tokenizer's domain."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from urpe.data.text import (
    TOKENIZERS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    DatasetError,
    WordTokenizer,
    load_tokenizer,
    shakespeare_text,
)

# Valid Unicode: every code point except the surrogates, which UTF-8 cannot carry.
unicode_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=200)


@pytest.fixture(scope="module")
def shakespeare_slice() -> str:
    return shakespeare_text()[:200_000]


@pytest.fixture(scope="module")
def bpe(shakespeare_slice) -> BPETokenizer:
    return BPETokenizer.train(shakespeare_slice, vocab_size=600)


@given(unicode_text)
@settings(max_examples=300, deadline=None)
def test_bytes_round_trip_any_text(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.long and ids.tolist() == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_bytes_round_trip_any_byte_string(data):
    tokenizer = ByteTokenizer()
    assert tokenizer.decode_bytes(tokenizer.encode(data)) == data
    # Invalid UTF-8 (a model may sample it) decodes to replacement characters, never an error.
    assert tokenizer.decode(tokenizer.encode(data)) == data.decode("utf-8", errors="replace")


def test_bytes_reject_lone_surrogates_and_bad_ids():
    with pytest.raises(ValueError, match="not valid Unicode"):
        ByteTokenizer().encode("a\ud800b")
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        ByteTokenizer().decode([65, 256])
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        ByteTokenizer().decode(torch.tensor([-1]))


def test_bpe_round_trips_its_training_text(bpe, shakespeare_slice):
    ids = bpe.encode(shakespeare_slice)
    assert bpe.decode(ids) == shakespeare_slice
    # It compresses: merges were learned, ids cover the vocabulary's range.
    assert len(ids) < 0.5 * len(shakespeare_slice)
    assert 0 <= int(ids.min()) and int(ids.max()) < bpe.vocab_size == 600


@given(unicode_text)
@settings(max_examples=200, deadline=None)
def test_bpe_round_trips_unseen_unicode(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_training_is_deterministic(shakespeare_slice, bpe):
    again = BPETokenizer.train(shakespeare_slice, vocab_size=600)
    assert again == bpe
    sample = shakespeare_slice[:5000]
    assert torch.equal(again.encode(sample), bpe.encode(sample))


def test_char_round_trip_and_unknown_character():
    tokenizer = CharTokenizer.train("hello, world\n")
    assert tokenizer.vocab_size == len(set("hello, world\n"))
    assert tokenizer.decode(tokenizer.encode("low hell\n")) == "low hell\n"
    assert tokenizer.encode("dehlo").tolist() == sorted(tokenizer.encode("dehlo").tolist())
    with pytest.raises(ValueError, match="'z'"):
        tokenizer.encode("lazy")
    with pytest.raises(ValueError, match="must lie in"):
        tokenizer.decode([tokenizer.vocab_size])


def test_word_tokenizer_follows_the_wikitext_convention():
    tokenizer = WordTokenizer.train("the cat sat\nthe dog\n\n")
    ids = tokenizer.encode("the cat sat\nthe dog\n\n")
    words = [tokenizer.backend.id_to_token(i) for i in ids.tolist()]
    assert words == ["the", "cat", "sat", "<eos>", "the", "dog", "<eos>", "<eos>"]
    assert tokenizer.decode(ids) == "the cat sat\nthe dog\n\n"  # normal form round-trips
    unknown = tokenizer.encode("  the   bird \n")  # extra spaces normalise, unknown -> <unk>
    assert tokenizer.decode(unknown) == "the <unk>\n"


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_save_load_is_json_and_identical(kind, tmp_path, shakespeare_slice):
    text = shakespeare_slice[:20_000]
    tokenizer = {
        "byte": lambda: ByteTokenizer(),
        "char": lambda: CharTokenizer.train(text),
        "bpe": lambda: BPETokenizer.train(text, vocab_size=400),
        "word": lambda: WordTokenizer.train(text),
    }[kind]()
    path = tokenizer.save(tmp_path / "tok")
    assert json.loads(path.read_text())["kind"] == kind  # plain JSON, no pickle
    loaded = load_tokenizer(tmp_path / "tok")
    assert type(loaded) is type(tokenizer) and loaded.vocab_size == tokenizer.vocab_size
    assert torch.equal(loaded.encode(text), tokenizer.encode(text))


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DatasetError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DatasetError, match="cannot read"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"kind": "pickle"}')
    with pytest.raises(DatasetError, match="not a urpe tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"kind": "char", "characters": "ba"}')
    with pytest.raises(DatasetError, match="corrupt"):
        load_tokenizer(tmp_path)
