"""The graph experiment on the shared runner: its run configs, `run_one`, the report with its
figures, and `EXPERIMENT`.

A run is (dataset, variant, seed) under a preset's settings: Graphormer with or without URPE's
gate, trained with the L1 loss on one molecule dataset. The data split is fixed (split seed 0)
for every run; the run's seed sets the initialisation, the batch order and dropout. The record
holds validation and test MAE, the parameter count, the validation curve, and the learned
gates C (layers, H, R) as tensors beside it.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ...cli_types import UsageError
from ...graph.model import GraphormerConfig
from ...training.optim import OptimConfig
from ..execution import RunContext
from ..experiment import Experiment
from ..recipes import preset_optim
from ..records import LOCATIONS, RunResult, RunSpec
from . import molecule_files
from .presets import COMMAND, ZINC_ENV_VAR, Preset
from .report import rows, write_report

SPLIT_SEED = 0  # the same train/val/test molecules for every run
FEATURES = "zinc"  # atom type and bond type, as ZINC
EVAL_BATCH = 256


def run_name(dataset: str, variant: str, seed: int, preset: Preset) -> str:
    packed = "-packed" if preset.pack else ""
    return f"{dataset}-{variant}-S{preset.steps}{packed}-seed{seed}"


def model_config(variant: str, preset: Preset) -> dict[str, Any]:
    from ...data.molecules.featurize import FEATURIZATIONS

    spec = FEATURIZATIONS[FEATURES]
    changes = {} if preset.backend is None else {"backend": preset.backend}
    if preset.pack:
        changes.update(pack=True, pack_length=preset.pack_length)
    gate = "relation" if variant == "graphormer-urpe" else None
    graphormer = GraphormerConfig.preset(preset.model, gate=gate, **changes)
    return {
        "graphormer": graphormer.to_dict(),
        "node_cardinalities": list(spec.node_cardinalities),
        "node_features": None,
        "edge_cardinalities": list(spec.edge_cardinalities),
        "edge_features": None,
        "directed": False,
    }


def run_config(
    dataset: str, target: str | None, variant: str, seed: int, preset: Preset, precision: str
) -> dict[str, Any]:
    """Everything that decides this run's result, JSON-ready."""
    from ...data.molecules import MOLECULE_DATASETS

    if target is None:
        target = MOLECULE_DATASETS[dataset].default_target
    sizes = preset.split_sizes or preset.sizes.get(dataset)
    return {
        "experiment": "graph",
        "dataset": dataset,
        "target": target,
        "variant": variant,
        "seed": seed,
        "data": {
            "sizes": list(sizes) if sizes is not None else None,
            "split_seed": SPLIT_SEED,
            "features": FEATURES,
        },
        "model": model_config(variant, preset),
        "optim": preset_optim(preset).to_dict(),
        "train": {
            "steps": preset.steps,
            "batch_size": preset.batch_size,
            "precision": precision,
            "eval_every": preset.eval_every,
        },
    }


def specs(preset: Preset, precision: str) -> list[RunSpec]:
    """Every (variant, seed), seeds outermost so that both models of a seed finish together."""
    return [
        RunSpec(
            run_name(preset.dataset, v, s, preset),
            run_config(preset.dataset, preset.target, v, s, preset, precision),
            preset.steps,
        )
        for s in preset.seeds
        for v in preset.variants
    ]


def plan_file_runs(preset: Preset, precision: str, file: Any) -> list[RunSpec]:
    """Every (target column, seed, variant) on the user's file (its `MoleculeFile`), its
    columns named as its header names them (so `logp` and `logP` are one run). The file enters
    each run's identity as its SHA-256 and its columns (shown as "csv:sha256-<12 hex digits>");
    its absolute path is stored under the config's `locations` (not part of the identity), so
    an edited file trains again and a moved or renamed one does not."""
    kind = preset.dataset.partition(":")[0]
    smiles_column, targets, split_column = molecule_files.file_columns(preset, file)
    runs = []
    for target in targets:
        for seed in preset.seeds:
            for variant in preset.variants:
                config = run_config(preset.dataset, target, variant, seed, preset, precision)
                config["dataset"] = f"{kind}:sha256-{file.sha256[:12]}"  # not the name: see above
                config["data"]["file"] = {
                    "sha256": file.sha256,
                    "smiles_column": smiles_column,
                    "split_column": split_column,
                }
                config[LOCATIONS] = {"dataset": str(file.path)}
                name = f"{file.path.stem}-{target}-{variant}-S{preset.steps}-seed{seed}"
                runs.append(RunSpec(name, config, preset.steps))
    return runs


def plan(preset: Preset, precision: str, progress: bool = False) -> list[RunSpec]:
    """Every run; the dataset's cache is built (or checked) once, here, before any run starts,
    so that parallel runs read the same cache instead of each building it. A user's file
    (--dataset csv:PATH) is read once, here, and makes one run per target column, identified
    by the file's content."""
    from ...data.molecules.files import is_file_spec

    file = None
    if is_file_spec(preset.dataset):
        file = molecule_files.read_file(preset)
        runs = plan_file_runs(preset, precision, file)
    else:
        runs = specs(preset, precision)
    if preset.zinc_dir is not None:
        # Spawned runs inherit the environment: the folder is not part of any run's identity.
        os.environ[ZINC_ENV_VAR] = str(preset.zinc_dir)
    try:
        data = load_data(runs[0].config, progress=progress, file=file)
    except (ValueError, FileNotFoundError) as error:
        raise UsageError("--dataset", str(error).splitlines()[0]) from None
    molecule_files.check_data(
        data, lambda line: print(f"urpe reproduce graph: {line}", file=sys.stderr)
    )
    return runs


