"""`urpe reproduce graph --dataset csv:PATH`: the user's own molecules in the graph experiment.

The experiment (presets.py, experiment.py) calls these few functions (its hooks):

- `dataset_argument` is the type of --dataset (a packaged name, csv:PATH, sdf:PATH, or the path
  of a .csv/.tsv/.sdf file, made absolute); `FILE_OPTIONS` are --smiles-column,
  --target-column and --split-column;
- `check_file_settings(preset)` refuses settings that do not fit the dataset, up front;
- `read_file(preset)` reads the file, once per command (its bytes and their SHA-256: the plan,
  the columns and the first run's data all come from that one read); `file_columns(preset,
  file)` gives the header's own spelling of the column flags (any case), or a UsageError naming
  the flag;
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
from ..records import LOCATIONS

DATASETS = ("moses-plogp", "qm9", "zinc", "zinc-full")  # the packaged ones
FILE_SUFFIXES = {
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "csv",
    ".smi": "csv",
    ".smiles": "csv",
    ".sdf": "sdf",
}
MIN_SPLIT = 2  # a split's target sd needs two molecules


def dataset_argument(text: str) -> str:
    """--dataset's type: a packaged name, or "csv:ABSOLUTE_PATH" / "sdf:ABSOLUTE_PATH"."""
    if text in DATASETS:
        return text
    from ...data.molecules.files import is_file_spec

    kind, _, rest = text.partition(":")
    if is_file_spec(text):
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


FILE_OPTIONS = (
    Option(
        ("--smiles-column",),
        "smiles_column",
        "with --dataset csv:PATH: the column of SMILES, "
        "any case (default: smiles). Rows whose SMILES RDKit cannot read, or whose target is "
        "not a number, are skipped and counted in one line",
        metavar="NAME",
    ),
    Option(
        ("--target-column",),
        "target_columns",
        "with --dataset csv:PATH or sdf:PATH: the target column(s); several train one model each",
        name_list,
        metavar="NAME[,NAME]",
    ),
    Option(
        ("--split-column",),
        "split_column",
        "with a file: the column saying train, val (or "
        "valid) or test for each row (default: a seeded 80/10/10 split; --sizes caps it)",
        metavar="NAME",
    ),
)


def check_file_settings(preset: Any) -> None:
    """UsageError for settings that do not fit the dataset (before anything is read or built;
    the columns are checked against the file when it is read, before anything is built)."""
    from ...data.molecules.files import is_file_spec

    if is_file_spec(preset.dataset):
        if not preset.target_columns:
            raise UsageError(
                "--target-column",
                f"{preset.dataset.partition(':')[2]}: say which column(s) to predict",
            )
        if preset.target is not None:
            raise UsageError("--target", "with a file, name the target with --target-column")
    elif preset.target_columns or preset.split_column or preset.smiles_column != "smiles":
        raise UsageError(
            "--target-column",
            f"{preset.dataset} is a packaged dataset; the column flags apply to --dataset csv:PATH",
        )


def read_file(preset: Any):
    """The user's file of --dataset csv:PATH, read (a `MoleculeFile`); UsageError if it is gone."""
    from ...data.molecules.files import MoleculeFileError, read_molecule_file

    try:
        return read_molecule_file(preset.dataset.partition(":")[2])
    except MoleculeFileError as error:
        raise UsageError("--dataset", str(error)) from None


def file_columns(preset: Any, file: Any) -> tuple[str, list[str], str | None]:
    """The header's own names in `file` (a `MoleculeFile`) for --smiles-column, --target-column
    and --split-column (any case on the command line); UsageError naming the flag when one is
    missing."""
    from ...data.molecules.files import MoleculeFileError

    try:
        table = file.table(preset.smiles_column, preset.target_columns, preset.split_column)
    except MoleculeFileError as error:
        flag = {
            "smiles_column": "--smiles-column",
            "target": "--target-column",
            "split_column": "--split-column",
        }.get(error.setting or "", "--dataset")
        raise UsageError(flag, str(error)) from None
    return table.smiles_column, list(dict.fromkeys(table.targets)), table.split_column


def load_data(config: dict[str, Any], progress: bool = False, file: Any = None):
    """The molecules of a run on a user's file (its content checked against the run's); `file`:
    the file already read (a `MoleculeFile`), else it is read here."""
    from ...data.molecules.files import load_molecule_file, read_molecule_file

    path = Path(config[LOCATIONS]["dataset"])
    planned = config["data"]["file"]
    if file is None:
        if not path.is_file():
            raise FileNotFoundError(f"the run's data file {path} is gone")
        file = read_molecule_file(path)
    if file.sha256 != planned["sha256"]:
        raise ValueError(f"{path} changed since this run was planned; run the command again")
    sizes = config["data"]["sizes"]
    return load_molecule_file(
        file,
        target=config["target"],
        smiles_column=planned["smiles_column"],
        split_column=planned["split_column"],
        sizes=None if sizes is None else tuple(sizes),
        seed=config["data"]["split_seed"],
        features=config["data"]["features"],
        progress=progress,
    )


def check_data(data: Any, say) -> None:
    """Say which rows were skipped and which molecules repeat; refuse splits too small to train
    and report on."""
    from ...data.molecules.files import duplicates_summary, is_file_spec, skipped_summary

    for line in (skipped_summary(data), duplicates_summary(data)):
        if line:
            say(line)
    counts = {s: len(data.split(s)) for s in ("train", "val", "test")}
    small = {s: n for s, n in counts.items() if n < MIN_SPLIT}
    if small:
        sizes = ", ".join(f"{s} {n}" for s, n in small.items())
        raise UsageError(
            "--sizes" if not is_file_spec(data.name) else "--dataset",
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
