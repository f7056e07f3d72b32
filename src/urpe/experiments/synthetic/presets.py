"""Settings for `urpe reproduce synthetic`: the paper's, and a quick one for 2 CPU cores.

The quick preset was sized by measurement (see results/synthetic/README.md): a smaller model at a
shorter length and a larger learning rate than the paper, enough for URPE to solve all three
tasks while RPE stays near chance.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Preset:
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

    def override(self, **changes) -> Preset:
        """This preset with every change that is not None applied."""
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise TypeError(f"unknown preset fields {sorted(unknown)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS: dict[str, Preset] = {
    # 2 CPU cores, at most 15 minutes for the default command.
    "quick": Preset(
        tasks=("pi", "etp", "probe"),
        variants=("nope", "ape", "rpe", "urpe"),
        seq_len=24,
        vocab_sizes=(10,),
        steps=800,
        seeds=(0,),
        batch_size=64,
        lr=2e-3,
        warmup=80,
        num_layers=3,
        dim=64,
        num_heads=4,
        ffn_dim=256,
        eval_sequences=1024,
    ),
    # The paper's three vocabularies on the quick model, at length 32 (issue 12): 108 runs, a
    # few hours on 2 CPU cores. 3,000 steps because ape's etp plateaus at 0.5 for ~1,400
    # steps at V=1,000 before it jumps to 1.0 (results/synthetic/vocab/README.md).
    "vocab": Preset(
        tasks=("pi", "etp", "probe"),
        variants=("nope", "ape", "rpe", "urpe"),
        seq_len=32,
        vocab_sizes=(10, 1000, 10000),
        steps=3000,
        seeds=(0, 1, 2),
        batch_size=64,
        lr=2e-3,
        warmup=300,
        num_layers=3,
        dim=64,
        num_heads=4,
        ffn_dim=256,
        eval_sequences=1024,
    ),
    # The paper: 3 layers, 768 wide, 12 heads, FFN 3072, length 128, Adam 7e-5, 6k warm-up,
    # polynomial (linear) decay, 40k updates of 128 sequences, fp16 (on a GPU).
    "paper": Preset(
        tasks=("pi", "etp", "probe"),
        variants=("nope", "rpe", "urpe"),
        seq_len=128,
        vocab_sizes=(10, 1000, 10000),
        steps=40_000,
        seeds=(0,),
        batch_size=128,
        lr=7e-5,
        warmup=6_000,
        num_layers=3,
        dim=768,
        num_heads=12,
        ffn_dim=3072,
        eval_sequences=4096,
        precision="16-mixed",
    ),
}
