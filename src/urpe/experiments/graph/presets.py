"""Settings for `urpe reproduce graph`: Graphormer's ZINC settings, and a quick one for 2 CPU cores.

The quick preset was sized by measurement (results/graph/README.md): the "tiny" Graphormer on
capped splits, few enough updates that both models x 3 seeds finish within 20 minutes on two
CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

VARIANTS = ("graphormer", "graphormer-urpe")  # plain, and with the URPE gate


@dataclass(frozen=True)
class Preset:
    model: str  # a `urpe.graph.GRAPHORMER_PRESETS` name
    sizes: dict[str, tuple[int, int, int] | None]  # per dataset (train, val, test); None = all
    steps: int
    seeds: tuple[int, ...]
    batch_size: int
    lr: float
    warmup: int  # linear warm-up steps, then linear decay to end_lr
    weight_decay: float
    eval_every: int  # updates between validations (learning curves)
    precision: str = "32-true"
    end_lr: float = 0.0

    def override(self, **changes) -> Preset:
        """This preset with every change that is not None applied."""
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise TypeError(f"unknown preset fields {sorted(unknown)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS: dict[str, Preset] = {
    # 2 CPU cores: both models x 3 seeds within 20 minutes (two runs at a time).
    "quick": Preset(
        model="tiny",
        sizes={
            "moses-plogp": (10_000, 1_000, 1_000),
            "qm9": (10_000, 1_000, 1_000),
            "zinc": None,
            "zinc-full": (20_000, 2_000, 5_000),
        },
        steps=800,
        seeds=(0, 1, 2),
        batch_size=64,
        lr=1e-3,
        warmup=40,
        weight_decay=0.0,
        eval_every=100,
    ),
    # Graphormer's ZINC script (graphormer_slim): Adam(W) lr 2e-4, 60k warm-up, 400k updates,
    # batch 64, weight decay 0.01, polynomial decay to 1e-9, fp16 (on a GPU).
    "paper": Preset(
        model="slim",
        sizes={"moses-plogp": None, "qm9": None, "zinc": None, "zinc-full": None},
        steps=400_000,
        seeds=(0, 1, 2, 3),
        batch_size=64,
        lr=2e-4,
        warmup=60_000,
        weight_decay=0.01,
        eval_every=10_000,
        precision="16-mixed",
        end_lr=1e-9,
    ),
}
