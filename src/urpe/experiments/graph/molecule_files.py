"""`urpe reproduce graph --dataset csv:PATH`: the user's own molecules in the graph experiment.

The experiment (presets.py, experiment.py) calls these few functions (its hooks):

- `dataset_argument` is the type of --dataset (a packaged name, csv:PATH, sdf:PATH, or the path
  of a .csv/.tsv/.sdf file, made absolute); `FILE_OPTIONS` are --smiles-column,
  --target-column and --split-column;
- `check_file_settings(preset)` refuses settings that do not fit the dataset, up front;
  `file_columns(preset)` gives the header's own spelling of the column flags (any case);
- `plan_file_runs(preset, precision)` makes one run per (target column, variant, seed): the file
  enters each run's identity as its SHA-256 and its columns (and is shown as
  "csv:sha256-<12 hex digits>"); its absolute path is stored under the config's `locations`
  (not part of the identity), so an edited file trains again and a moved or renamed one does not;
- `load_data(config)` reads such a run's molecules, refusing a file whose content changed;
- `check_data(data, say)` prints the skipped-rows and repeated-molecules lines and refuses splits
  too small to report; `file_facts(data)` is what a record keeps about the file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ...cli_types import UsageError, name_list
from ..experiment import Option
from ..records import LOCATIONS, RunSpec

DATASETS = ("moses-plogp", "qm9", "zinc", "zinc-full")  # the packaged ones
FILE_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".txt": "csv", ".smi": "csv", ".smiles": "csv",
                 ".sdf": "sdf"}  # fmt: skip
MIN_SPLIT = 2  # a split's target sd needs two molecules


def dataset_argument(text: str) -> str:
    """--dataset's type: a packaged name, or "csv:ABSOLUTE_PATH" / "sdf:ABSOLUTE_PATH"."""
    if text in DATASETS:
        return text
    kind, sep, rest = text.partition(":")
    if sep and kind in ("csv", "sdf"):
        path = Path(rest).expanduser()
    else:
        path = Path(text).expanduser()
        stem = path.name.removesuffix(".gz")
        kind = FILE_SUFFIXES.get(Path(stem).suffix.lower())
        if kind is None:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(DATASETS)}, csv:PATH, sdf:PATH "
                "or the path of a .csv, .tsv, .smi or .sdf file)"
            )
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return f"{kind}:{path.resolve()}"


def is_file_dataset(spec: str) -> bool:
    return spec.partition(":")[0] in ("csv", "sdf")


FILE_OPTIONS = (
    Option(("--smiles-column",), "smiles_column", "with --dataset csv:PATH: the column of SMILES, "
           "any case (default: smiles). Rows whose SMILES RDKit cannot read, or whose target is "
           "not a number, are skipped and counted in one line", metavar="NAME"),
    Option(("--target-column",), "target_columns", "with --dataset csv:PATH or sdf:PATH: the "
           "target column(s); several train one model each", name_list, metavar="NAME[,NAME]"),
    Option(("--split-column",), "split_column", "with a file: the column saying train, val (or "
           "valid) or test for each row (default: a seeded 80/10/10 split; --sizes caps it)",
           metavar="NAME"),
)  # fmt: skip


def check_file_settings(preset: Any) -> None:
    """UsageError for settings that do not fit the dataset (before anything is built)."""
    if is_file_dataset(preset.dataset):
        if not preset.target_columns:
            raise UsageError(
                "--target-column",
                f"{preset.dataset.partition(':')[2]}: say which column(s) to predict",
            )
        if preset.target is not None:
            raise UsageError("--target", "with a file, name the target with --target-column")
        file_columns(preset)  # the columns exist: checked now, not after the data is built
    elif preset.target_columns or preset.split_column or preset.smiles_column != "smiles":
        raise UsageError(
            "--target-column",
            f"{preset.dataset} is a packaged dataset; the column flags apply to --dataset csv:PATH",
        )


