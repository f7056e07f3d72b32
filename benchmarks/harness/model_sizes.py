"""The sizes the model benchmark measures at: issue 28's ("full") and a tiny set for a smoke run
("quick", seconds). Case names stay the same at every size, so targets and reports read both."""

from __future__ import annotations

from dataclasses import dataclass

from .end_to_end import SIZES as STEP_SIZES
from .end_to_end import Size


@dataclass(frozen=True)
class DecoderSize:
    """A small causal LM: the library's `LanguageModel` and the Hugging Face Llama share it
    (the Llama adds grouped-query attention: `kv_heads`)."""

    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


@dataclass(frozen=True)
class Sizes:
    # One decoding call: B=1, one query, `decode_keys` cached keys (the first is the main case),
    # `decode_heads` heads of `decode_head_dim`; the GQA case has `decode_kv_heads` key heads.
    decode_keys: tuple[int, int]
    decode_heads: int
    decode_kv_heads: int
    decode_head_dim: int
    call_loops: int  # calls per timed sample, so that a sample is long enough to time
    # Short rows, forward and forward+backward: (batch, heads, length, head_dim).
    short: tuple[int, int, int, int]
    short_loops: int
    # bfloat16 forward of long rows: (batch, heads, length, head_dim).
    long_bf16: tuple[int, int, int, int]
    # Generation: greedy, `new_tokens` after a `prompt`-token prompt, at each batch size.
    prompt: int
    new_tokens: int
    batches: tuple[int, ...]
    decoder: DecoderSize
    # One training step of the Hugging Face Llama: (batch, length).
    train: tuple[int, int]
    # Whole steps of the attention report's end-to-end rows, and of the LM experiment.
    steps: tuple[Size, ...]
    lm_steps: int
    lm_warmup: int


FULL = Sizes(
    decode_keys=(128, 1024),
    decode_heads=8,
    decode_kv_heads=2,
    decode_head_dim=32,
    call_loops=50,
    short=(64, 4, 24, 16),
    short_loops=5,
    long_bf16=(1, 8, 2048, 64),
    prompt=64,
    new_tokens=64,
    batches=(1, 4),
    decoder=DecoderSize(layers=4, dim=256, heads=8, kv_heads=2, ffn=688, vocab=512),
    train=(2, 512),
    steps=(STEP_SIZES["quick"], STEP_SIZES["long"]),
    lm_steps=20,
    lm_warmup=3,
)
QUICK = Sizes(
    decode_keys=(16, 64),
    decode_heads=4,
    decode_kv_heads=2,
    decode_head_dim=8,
    call_loops=2,
    short=(2, 2, 8, 8),
    short_loops=1,
    long_bf16=(1, 2, 64, 8),
    prompt=4,
    new_tokens=3,
    batches=(1, 4),
    decoder=DecoderSize(layers=1, dim=16, heads=4, kv_heads=2, ffn=32, vocab=32),
    train=(1, 16),
    steps=(
        Size("quick", batch=2, length=8, dim=16, heads=2, ffn=32, layers=1),
        Size("long", batch=1, length=32, dim=16, heads=2, ffn=32, layers=1),
    ),
    lm_steps=1,
    lm_warmup=0,
)
