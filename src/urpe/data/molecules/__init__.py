"""Molecule graphs for graph regression, real and offline (extra `graph`: RDKit, PyTorch
Geometric; data from the `molsets` and `qm9pack` packages or the user's ZINC files).

    from urpe.data.molecules import load_molecules
    data = load_molecules("moses-plogp", sizes=(1000, 200, 200))   # cached after the first call
    loader = torch_geometric.loader.DataLoader(data.train, batch_size=64, shuffle=True)

See `datasets` for what each name is, `featurize` for the inputs, `featurizer` for the one object
that turns a SMILES into a model's input (`MoleculeFeaturizer`), `splits` for what a built
dataset holds, `files` for the user's own molecules, `targets` for penalised logP, `cache` for
where derived data lives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> its module. Imported on first use: a trained model's predictions read SMILES
# through `featurizer` and `tables` alone, which import neither PyTorch Geometric nor the
# datasets (whose import takes seconds).
_SOURCES = {
    "cache_root": "cache",
    **dict.fromkeys(
        ("MOLECULE_DATASETS", "MoleculeSource", "load_molecules", "molecule_unit"), "datasets"
    ),
    **dict.fromkeys(
        (
            "FEATURIZATIONS",
            "OTHER_ATOM",
            "OTHER_BOND",
            "ZINC_ATOM_TYPES",
            "ZINC_BOND_TYPES",
            "FeatureSpec",
            "mol_to_graph",
            "molecule_tensors",
            "smiles_to_graph",
            "zinc_atom_type",
        ),
        "featurize",
    ),
    "MoleculeFeaturizer": "featurizer",
    **dict.fromkeys(
        ("MoleculeFile", "load_molecule_file", "read_molecule_file", "skipped_summary"), "files"
    ),
    **dict.fromkeys(("SPLITS", "GraphSplit", "MoleculeDataset"), "splits"),
    **dict.fromkeys(("MoleculeFileError", "MoleculeRow", "MoleculeTable"), "tables"),
    **dict.fromkeys(("penalized_logp", "penalized_logp_normalized"), "targets"),
}


def __getattr__(name: str) -> Any:
    if name in _SOURCES:
        return getattr(importlib.import_module(f".{_SOURCES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


if TYPE_CHECKING:
    from .cache import cache_root
    from .datasets import MOLECULE_DATASETS, MoleculeSource, load_molecules, molecule_unit
    from .featurize import (
        FEATURIZATIONS,
        OTHER_ATOM,
        OTHER_BOND,
        ZINC_ATOM_TYPES,
        ZINC_BOND_TYPES,
        FeatureSpec,
        mol_to_graph,
        molecule_tensors,
        smiles_to_graph,
        zinc_atom_type,
    )
    from .featurizer import MoleculeFeaturizer
    from .files import MoleculeFile, load_molecule_file, read_molecule_file, skipped_summary
    from .splits import SPLITS, GraphSplit, MoleculeDataset
    from .tables import MoleculeFileError, MoleculeRow, MoleculeTable
    from .targets import penalized_logp, penalized_logp_normalized

__all__ = [
    "FEATURIZATIONS",
    "MOLECULE_DATASETS",
    "OTHER_ATOM",
    "OTHER_BOND",
    "SPLITS",
    "ZINC_ATOM_TYPES",
    "ZINC_BOND_TYPES",
    "FeatureSpec",
    "GraphSplit",
    "MoleculeDataset",
    "MoleculeFeaturizer",
    "MoleculeFile",
    "MoleculeFileError",
    "MoleculeSource",
    "MoleculeRow",
    "MoleculeTable",
    "cache_root",
    "load_molecule_file",
    "load_molecules",
    "mol_to_graph",
    "molecule_tensors",
    "molecule_unit",
    "penalized_logp",
    "penalized_logp_normalized",
    "read_molecule_file",
    "skipped_summary",
    "smiles_to_graph",
    "zinc_atom_type",
]
