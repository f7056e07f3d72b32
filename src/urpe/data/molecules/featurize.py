"""Molecules (RDKit) to graphs (PyTorch Geometric `Data`) with categorical features.

Two featurisations, declared in `FEATURIZATIONS`:

- "zinc" (default): the inputs of the ZINC benchmark (Dwivedi et al.'s split of the JT-VAE
  molecules, PyG's `ZINC`), so that MOSES and QM9 molecules look like ZINC's to a model:
  x = (N, 1) atom type, one of ZINC's 28 types (element, hydrogens written in a bracket atom,
  charge sign: "C", "C H1", "N H1 +", "O -", ...) plus 28 = "other" for anything else;
  edge_attr = (E, 1) bond type of the Kekulé structure, ZINC's codes 1 single, 2 double,
  3 triple, plus 4 = "other". A bracket atom whose combination is not one of the 28 falls back
  to its element with the charge, then its element (e.g. aromatic [nH] -> "N").
- "rdkit": PyTorch Geometric's `from_rdmol` features of the aromatic molecule (9 atom columns:
  atomic number, chirality, degree, formal charge, hydrogens, radicals, hybridisation,
  aromaticity, ring membership; 3 bond columns: type, stereo, conjugation).

Both list atoms in RDKit's order and both directions of every bond, sorted as `from_rdmol` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rdkit import Chem
from torch_geometric.data import Data
from torch_geometric.utils.smiles import e_map, from_rdmol, x_map

# ZINC's atom dictionary (benchmarking-gnns' molecules data, index = atom type).
ZINC_ATOM_TYPES: tuple[str, ...] = (
    "C",
    "O",
    "N",
    "F",
    "C H1",
    "S",
    "Cl",
    "O -",
    "N H1 +",
    "Br",
    "N H3 +",
    "N H2 +",
    "N +",
    "N -",
    "S -",
    "I",
    "P",
    "O H1 +",
    "N H1 -",
    "O +",
    "S +",
    "P H1",
    "P H2",
    "C H2 -",
    "P +",
    "S H1 +",
    "C H1 -",
    "P H1 +",
)
OTHER_ATOM = len(ZINC_ATOM_TYPES)  # 28
ZINC_BOND_TYPES = {"SINGLE": 1, "DOUBLE": 2, "TRIPLE": 3}  # 0 is "no bond" in ZINC's matrices
OTHER_BOND = 4
_ATOM_INDEX = {name: i for i, name in enumerate(ZINC_ATOM_TYPES)}
# from_rdmol's bond-type column (an index into e_map["bond_type"]) -> ZINC's bond code.
_BOND_CODE = torch.tensor(
    [ZINC_BOND_TYPES.get(name, OTHER_BOND) for name in e_map["bond_type"]], dtype=torch.long
)


@dataclass(frozen=True)
class FeatureSpec:
    """Categories per column of x and edge_attr (what `GraphEncodingConfig` needs)."""

    node_cardinalities: tuple[int, ...]
    edge_cardinalities: tuple[int, ...]


FEATURIZATIONS: dict[str, FeatureSpec] = {
    "zinc": FeatureSpec((OTHER_ATOM + 1,), (OTHER_BOND + 1,)),
    "rdkit": FeatureSpec(
        tuple(len(values) for values in x_map.values()),
        tuple(len(values) for values in e_map.values()),
    ),
}


def zinc_atom_type(atom: Chem.Atom) -> int:
    """ZINC's atom type of an RDKit atom (`OTHER_ATOM` for elements ZINC does not have)."""
    symbol, charge = atom.GetSymbol(), atom.GetFormalCharge()
    hydrogens = atom.GetNumExplicitHs()
    sign = " +" if charge > 0 else " -" if charge < 0 else ""
    for key in (
        f"{symbol} H{hydrogens}{sign}" if hydrogens else f"{symbol}{sign}",
        f"{symbol}{sign}",
        symbol,
    ):
        if key in _ATOM_INDEX:
            return _ATOM_INDEX[key]
    return OTHER_ATOM


def mol_to_graph(mol: Chem.Mol, features: str = "zinc") -> Data | None:
    """A molecule as a graph, or None if RDKit cannot featurise it (no Kekulé form, a value
    outside PyG's feature lists).

    Returns:
        Data with x (N, F) long, edge_index (2, E) long, edge_attr (E, Fe) long.
    """
    if features not in FEATURIZATIONS:
        raise ValueError(f"features must be one of {sorted(FEATURIZATIONS)}, got {features!r}")
    try:
        if features == "rdkit":
            return from_rdmol(mol)
        kekule = Chem.Mol(mol)
        Chem.Kekulize(kekule, clearAromaticFlags=True)
        data = from_rdmol(kekule)
    except (ValueError, Chem.KekulizeException):
        return None
    data.x = torch.tensor(
        [zinc_atom_type(atom) for atom in kekule.GetAtoms()], dtype=torch.long
    ).view(-1, 1)  # (N, 1)
    data.edge_attr = _BOND_CODE[data.edge_attr[:, 0]].view(-1, 1)  # (E, 1)
    return data


def smiles_to_graph(smiles: str, features: str = "zinc") -> tuple[Data, Chem.Mol] | None:
    """Parse and featurise a SMILES string; None when RDKit rejects it."""
    mol = Chem.MolFromSmiles(smiles)
    if mol is None or mol.GetNumAtoms() == 0:
        return None
    data = mol_to_graph(mol, features)
    if data is None:
        return None
    return data, mol
