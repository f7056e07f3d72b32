"""The smallest models and runs the tests train, written once: `tiny_config` builds a tiny
model's config, `tiny_flags` the command line of a tiny `urpe reproduce` run and `run_tiny`
runs one (conftest.py's `tiny_run` fixture, into a fresh folder). A test states only what it
changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from urpe.models import TransformerConfig

# One layer of width 16: trains in well under a second.
TINY_MODEL = dict(vocab_size=11, num_layers=1, dim=16, num_heads=2, ffn_dim=32)


def tiny_config(**changes: Any) -> TransformerConfig:
    """A `TransformerConfig` of `TINY_MODEL`'s size with `changes` applied."""
    return TransformerConfig(**{**TINY_MODEL, **changes})


# What every tiny run sets: the model's size, one job on one thread, no progress bar, no
# checkpoints; then what each experiment's tiny run sets beyond it.
EVERY_RUN = dict(
    layers=1, dim=16, heads=2, ffn_dim=32, jobs=1, threads=1, no_progress=True, checkpoint_every=0
)
RUNS = {
    "synthetic": dict(
        tasks="etp", variants="urpe", seq_len=6, steps=8, batch_size=8, eval_sequences=16
    ),
    "lm": dict(
        variants="rpe+urpe",
        seeds="0",
        steps=10,
        segment_length=16,
        batch_size=4,
        eval_tokens=0,
        factors="1",
        val_every=10,
    ),
}
# A tiny synthetic run long enough to learn ETP, for tests that look at what it learned.
LEARNS = dict(seq_len=8, batch_size=16, eval_sequences=64)


def tiny_flags(experiment: str, **changes: Any) -> list[str]:
    """The flags of a tiny `urpe reproduce EXPERIMENT` run with `changes`, by flag name with
    underscores for dashes (seq_len=6 is --seq-len 6): True makes a switch, None or False
    leaves the flag out."""
    flags = []
    for name, value in {**EVERY_RUN, **RUNS[experiment], **changes}.items():
        if value is None or value is False:
            continue
        flags.append("--" + name.replace("_", "-"))
        if value is not True:
            flags.append(str(value))
    return flags


def run_tiny(experiment: str, out: Path, *more: str, **changes: Any) -> Path:
    """Run a tiny `urpe reproduce EXPERIMENT` into `out` (with `more` flags, such as the data
    set, and `changes` as in `tiny_flags`); returns `out`."""
    from urpe.cli import main

    argv = ["reproduce", experiment, *more, *tiny_flags(experiment, **changes)]
    assert main([*argv, "--out", str(out)]) == 0
    return out
