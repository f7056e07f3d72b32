"""Settings for `urpe reproduce synthetic` and their flags: the paper's, the paper's
vocabularies on a small model, and a quick one for 2 CPU cores.

The quick preset was sized by measurement (see results/synthetic/README.md): a smaller model at a
shorter length and a larger learning rate than the paper, enough for URPE to solve all three
tasks while RPE stays near chance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...cli_types import name_list, positive_int, positive_int_list
from ..experiment import CommandLine, Names, Option, variants_option
from ..model_choices import MODEL_OPTIONS, ModelChoices
from ..options import BATCH_SIZE, DIM, FFN_DIM, HEADS, LAYERS, LR, SEEDS, STEPS, WARMUP
from .variants import VARIANTS

# The names of `urpe.tasks.TASKS`, known without importing torch (tests/test_cli_startup.py
# checks that they are the same).
TASKS = ("pi", "etp", "probe")


@dataclass(frozen=True)
class Preset(ModelChoices):
    tasks: tuple[str, ...]
    variants: tuple[str, ...]
    seq_len: int
    vocab_sizes: tuple[int, ...]
    steps: int
    seeds: tuple[int, ...]
    batch_size: int
    lr: float
    warmup: int  # steps of linear warm-up, then linear decay to 0
    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    eval_sequences: int  # held-out sequences for the final accuracy
    precision: str = "32-true"


# fmt: off
# 2 CPU cores, at most 15 minutes for the default command.
QUICK = Preset(
    tasks=("pi", "etp", "probe"), variants=("nope", "ape", "rpe", "urpe"), seq_len=24,
    vocab_sizes=(10,), steps=800, seeds=(0,), batch_size=64, lr=2e-3, warmup=80,
    num_layers=3, dim=64, num_heads=4, ffn_dim=256, eval_sequences=1024,
)
PRESETS: dict[str, Preset] = {
    "quick": QUICK,
    # The paper's three vocabularies on the quick model, at length 32 (issue 12): 108 runs, a
    # few hours on 2 CPU cores. 3,000 steps because ape's etp plateaus at 0.5 for ~1,400
    # steps at V=1,000 before it jumps to 1.0 (results/synthetic/vocab/README.md).
    "vocab": replace(QUICK, seq_len=32, vocab_sizes=(10, 1000, 10000), steps=3000,
                     seeds=(0, 1, 2), warmup=300),
    # The paper: 3 layers, 768 wide, 12 heads, FFN 3072, length 128, Adam 7e-5, 6k warm-up,
    # polynomial (linear) decay, 40k updates of 128 sequences, fp16 (on a GPU).
    "paper": Preset(
        tasks=("pi", "etp", "probe"), variants=("nope", "rpe", "urpe"), seq_len=128,
        vocab_sizes=(10, 1000, 10000), steps=40_000, seeds=(0,), batch_size=128, lr=7e-5,
        warmup=6_000, num_layers=3, dim=768, num_heads=12, ffn_dim=3072, eval_sequences=4096,
        precision="16-mixed",
    ),
}
# fmt: on

PRESET_HELP = (
    "base settings; any flag given below overrides them. quick: V=10 at length 24, minutes on a "
    "CPU; vocab: the paper's V=10,1000,10000 at length 32 on the quick model, 3 seeds, hours on "
    "a CPU; paper: the paper's model and schedule, for a GPU"
)
VARIANTS_OPTION = variants_option(Names("variant", VARIANTS, allow_all=True))
OPTIONS = (
    Option(
        ("--tasks",),
        "tasks",
        f"comma-separated from {','.join(TASKS)} ({{presets}})",
        name_list,
        names=Names("task", TASKS),
    ),
    Option(("--seq-len",), "seq_len", "sequence length ({presets})", positive_int),
    Option(
        ("--vocab-size",),
        "vocab_sizes",
        "vocabulary size(s), comma-separated ({presets})",
        positive_int_list,
    ),
    STEPS,
    SEEDS,
    BATCH_SIZE,
    LR,
    WARMUP.with_help("warm-up steps ({presets}; scaled with --steps when not given)"),
    LAYERS.with_help("encoder layers ({presets})"),
    DIM,
    HEADS,
    FFN_DIM,
    Option(
        ("--eval-sequences",),
        "eval_sequences",
        "held-out sequences for the accuracy ({presets})",
        positive_int,
    ),
    *MODEL_OPTIONS,
)
IMPLEMENTATION = "urpe.experiments.synthetic.experiment:EXPERIMENT"  # imported when it runs
COMMAND = CommandLine(
    "synthetic", PRESETS, VARIANTS_OPTION, OPTIONS, IMPLEMENTATION, preset_help=PRESET_HELP
)
