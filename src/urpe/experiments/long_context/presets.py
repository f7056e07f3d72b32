"""Settings for `urpe reproduce long-context` and their flags: smoke (minutes on 2 CPU cores, to
check that everything runs), quick (the guide's table, < 20 minutes on 2 CPU cores) and paper
(for a GPU).

A variant is `BASE[+urpe]` as in `urpe reproduce lm` (every encoding of that family, with or
without URPE's gate C). Segment memory (`+mem`, `txl`) is left out: these tasks measure what a
model reads in one context.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cli_types import (
    fraction_list,
    name_list,
    non_negative_int,
    positive_int,
    positive_int_list,
)
from ..experiment import CommandLine, Names, Option, variants_option
from ..lm.variants import BASES, parse_variant
from ..model_choices import MODEL_OPTIONS, ModelChoices
from ..options import BATCH_SIZE, LR, MODEL_SIZE, SEEDS, STEPS, WARMUP

# The names of `urpe.tasks.long_context.TASKS`, known without importing torch
# (tests/test_long_context_cli.py checks that they are the same).
TASKS = ("passkey", "needle", "multikey", "mqar", "copy", "vartrack")
DEPTH_TASKS = ("passkey", "needle", "multikey")
# Every encoding of the family with and without the gate (the list).
ALL_ENCODINGS = (
    "nope", "ape", "rpe", "urpe", "t5", "alibi", "alibi+urpe", "rope", "rope+urpe",
    "kerple", "fire", "fox", "fox+urpe",
)  # fmt: skip


def parse_long_context_variant(name: str):
    """`parse_variant` without segment memory; ValueError naming the choices."""
    variant = parse_variant(name)
    if variant.memory:
        raise ValueError(
            f"variant {name!r} carries segment memory, which this evaluation does not use: "
            "choose BASE[+urpe] with BASE other than txl"
        )
    return variant


depth_list = fraction_list  # depths in the context, 0 its start and 1 its end


@dataclass(frozen=True, kw_only=True)
class Preset(ModelChoices):
    variants: tuple[str, ...]
    tasks: tuple[str, ...]  # accuracy tasks: one model per variant trains on their mixture
    corpora: tuple[str, ...]  # perplexity: one text model per variant and corpus
    seeds: tuple[int, ...]
    train_length: int
    factors: tuple[int, ...]  # evaluated lengths, multiples of train_length
    depths: tuple[float, ...]  # needle depths of the passkey and needle tasks
    samples: int  # samples per (task, length, depth)
    eval_tokens: int  # validation tokens scored per length (perplexity)
    steps: int  # task runs
    text_steps: int  # text runs (a character model's perplexity settles sooner)
    batch_size: int
    lr: float
    warmup: int
    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    precision: str = "32-true"


# fmt: off
PRESETS: dict[str, Preset] = {
    # Everything runs, nothing is learnt: three variants, a few dozen updates.
    "smoke": Preset(
        variants=("nope", "rope", "rope+urpe"), tasks=TASKS, corpora=("shakespeare",),
        seeds=(0,), train_length=64, factors=(1, 2, 4), depths=(0.0, 0.5, 1.0), samples=8,
        eval_tokens=2048, steps=30, text_steps=30, batch_size=16, lr=3e-3, warmup=5,
        num_layers=2, dim=32, num_heads=2, ffn_dim=64,
    ),
    "quick": Preset(
        variants=ALL_ENCODINGS, tasks=TASKS, corpora=("shakespeare",), seeds=(0,),
        train_length=64, factors=(1, 2, 4, 8), depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=32,
        eval_tokens=16384, steps=1000, text_steps=200, batch_size=32, lr=3e-3, warmup=50,
        num_layers=2, dim=64, num_heads=4, ffn_dim=256,
    ),
    "paper": Preset(
        variants=ALL_ENCODINGS, tasks=TASKS, corpora=("shakespeare", "enwiki-mini"),
        seeds=(0, 1, 2), train_length=256, factors=(1, 2, 4, 8, 16),
        depths=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), samples=100,
        eval_tokens=0, steps=20_000, text_steps=20_000, batch_size=64, lr=1e-3, warmup=1000,
        num_layers=4, dim=256, num_heads=8, ffn_dim=1024, precision="16-mixed",
    ),
}
# fmt: on

PRESET_HELP = (
    "base settings; any flag given below overrides them. smoke: three variants, a few dozen "
    "updates, to check that it all runs (minutes on a CPU); quick: every encoding, the guide's "
    "table (< 20 minutes on 2 CPU cores); paper: larger models, longer training, more depths "
    "and seeds, for a GPU"
)
VARIANTS_OPTION = variants_option(
    Names("variant", (), parse=parse_long_context_variant),
    f"comma-separated BASE[+urpe], BASE one of {', '.join(b for b in BASES if b != 'txl')}; "
    "'urpe' = rpe+urpe ({presets})",
)
OPTIONS = (
    Option(
        ("--tasks",),
        "tasks",
        f"accuracy tasks, comma-separated from {','.join(TASKS)} ({{presets}})",
        name_list,
        names=Names("task", TASKS),
    ),
    Option(
        ("--corpora",),
        "corpora",
        "perplexity against length: a text model per variant on each corpus, comma-separated: "
        "shakespeare, enwiki-mini, text:PATH or a file path; 'none' for no text models "
        "({presets})",
        name_list,
    ),
    SEEDS,
    Option(
        ("--train-length",),
        "train_length",
        "training context length L in tokens ({presets})",
        positive_int,
    ),
    Option(
        ("--factors",),
        "factors",
        "evaluated lengths, multiples of L, comma-separated ({presets})",
        positive_int_list,
    ),
    Option(
        ("--depths",),
        "depths",
        f"needle depths in [0, 1] for {', '.join(DEPTH_TASKS)} ({{presets}})",
        depth_list,
    ),
    Option(
        ("--samples",),
        "samples",
        "samples per task, length and depth ({presets})",
        positive_int,
    ),
    Option(
        ("--eval-tokens",),
        "eval_tokens",
        "validation tokens scored at each length for perplexity (0: the whole split; {presets})",
        non_negative_int,
    ),
    STEPS.with_help("optimiser updates of a task run ({presets})"),
    Option(
        ("--text-steps",),
        "text_steps",
        "optimiser updates of a text run ({presets})",
        positive_int,
    ),
    BATCH_SIZE,
    LR,
    WARMUP,
    *MODEL_SIZE,
    *MODEL_OPTIONS,
)
IMPLEMENTATION = "urpe.experiments.long_context.experiment:EXPERIMENT"  # imported when it runs
COMMAND = CommandLine(
    "long-context", PRESETS, VARIANTS_OPTION, OPTIONS, IMPLEMENTATION, preset_help=PRESET_HELP
)
