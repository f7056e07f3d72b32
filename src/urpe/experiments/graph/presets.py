"""Settings for `urpe reproduce graph` and their flags: Graphormer's ZINC settings, and a quick one
for 2 CPU cores.

The quick preset was sized by measurement (results/graph/README.md): the "tiny" Graphormer on
capped splits, few enough updates that both models x 3 seeds finish within 20 minutes on two
CPU cores.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ...cli_types import positive_int
from ..experiment import CommandLine, Names, Option, variants_option
from ..experiment import Preset as ExperimentPreset
from ..model_choices import BACKEND
from ..options import LR, SEEDS, STEPS, WARMUP
from .molecule_files import DATASETS as DATASETS  # re-exported
from .molecule_files import FILE_OPTIONS, MIN_SPLIT, dataset_argument

VARIANTS = ("graphormer", "graphormer-urpe")  # plain, and with the URPE gate
ZINC_ENV_VAR = "URPE_ZINC_DIR"


@dataclass(frozen=True)
class Preset(ExperimentPreset):
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
    # Set by flags only: the data, and which models.
    dataset: str = "moses-plogp"  # or "csv:/ABSOLUTE/PATH", "sdf:..." (molecule_files.py)
    target: str | None = None  # None: the dataset's default target
    smiles_column: str = "smiles"  # the columns of a user's file
    target_columns: tuple[str, ...] | None = None
    split_column: str | None = None
    split_sizes: tuple[int, int, int] | None = None  # replaces `sizes[dataset]`
    variants: tuple[str, ...] = VARIANTS
    zinc_dir: Path | None = None  # not part of any run's identity (an environment variable)
    backend: str | None = None  # None: the Graphormer preset's ("auto")
    pack: bool = False  # GraphormerConfig.pack: molecules side by side in packed rows
    pack_length: int | None = None  # their length (None: the batch's largest molecule)


# fmt: off
PRESETS: dict[str, Preset] = {
    # 2 CPU cores: both models x 3 seeds within 20 minutes (two runs at a time).
    "quick": Preset(
        model="tiny", steps=800, seeds=(0, 1, 2), batch_size=64, lr=1e-3, warmup=40,
        weight_decay=0.0, eval_every=100,
        sizes={"moses-plogp": (10_000, 1_000, 1_000), "qm9": (10_000, 1_000, 1_000),
               "zinc": None, "zinc-full": (20_000, 2_000, 5_000)},
    ),
    # Graphormer's ZINC script (graphormer_slim): Adam(W) lr 2e-4, 60k warm-up, 400k updates,
    # batch 64, weight decay 0.01, polynomial decay to 1e-9, fp16 (on a GPU).
    "paper": Preset(
        model="slim", steps=400_000, seeds=(0, 1, 2, 3), batch_size=64, lr=2e-4, warmup=60_000,
        weight_decay=0.01, eval_every=10_000, precision="16-mixed", end_lr=1e-9,
        sizes={"moses-plogp": None, "qm9": None, "zinc": None, "zinc-full": None},
    ),
}
# fmt: on


def _sizes(text: str) -> tuple[int, int, int]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < MIN_SPLIT:
        raise argparse.ArgumentTypeError(
            f"expected three positive counts train,val,test, each >= {MIN_SPLIT} "
            f"(a split's target sd needs two molecules), like 2000,500,500; got {text!r}"
        )
    return values  # type: ignore[return-value]


DESCRIPTION = (
    "Train Graphormer and Graphormer + URPE (a gate C indexed by shortest-path distance, ones at "
    "init) with identical settings and the L1 loss; report test and validation MAE (mean ± sd "
    "over seeds), parameter counts and their difference, the paper's ZINC numbers beside ZINC, "
    "learning curves (curves.png) and the learned C against distance (gate.png)."
)
PRESET_HELP = (
    "quick: the 'tiny' Graphormer (4 layers, width 64) on capped splits, for 2 CPU cores; paper: "
    "Graphormer's ZINC settings ('slim', 400k updates) for a GPU"
)
VARIANTS_OPTION = variants_option(Names("variant", VARIANTS))
OPTIONS = (
    Option(
        ("--dataset",),
        "dataset",
        "moses-plogp: MOSES molecules (ZINC-derived, not ZINC), "
        "penalised logP by RDKit; qm9: QM9 HOMO-LUMO gap (eV); zinc / zinc-full: the real ZINC "
        f"benchmark from PyG's raw files in --zinc-dir or ${ZINC_ENV_VAR}; csv:PATH or "
        "sdf:PATH (or a .csv/.tsv/.smi/.sdf path; `;` and decimal commas read too): your "
        "own molecules, with --target-column (default: %(default)s)",
        dataset_argument,
        default="moses-plogp",
    ),
    Option(
        ("--target",),
        "target",
        "regression target (qm9: gap, homo, lumo, mu, alpha, ... ; "
        "moses-plogp: plogp or plogp-normalized; default: the dataset's)",
    ),
    *FILE_OPTIONS,
    Option(
        ("--sizes",),
        "split_sizes",
        "train,val,test caps (quick: 10000,1000,1000 for "
        "moses-plogp and qm9, all of zinc; paper: the full splits)",
        _sizes,
    ),
    SEEDS,
    STEPS,
    Option(("--batch-size",), "batch_size", "graphs per update ({presets})", positive_int),
    LR,
    WARMUP,
    Option(
        ("--eval-every",),
        "eval_every",
        "updates between validations, the learning curves ({presets})",
        positive_int,
    ),
    BACKEND,
    Option(
        ("--pack",),
        "pack",
        "run the layers on packed rows (molecules side by side, each "
        "attending only to itself) instead of one row per molecule padded to the batch's "
        "largest: the same predictions; slower on molecules so far (benchmarks/"
        "bench_graph_packing.py)",
        action="store_true",
    ),
    Option(
        ("--pack-length",),
        "pack_length",
        "with --pack: the rows' length in atoms + 1 "
        "per molecule (default: the batch's largest molecule)",
        positive_int,
    ),
    Option(
        ("--zinc-dir",),
        "zinc_dir",
        f"folder of PyG's raw ZINC files (default: ${ZINC_ENV_VAR})",
        Path,
        default=None,
    ),
)
IMPLEMENTATION = "urpe.experiments.graph.experiment:EXPERIMENT"  # imported when it runs
COMMAND = CommandLine(
    "graph",
    PRESETS,
    VARIANTS_OPTION,
    OPTIONS,
    IMPLEMENTATION,
    DESCRIPTION,
    PRESET_HELP,
    needs=("torch_geometric", "rdkit", "scipy"),
)
