"""Where the raw molecules come from: files shipped inside registry packages (MOSES SMILES in
`molsets`, QM9 in `qm9pack`) and the user's own copy of PyG's ZINC files. Nothing downloads.

The packages are located with `importlib.util.find_spec`, which does not run them: `molsets`
cannot be imported on Python 3.11 (its pinned dependencies do not build), and `qm9pack`'s own
loader needs pandas and pkg_resources. Both are installed with `pip install --no-deps`.
"""

from __future__ import annotations

import csv
import gzip
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

ZINC_ENV_VAR = "URPE_ZINC_DIR"
ZINC_PICKLES = ("train.pickle", "val.pickle", "test.pickle")
ZINC_INDEXES = ("train.index", "val.index", "test.index")

HARTREE_TO_EV = 27.211386246
# Friendly QM9 target names -> (qm9pack CSV column, factor to the unit given). Energies in eV, as
# PyTorch Geometric's QM9 gives them.
QM9_TARGETS: dict[str, tuple[str, float, str]] = {
    "gap": ("HOMO_LUMO_gap_au", HARTREE_TO_EV, "eV"),
    "homo": ("HOMO_au", HARTREE_TO_EV, "eV"),
    "lumo": ("LUMO_au", HARTREE_TO_EV, "eV"),
    "mu": ("Dipole_debye", 1.0, "D"),
    "alpha": ("Polarizability_bohr3", 1.0, "bohr^3"),
    "r2": ("R2_bohr2", 1.0, "bohr^2"),
    "zpve": ("ZPVE_au", HARTREE_TO_EV, "eV"),
    "u0": ("InternalEnergy_0K_au", HARTREE_TO_EV, "eV"),
    "u298": ("InternalEnergy_298K_au", HARTREE_TO_EV, "eV"),
    "h298": ("Enthalphy_298K_au", HARTREE_TO_EV, "eV"),
    "g298": ("GibbsFreeEnergy_298K_au", HARTREE_TO_EV, "eV"),
    "cv": ("Heatcapacity_Cv_cal_mol_K", 1.0, "cal/(mol K)"),
}
# Numeric per-molecule columns of qm9pack's CSVs, in their own units.
QM9_COLUMNS = (
    "RotA_GHz",
    "RotB_GHz",
    "RotC_GHz",
    "Dipole_debye",
    "Polarizability_bohr3",
    "HOMO_au",
    "LUMO_au",
    "HOMO_LUMO_gap_au",
    "R2_bohr2",
    "ZPVE_au",
    "InternalEnergy_0K_au",
    "InternalEnergy_298K_au",
    "Enthalphy_298K_au",
    "GibbsFreeEnergy_298K_au",
    "Heatcapacity_Cv_cal_mol_K",
)
QM9_TOTAL = 130_831


def package_dir(package: str, install_hint: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def package_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def file_identity(path: Path) -> dict[str, object]:
    """What identifies a source file in a cache key (hashing 100s of MB each time is too slow)."""
    return {"name": path.name, "size": path.stat().st_size}


# --- MOSES -------------------------------------------------------------------------------------


def moses_file(split: str = "train") -> Path:
    """MOSES's SMILES file (`train`: 1,584,663 molecules; `test`: 176,074) from `molsets`."""
    hint = "pip install --no-deps molsets==0.3.1 (make setup does)"
    path = package_dir("moses", hint) / "dataset" / "data" / f"{split}.csv.gz"
    if not path.is_file():
        raise FileNotFoundError(f"MOSES file {path} is missing: {hint}")
    return path


def read_moses_smiles(path: Path) -> list[str]:
    """All SMILES of a MOSES csv.gz (header `SMILES`), in file order."""
    with gzip.open(path, "rt") as handle:
        lines = handle.read().splitlines()
    if not lines or lines[0].strip() != "SMILES":
        raise ValueError(f"{path} is not a MOSES SMILES file (header {lines[:1]})")
    return [line.strip() for line in lines[1:] if line.strip()]


# --- QM9 ---------------------------------------------------------------------------------------


def qm9_files() -> list[Path]:
    """qm9pack's three CSV parts, in order."""
    hint = "pip install --no-deps qm9pack==1.0.3 (make setup does)"
    data = package_dir("qm9pack", hint) / "data"
    paths = [data / f"qm9_part{i}.csv" for i in (1, 2, 3)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"QM9 files missing: {', '.join(missing)}: {hint}")
    return paths


def qm9_target_column(target: str, header: list[str]) -> tuple[str, float]:
    """CSV column and unit factor for a target name (friendly name or a numeric CSV column)."""
    if target in QM9_TARGETS:
        column, factor, _ = QM9_TARGETS[target]
        return column, factor
    numeric = [c for c in QM9_COLUMNS if c in header]
    if target in numeric:
        return target, 1.0
    raise ValueError(
        f"unknown QM9 target {target!r}; choose one of {', '.join(QM9_TARGETS)} "
        f"(energies in eV) or a CSV column: {', '.join(numeric)}"
    )


def iter_qm9_rows(paths: list[Path], target: str) -> Iterator[tuple[str, float]]:
    """(SMILES, target value) for every QM9 molecule, in file order."""
    csv.field_size_limit(10**9)  # the XYZ and frequency fields are long
    column = factor = None
    for path in paths:
        with open(path, newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader)
            if column is None:
                column, factor = qm9_target_column(target, header)
            smiles_at, target_at = header.index("SMILES"), header.index(column)
            for row in reader:
                yield row[smiles_at], float(row[target_at]) * factor


# --- ZINC --------------------------------------------------------------------------------------


def zinc_raw_dir(zinc_dir: str | os.PathLike | None, subset: bool) -> Path:
    """The directory holding PyG's raw ZINC files, checked; a clear error when absent.

    Accepts the directory of the files itself, a PyG root (files under `raw/`), or the folder
    that PyG's `molecules.zip` extracts to (`molecules/`).
    """
    given = zinc_dir if zinc_dir is not None else os.environ.get(ZINC_ENV_VAR)
    needed = ZINC_PICKLES + (ZINC_INDEXES if subset else ())
    what = (
        f"PyG's raw ZINC files {', '.join(needed)} (molecules.zip from the ZINC benchmark of "
        "Dwivedi et al., extracted, plus the split .index files for the 12k subset), the layout "
        "torch_geometric.datasets.ZINC keeps under <root>/raw/"
    )
    if not given:
        raise FileNotFoundError(
            f"ZINC needs {what}; nothing is downloaded. Put them in a directory and pass it as "
            f"zinc_dir=... (or --zinc-dir) or set {ZINC_ENV_VAR}."
        )
    base = Path(given).expanduser()
    for candidate in (base, base / "raw", base / "molecules"):
        if all((candidate / name).is_file() for name in needed):
            return candidate
    missing = [name for name in needed if not (base / name).is_file()]
    raise FileNotFoundError(
        f"ZINC files not found in {base} (nor in {base / 'raw'}): missing {', '.join(missing)}. "
        f"Expected {what}."
    )