def load_data(config: dict[str, Any], progress: bool = False, file: Any = None):
    """The run's molecules (from the cache after the first call; built by the command first);
    `file`: the user's file already read (its `MoleculeFile`), for a run on one."""
    from ...data.molecules import load_molecules
    from ...data.molecules.files import is_file_spec

    if is_file_spec(config["dataset"]):  # the user's own file
        return molecule_files.load_data(config, progress, file)
    sizes = config["data"]["sizes"]
    return load_molecules(
        config["dataset"],
        target=config["target"],
        sizes=None if sizes is None else tuple(sizes),
        seed=config["data"]["split_seed"],
        features=config["data"]["features"],
        progress=progress,
    )


class _Collate:
    """Item indices (or a list of items) -> one `torch_geometric` Batch (picklable)."""

    def __init__(self, split) -> None:
        self.split = split

    def __call__(self, items) -> Any:
        from torch_geometric.data import Batch

        if isinstance(items, torch.Tensor):
            items = [self.split[int(i)] for i in items]
        return Batch.from_data_list(list(items))


def read_curve(run_dir: Path) -> list[list[float]]:
    """[[logged step, val MAE], ...] from the run's Lightning CSV log (the last value per step).

    Lightning logs a validation inside training at (updates done - 1) and the final
    `trainer.validate` at (updates done); `report.curve_points` turns both into updates done.
    """
    path = run_dir / "logs" / "metrics.csv"
    if not path.exists():
        return []
    by_step: dict[int, float] = {}
    with path.open() as handle:
        for row in csv.DictReader(handle):
            value = row.get("val/mae")
            if value not in (None, ""):
                by_step[int(row["step"])] = float(value)
    return [[step, by_step[step]] for step in sorted(by_step)]


def run_one(config: dict[str, Any], context: RunContext) -> RunResult:
    """Train one Graphormer run; measure validation and test MAE."""
    from torch_geometric.loader import DataLoader

    from ...graph import Graphormer
    from ...training import IndexedStream, StepDataModule
    from ...training.inputs import MoleculeInputs
    from ...training.regression import GraphRegression, mean_absolute_error

    seed = config["seed"]
    data = load_data(config)
    context.start(seed)
    model = Graphormer.from_model_config(config["model"])
    train_y = data.train._data.y.double()
    # The head learns standardised targets; predictions come out in the data's units.
    model.set_target_statistics(float(train_y.mean()), float(train_y.std().clamp(min=1e-8)))
    inputs = MoleculeInputs(data.featurizer, data.target, data.unit)  # in every checkpoint
    objective = GraphRegression(
        model, OptimConfig.from_dict(config["optim"]), run=config, inputs=inputs
    )
    train = config["train"]
    stream = IndexedStream(len(data.train), train["batch_size"], seed, _Collate(data.train))
    module = StepDataModule(
        stream, data.val, eval_batch_size=EVAL_BATCH, collate=_Collate(data.val)
    )
    # The untrained model's validation MAE: the curve's first point (predicting about the mean).
    initial_val_mae = mean_absolute_error(model, DataLoader(data.val, batch_size=EVAL_BATCH))
    metrics = context.fit(
        objective,
        module,
        max_steps=train["steps"],
        val_every=train["eval_every"],
        precision=train["precision"],
        seed=seed,
    )
    model = model.cpu().float()
    test = DataLoader(data.test, batch_size=EVAL_BATCH, shuffle=False)
    record = {
        "val_mae": metrics["val/mae"],
        "test_mae": mean_absolute_error(model, test),
        "params": sum(p.numel() for p in model.parameters()),
        "unit": data.unit,
        "sizes": [len(data.train), len(data.val), len(data.test)],
        "target_std": {"train": float(train_y.std()), "test": float(data.test._data.y.std())},
        "initial_val_mae": initial_val_mae,
        "curve": read_curve(context.run_dir),  # as logged; see report.curve_points
        **molecule_files.file_facts(data),
    }
    gates = model.gate_tables()
    tensors = {"C": torch.stack(gates).detach().clone()} if gates else None  # (layers, H, R)
    return RunResult(record, tensors)


def describe(record: dict) -> str:
    """The line printed when a run finishes."""
    r = record["result"]
    return f"test MAE {r['test_mae']:.4f}, val MAE {r['val_mae']:.4f} in {record['seconds']:.0f} s"


def report(records: list[dict], out: Path, wall: float) -> tuple[str, list[Path]]:
    """results.json, results.md and the figures; returns the markdown and the figures' paths."""
    from .plots import figures  # matplotlib, imported when a report is drawn

    text = write_report(records, out, wall)
    return text, figures(records, rows(records), out)


def check(preset: Preset) -> None:
    molecule_files.check_file_settings(preset)
    if preset.pack_length is not None and not preset.pack:
        raise UsageError("--pack-length", "sets the packed rows' length: give --pack too")
    if preset.dataset.startswith("zinc"):
        zinc_dir = preset.zinc_dir or os.environ.get(ZINC_ENV_VAR)
        if not zinc_dir:
            raise UsageError(
                "--dataset",
                f"{preset.dataset} needs PyG's raw ZINC files (train/val/test .pickle and, for "
                f"the subset, .index) in --zinc-dir DIR or ${ZINC_ENV_VAR}; nothing is downloaded",
            )
        if not Path(zinc_dir).is_dir():
            raise UsageError("--zinc-dir", f"{zinc_dir} is not a folder")


# the preset fields whose values multiply into runs
SWEEP = ("target_columns", "variants", "seeds")
EXPERIMENT = Experiment.of(COMMAND, plan, run_one, describe, report, sweep=SWEEP, check=check)