def file_columns(preset: Any) -> tuple[str, list[str], str | None]:
    """The header's own names for --smiles-column, --target-column and --split-column (any case
    on the command line); UsageError naming the flag when one is missing."""
    from ...data.molecules.tables import MoleculeFileError, load_table

    path = preset.dataset.partition(":")[2]
    try:
        table = load_table(path, preset.smiles_column, preset.target_columns, preset.split_column)
    except MoleculeFileError as error:
        flag = {
            "smiles_column": "--smiles-column",
            "target": "--target-column",
            "split_column": "--split-column",
        }.get(error.setting or "", "--dataset")
        raise UsageError(flag, str(error)) from None
    return table.smiles_column, list(dict.fromkeys(table.targets)), table.split_column


def plan_file_runs(preset: Any, precision: str) -> list[RunSpec]:
    """Every (target column, seed, variant) on the user's file, its columns named as its
    header names them (so `logp` and `logP` are one run)."""
    from ...files import file_sha256
    from .experiment import run_config

    path = Path(preset.dataset.partition(":")[2])
    kind = preset.dataset.partition(":")[0]
    digest = file_sha256(path)
    smiles_column, targets, split_column = file_columns(preset)
    specs = []
    for target in targets:
        for seed in preset.seeds:
            for variant in preset.variants:
                config = run_config(preset.dataset, target, variant, seed, preset, precision)
                config["dataset"] = f"{kind}:sha256-{digest[:12]}"  # not the name: see above
                config["data"]["file"] = {
                    "sha256": digest,
                    "smiles_column": smiles_column,
                    "split_column": split_column,
                }
                config[LOCATIONS] = {"dataset": str(path)}
                name = f"{path.stem}-{target}-{variant}-S{preset.steps}-seed{seed}"
                specs.append(RunSpec(name, config, preset.steps))
    return specs


def load_data(config: dict[str, Any], progress: bool = False):
    """The molecules of a run on a user's file (its content checked against the run's)."""
    from ...data.molecules.files import load_molecule_file
    from ...files import file_sha256

    path = Path(config[LOCATIONS]["dataset"])
    file = config["data"]["file"]
    if not path.is_file():
        raise FileNotFoundError(f"the run's data file {path} is gone")
    if file_sha256(path) != file["sha256"]:
        raise ValueError(f"{path} changed since this run was planned; run the command again")
    sizes = config["data"]["sizes"]
    return load_molecule_file(
        path,
        target=config["target"],
        smiles_column=file["smiles_column"],
        split_column=file["split_column"],
        sizes=None if sizes is None else tuple(sizes),
        seed=config["data"]["split_seed"],
        features=config["data"]["features"],
        progress=progress,
    )


def check_data(data: Any, say) -> None:
    """Say which rows were skipped and which molecules repeat; refuse splits too small to train
    and report on."""
    from ...data.molecules.files import duplicates_summary, skipped_summary

    for line in (skipped_summary(data), duplicates_summary(data)):
        if line:
            say(line)
    counts = {s: len(data.split(s)) for s in ("train", "val", "test")}
    small = {s: n for s, n in counts.items() if n < MIN_SPLIT}
    if small:
        sizes = ", ".join(f"{s} {n}" for s, n in small.items())
        raise UsageError(
            "--sizes" if not is_file_dataset(data.name) else "--dataset",
            f"every split needs at least {MIN_SPLIT} molecules; {data.name} gives {sizes}",
        )


def file_facts(data: Any) -> dict[str, Any]:
    """What a run's record keeps about the user's file (its name, rows, skipped rows, repeated
    molecules), for the report; {} for a packaged dataset."""
    info = data.info
    if "source_rows" not in info:
        return {}
    duplicates = info.get("duplicates") or {}
    return {
        "data_file": {
            "name": info["file"],
            "rows": info["source_rows"],
            "skipped": info["skipped"]["count"],
            "repeated_molecules": duplicates.get("molecules", 0),
            "conflicting_molecules": duplicates.get("conflicting", 0),
        }
    }
