"""Molecules (RDKit) to graphs with categorical features.

Two featurisations, declared in `FEATURIZATIONS`:

- "zinc" (default): the inputs of the ZINC benchmark (Dwivedi et al.'s split of the JT-VAE
  molecules, PyG's `ZINC`), so that MOSES and QM9 molecules look like ZINC's to a model:
  x = (N, 1) atom type, one of ZINC's 28 types (element, hydrogens written in a bracket atom,
  charge sign: "C", "C H1", "N H1 +", "O -", ...) plus 28 = "other" for anything else;
  edge_attr = (E, 1) bond type of the Kekulé structure, ZINC's codes 1 single, 2 double,
  3 triple, plus 4 = "other". A bracket atom whose combination is not one of the 28 falls back
  to its element with the charge, then its element (e.g. aromatic [nH] -> "N").
- "rdkit": the RDKit features of PyTorch Geometric's `from_rdmol`, of the aromatic molecule (9
  atom columns: atomic number, chirality, degree, formal charge, hydrogens, radicals,
  hybridisation, aromaticity, ring membership; 3 bond columns: type, stereo, conjugation), with
  its category lists (`ATOM_CATEGORIES`, `BOND_CATEGORIES`), so models trained on either read
  the same numbers.

Both list atoms in RDKit's order and both directions of every bond, sorted by (source, target)
as `from_rdmol` sorts them. `molecule_tensors` needs torch and RDKit only (a trained model's
`predict` starts without PyTorch Geometric); `mol_to_graph` and `smiles_to_graph` wrap them in a
PyG `Data`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from rdkit import Chem

from ...graph.batching import Graph

if TYPE_CHECKING:
    from torch_geometric.data import Data

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

# The "rdkit" featurisation's categories per column, in from_rdmol's order: a column's value is
# the position of the atom's (bond's) property in its list; a property outside the list (an
# RDKit enum value the list lacks, a charge beyond -5..6) makes the molecule unfeaturisable.
ATOM_CATEGORIES: dict[str, tuple[Any, ...]] = {
    "atomic_num": tuple(range(119)),
    "chirality": tuple(
        "CHI_UNSPECIFIED CHI_TETRAHEDRAL_CW CHI_TETRAHEDRAL_CCW CHI_OTHER CHI_TETRAHEDRAL "
        "CHI_ALLENE CHI_SQUAREPLANAR CHI_TRIGONALBIPYRAMIDAL CHI_OCTAHEDRAL".split()
    ),
    "degree": tuple(range(11)),
    "formal_charge": tuple(range(-5, 7)),
    "num_hs": tuple(range(9)),
    "num_radical_electrons": tuple(range(5)),
    "hybridization": tuple("UNSPECIFIED S SP SP2 SP3 SP3D SP3D2 OTHER".split()),
    "is_aromatic": (False, True),
    "is_in_ring": (False, True),
}
BOND_CATEGORIES: dict[str, tuple[Any, ...]] = {
    "bond_type": tuple(
        "UNSPECIFIED SINGLE DOUBLE TRIPLE QUADRUPLE QUINTUPLE HEXTUPLE ONEANDAHALF TWOANDAHALF "
        "THREEANDAHALF FOURANDAHALF FIVEANDAHALF AROMATIC IONIC HYDROGEN THREECENTER DATIVEONE "
        "DATIVE DATIVEL DATIVER OTHER ZERO".split()
    ),
    "stereo": tuple("STEREONONE STEREOANY STEREOZ STEREOE STEREOCIS STEREOTRANS".split()),
    "is_conjugated": (False, True),
}
_ATOM_LOOKUP = [{value: i for i, value in enumerate(v)} for v in ATOM_CATEGORIES.values()]
_BOND_LOOKUP = [{value: i for i, value in enumerate(v)} for v in BOND_CATEGORIES.values()]


@dataclass(frozen=True)
class FeatureSpec:
    """Categories per column of x and edge_attr (what `GraphEncodingConfig` needs)."""

    node_cardinalities: tuple[int, ...]
    edge_cardinalities: tuple[int, ...]


FEATURIZATIONS: dict[str, FeatureSpec] = {
    "zinc": FeatureSpec((OTHER_ATOM + 1,), (OTHER_BOND + 1,)),
    "rdkit": FeatureSpec(
        tuple(len(values) for values in ATOM_CATEGORIES.values()),
        tuple(len(values) for values in BOND_CATEGORIES.values()),
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


def _rdkit_atom(atom: Chem.Atom) -> list[int]:
    """The "rdkit" columns of an atom; KeyError for a value outside its column's list."""
    values = (
        atom.GetAtomicNum(),
        str(atom.GetChiralTag()),
        atom.GetTotalDegree(),
        atom.GetFormalCharge(),
        atom.GetTotalNumHs(),
        atom.GetNumRadicalElectrons(),
        str(atom.GetHybridization()),
        atom.GetIsAromatic(),
        atom.IsInRing(),
    )
    return [lookup[value] for lookup, value in zip(_ATOM_LOOKUP, values, strict=True)]


