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
    smiles_to_graph,
    zinc_atom_type,
)
from .featurizer import MoleculeFeaturizer
from .files import (
    MoleculeFile,
    MoleculeFileError,
    load_molecule_file,
    read_molecule_file,
    skipped_summary,
)
from .splits import SPLITS, GraphSplit, MoleculeDataset
from .tables import MoleculeRow, MoleculeTable
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
    "molecule_unit",
    "penalized_logp",
    "penalized_logp_normalized",
    "read_molecule_file",
    "skipped_summary",
    "smiles_to_graph",
    "zinc_atom_type",
]
