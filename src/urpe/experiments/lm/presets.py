"""Settings for `urpe reproduce lm` and their flags: a quick one for 2 CPU cores and
Transformer-XL Base's.

quick (sized by measurement, see results/lm/README.md): character-level Shakespeare, a 2-layer
pre-LN decoder of width 64, segments of 64 characters (memory 64 for the recurrent variants),
400 updates of 16 segments; validation, test and extrapolation on the first `eval_tokens` tokens
of each split.

paper: Transformer-XL Base on WikiText-103 (Dai et al. 2019; the URPE paper's LM host): 16
layers, width 410, 10 heads, FFN 2100, dropout 0.1, segments of 150 with memory 150, 60 segments
per update, 200k updates, Adam 2.5e-4. Needs `--dataset wikitext-103:DIR` and GPUs; the word
vocabulary (~267k) uses a tied full softmax here, not Transformer-XL's adaptive softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cli_types import non_negative_int, positive_int, positive_int_list
from ..experiment import CommandLine, Names, Option, variants_option
from ..experiment import Preset as BasePreset
from ..model_choices import MODEL_OPTIONS, ModelChoices
from ..options import BATCH_SIZE, LR, MODEL_SIZE, SEEDS, STEPS, WARMUP
from .variants import BASES, DEFAULT_VARIANTS, parse_variant


@dataclass(frozen=True, kw_only=True)
class TextRun(BasePreset):
    """Settings every text run has (`reproduce lm`, `urpe finetune`)."""

    dataset: str
    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    segment_length: int
    steps: int
    batch_size: int
    lr: float
    warmup: int
    eval_tokens: int  # 0: the whole split
    val_every: int
    factors: tuple[int, ...] = (1, 2, 4, 8)
    precision: str = "32-true"
    tokenizer: str | None = None
    vocab_size: int | None = None


@dataclass(frozen=True)
class Preset(ModelChoices, TextRun):
    memory_length: int
    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    dropout: float
    gradient_clip: float | None = 0.25
    pack: bool = False  # train on packed documents (see PACK)


# fmt: off
PRESETS: dict[str, Preset] = {
    "quick": Preset(
        dataset="shakespeare", variants=DEFAULT_VARIANTS, seeds=(0, 1), segment_length=64,
        memory_length=64, steps=400, batch_size=16, lr=2e-3, warmup=40, num_layers=2, dim=64,
        num_heads=4, ffn_dim=256, dropout=0.0, eval_tokens=16384, val_every=50,
    ),
    "paper": Preset(
        dataset="wikitext-103", variants=("txl", "txl+urpe"), seeds=(0,), segment_length=150,
        memory_length=150, steps=200_000, batch_size=60, lr=2.5e-4, warmup=0, num_layers=16,
        dim=410, num_heads=10, ffn_dim=2100, dropout=0.1, eval_tokens=0, val_every=4000,
        precision="16-mixed",
    ),
}
# fmt: on

PRESET_HELP = "base settings; any flag below overrides them"
VOCAB_SIZE = Option(
    ("--vocab-size",),
    "vocab_size",
    "BPE vocabulary size, or a cap on the word vocabulary",
    positive_int,
)
EVALUATION_OPTIONS = (  # TextRun's flags
    Option(
        ("--eval-tokens",),
        "eval_tokens",
        "tokens of the valid/test splits scored (0: all; {presets})",
        non_negative_int,
    ),
    Option(
        ("--factors",),
        "factors",
        "extrapolation contexts, multiples of L ({presets})",
        positive_int_list,
    ),
    Option(
        ("--val-every",),
        "val_every",
        "updates between validations for the curves ({presets})",
        positive_int,
    ),
)
VARIANTS_OPTION = variants_option(
    Names("variant", (), parse=parse_variant),
    f"comma-separated BASE[+urpe][+mem], BASE one of {', '.join(BASES)}; 'urpe' = rpe+urpe; txl "
    "carries memory by itself ({presets})",
)
PACK = Option(
    ("--pack",),
    "pack",
    "train on packed documents: the training rows stay contiguous text "
    "without padding, but are cut into documents at every blank line; a token attends only "
    "within its document, positions restart at each document, and a document's first token is "
    "not predicted from the one before. Validation and test keep scoring the contiguous stream. "
    "Variants with memory cannot pack (default: off)",
    action="store_true",
)
# The text flags `urpe finetune` shares (with its own help).
DATASET = Option(
    ("--dataset",),
    "dataset",
    "shakespeare (char), enwiki-mini (byte), enwik8:PATH, wikitext-103:DIR, text:PATH or a file "
    "path ({presets})",
)
TOKENIZER = Option(
    ("--tokenizer",),
    "tokenizer",
    "tokenisation (default: the corpus's own)",
    choices=("char", "byte", "bpe", "word"),
)
SEGMENT_LENGTH = Option(
    ("--segment-length",), "segment_length", "training segment length L ({presets})", positive_int
)
OPTIONS = (
    DATASET,
    TOKENIZER,
    VOCAB_SIZE,
    SEEDS,
    SEGMENT_LENGTH,
    Option(
        ("--memory-length",),
        "memory_length",
        "memory M of the recurrent variants ({presets})",
        positive_int,
    ),
    STEPS,
    BATCH_SIZE.with_help("segments per update, over all devices ({presets})"),
    LR,
    WARMUP,
    *MODEL_SIZE,
    *EVALUATION_OPTIONS,
    PACK,
    *MODEL_OPTIONS,
)
IMPLEMENTATION = "urpe.experiments.lm.experiment:EXPERIMENT"  # imported when it runs
COMMAND = CommandLine(
    "lm",
    PRESETS,
    VARIANTS_OPTION,
    OPTIONS,
    IMPLEMENTATION,
    preset_help=PRESET_HELP,
    splits_sequences=True,
)
