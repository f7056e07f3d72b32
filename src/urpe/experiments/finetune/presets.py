"""Settings of `urpe finetune`, its variants and its flags.

quick: 200 updates of 16 windows of 128 tokens at peak lr 1e-4 (a fine-tuning rate for a
pretrained model; a model built from a config wants more, e.g. --lr 2e-3), validation every 25
updates on the first 8k validation tokens, evaluation on the first 16k tokens of each split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...cli_types import (
    positive_float,
)
from ..experiment import CommandLine, Names, Option, variants_option
from ..lm.presets import (
    DATASET,
    EVALUATION_OPTIONS,
    SEGMENT_LENGTH,
    TOKENIZER,
    VOCAB_SIZE,
    TextRun,
)
from ..options import BATCH_SIZE, LR, SEEDS, STEPS, WARMUP


@dataclass(frozen=True)
class Variant:
    description: str
    urpe: dict[str, Any] | None  # add_urpe's keyword arguments; None: no gates
    trains: str = "all"  # "all" parameters, or only the URPE "gates"


VARIANTS: dict[str, Variant] = {
    "base": Variant("the model as it is", None),
    "urpe": Variant("a URPE gate C per self-attention module (add_urpe's defaults)", {}),
    "urpe-shared": Variant("one gate C shared by every layer", {"shared": True}),
    "urpe-buckets": Variant(
        "a gate per layer over 32 log-spaced offset buckets",
        {"gate": {"name": "t5", "num_buckets": 32}},
    ),
    "urpe-fox": Variant(
        "a gate per layer and FoX forget gates inside the softmax (add_urpe(decay='fox'))",
        {"decay": "fox"},
    ),
    "urpe-gates-only": Variant(
        "a gate per layer; only the gates train, the model is frozen", {}, "gates"
    ),
}


@dataclass(frozen=True)
class Preset(TextRun):
    model: str | None
    gradient_clip: float | None = 1.0
    weight_decay: float = 0.0
    gate_lr: float | None = None  # None: lr
    pack: bool = False  # windows flattened into one row (DataCollatorWithFlattening)


PRESETS: dict[str, Preset] = {
    "quick": Preset(
        model=None,
        dataset="shakespeare",
        variants=("base", "urpe"),
        seeds=(0,),
        segment_length=128,
        steps=200,
        batch_size=16,
        lr=1e-4,
        warmup=20,
        eval_tokens=16384,
        val_every=25,
    ),
}

MODEL = Option(
    ("--model",),
    "model",
    "a local folder written by save_pretrained (config.json and weights) of a transformers "
    "causal LM; never downloaded",
    metavar="PATH",
)
VARIANTS_OPTION = variants_option(Names("variant", VARIANTS))
OPTIONS = (
    MODEL,
    DATASET.with_help(
        "shakespeare, enwiki-mini, enwik8:PATH, wikitext-103:DIR, text:PATH or a file path "
        "({presets})"
    ),
    TOKENIZER.with_help(
        "urpe tokenisation when the model folder has no tokenizer of its own (default: the "
        "corpus's own); its ids must fit the model's vocabulary"
    ),
    VOCAB_SIZE,
    SEEDS,
    SEGMENT_LENGTH.with_help("training window length L ({presets})"),
    STEPS,
    BATCH_SIZE.with_help("windows per update, over all devices ({presets})"),
    LR,
    WARMUP,
    Option(
        ("--gate-lr",),
        "gate_lr",
        "peak learning rate of the URPE gates, same schedule (default: --lr)",
        positive_float,
    ),
    Option(("--weight-decay",), "weight_decay", "AdamW weight decay ({presets})", positive_float),
    Option(
        ("--pack",),
        "pack",
        "feed each batch as one packed row, the way transformers' "
        "DataCollatorWithFlattening packs documents: its windows concatenated, position ids "
        "restarting at 0 with each window, no window attending to another (urpe.hf reads "
        "the restarts). Same losses as separate rows; checks the packed route a fine-tune "
        "on documents of mixed lengths takes",
        action="store_true",
    ),
    *EVALUATION_OPTIONS,
)
DESCRIPTION = (
    "Fine-tune a local Hugging Face causal LM (a save_pretrained folder; nothing is "
    "downloaded) on a text data set with and without URPE gates; report validation loss, "
    "learning curves and length extrapolation."
)
IMPLEMENTATION = "urpe.experiments.finetune.experiment:EXPERIMENT"  # imported when it runs
COMMAND = CommandLine(
    "finetune",
    PRESETS,
    VARIANTS_OPTION,
    OPTIONS,
    IMPLEMENTATION,
    description=DESCRIPTION,
    needs=("transformers",),
)