def _rdkit_bond(bond: Chem.Bond) -> list[int]:
    """The "rdkit" columns of a bond; KeyError for a value outside its column's list."""
    values = (str(bond.GetBondType()), str(bond.GetStereo()), bond.GetIsConjugated())
    return [lookup[value] for lookup, value in zip(_BOND_LOOKUP, values, strict=True)]


def molecule_tensors(mol: Chem.Mol, features: str = "zinc") -> Graph | None:
    """A molecule as a `urpe.graph.Graph` of tensors, or None if it cannot be featurised (no
    Kekulé form, a value outside the "rdkit" lists: the "zinc" featurisation refuses those
    molecules too, as it always has, so a data set keeps the same molecules).

    Returns:
        Graph with x (N, F) long, edge_index (2, E) long, edge_attr (E, Fe) long.
    """
    if features not in FEATURIZATIONS:
        raise ValueError(f"features must be one of {sorted(FEATURIZATIONS)}, got {features!r}")
    try:
        if features == "zinc":
            mol = Chem.Mol(mol)
            Chem.Kekulize(mol, clearAromaticFlags=True)
        atoms = [_rdkit_atom(atom) for atom in mol.GetAtoms()]
        bonds = [_rdkit_bond(bond) for bond in mol.GetBonds()]
    except (KeyError, Chem.KekulizeException):
        return None
    if features == "zinc":
        atoms = [[zinc_atom_type(atom)] for atom in mol.GetAtoms()]
        kinds = BOND_CATEGORIES["bond_type"]
        bonds = [[ZINC_BOND_TYPES.get(kinds[columns[0]], OTHER_BOND)] for columns in bonds]
    pairs, codes = [], []
    for bond, code in zip(mol.GetBonds(), bonds, strict=True):
        i, j = bond.GetBeginAtomIdx(), bond.GetEndAtomIdx()
        pairs += [(i, j), (j, i)]
        codes += [code, code]
    spec, n = FEATURIZATIONS[features], len(atoms)
    x = torch.tensor(atoms, dtype=torch.long).view(n, len(spec.node_cardinalities))  # (N, F)
    edge_index = torch.tensor(pairs, dtype=torch.long).view(-1, 2).t()  # (2, E)
    edge_attr = torch.tensor(codes, dtype=torch.long).view(-1, len(spec.edge_cardinalities))
    # Both directions of every bond, sorted by (source, target): from_rdmol's order.
    order = (edge_index[0] * n + edge_index[1]).argsort()
    return Graph(x=x, edge_index=edge_index[:, order], edge_attr=edge_attr[order])


def mol_to_graph(mol: Chem.Mol, features: str = "zinc") -> Data | None:
    """`molecule_tensors` as a PyTorch Geometric `Data` (x, edge_index, edge_attr)."""
    from torch_geometric.data import Data

    graph = molecule_tensors(mol, features)
    return None if graph is None else Data(**graph.fields())


def parse_smiles(smiles: str) -> Chem.Mol | None:
    """RDKit's molecule of a SMILES string; None when RDKit rejects it or it has no atoms."""
    mol = Chem.MolFromSmiles(smiles)
    return None if mol is None or mol.GetNumAtoms() == 0 else mol


def smiles_to_graph(smiles: str, features: str = "zinc") -> tuple[Data, Chem.Mol] | None:
    """Parse and featurise a SMILES string; None when RDKit rejects it."""
    mol = parse_smiles(smiles)
    data = None if mol is None else mol_to_graph(mol, features)
    return None if data is None else (data, mol)
