"""`MoleculeFeaturizer`: the one object that turns SMILES into a Graphormer's input (the graph
with its features, then the shortest paths), the same for every dataset, the user's files and
a trained model; its record is plain JSON."""

import json

import pytest
import torch

from urpe.data.molecules import MoleculeFeaturizer, load_molecules, smiles_to_graph
from urpe.graph import ShortestPaths

SMILES = ["CCO", "c1ccccc1C#N", "C1CCCCC1N", "[NH3+]CC(=O)[O-]", "c1ccc2ccccc2c1"]
FIELDS = ("x", "edge_index", "edge_attr", "spd", "path_next_edge")


def same_graph(a, b) -> bool:
    return all(torch.equal(getattr(a, name), getattr(b, name)) for name in FIELDS)


@pytest.mark.parametrize("features, max_distance", [("zinc", None), ("rdkit", 3)])
def test_it_is_the_featurised_graph_then_its_shortest_paths(features, max_distance):
    featurizer = MoleculeFeaturizer(features, max_distance)
    for smiles in SMILES:
        graph = featurizer(smiles)
        expected = ShortestPaths(max_distance=max_distance)(smiles_to_graph(smiles, features)[0])
        assert same_graph(graph, expected) and graph.smiles == smiles
    assert featurizer("not_a_smiles") is None and featurizer("") is None
    # a graph already featurised (PyG's ZINC) gets the relation alone
    plain = smiles_to_graph("CCO", features)[0]
    assert same_graph(featurizer(plain), ShortestPaths(max_distance=max_distance)(plain))
    assert not hasattr(plain, "spd")  # a transform does not change its input
    assert featurizer.spec.node_cardinalities[0] == (29 if features == "zinc" else 119)


def test_without_shortest_paths_it_stops_at_the_graph():
    graph = MoleculeFeaturizer(shortest_paths=False)("CCO")
    assert graph.x.shape == (3, 1) and not hasattr(graph, "spd")


def test_its_record_is_json_and_makes_the_same_featurizer():
    featurizer = MoleculeFeaturizer("rdkit", max_distance=4)
    record = json.loads(json.dumps(featurizer.to_dict()))
    assert record == {"features": "rdkit", "max_distance": 4, "shortest_paths": True}
    again = MoleculeFeaturizer.from_dict(record)
    assert again == featurizer and same_graph(again("CCO"), featurizer("CCO"))
    with pytest.raises(ValueError, match="features must be one of zinc, rdkit"):
        MoleculeFeaturizer("morgan")
    with pytest.raises(ValueError, match="unknown featuriser settings"):
        MoleculeFeaturizer.from_dict({"features": "zinc", "radius": 2})


def test_graphs_keeps_rdkit_quiet_and_marks_what_it_cannot_read(capfd):
    graphs = MoleculeFeaturizer().graphs(["CCO", "C1CC", "c1ccccc1"])
    assert graphs[1] is None and graphs[0].num_nodes == 3 and graphs[2].num_nodes == 6
    assert capfd.readouterr().err == ""


def test_a_dataset_is_made_by_its_featurizer_and_keeps_it(tmp_path):
    data = load_molecules(
        "moses-plogp", sizes=(12, 4, 4), max_distance=6, cache_dir=tmp_path, progress=False
    )
    assert data.featurizer == MoleculeFeaturizer("zinc", max_distance=6)
    assert data.features == "zinc" and data.feature_spec == data.featurizer.spec
    for graph in data.val:
        assert same_graph(graph, data.featurizer(graph.smiles))
    # cache entries keep the key they had before the featuriser named their transform
    key = data.info["key_inputs"]
    assert key["transform"] == "ShortestPaths(max_distance=6, use_edge_attr=True)"


# Molecules whose atoms and bonds reach the lists' ends: charges, radicals, stereo bonds and
# centres, a triple bond, a salt, an aromatic heterocycle, hypervalent S and P, a metal, and ones
# outside a list (charge +7, a dative bond) or without a Kekulé form.
EDGE_CASES = [
    "C[C@H](N)C(=O)O",
    "F/C=C/F",
    "C#N",
    "[CH2]C",
    "[C]",
    "[NH4+].[Cl-]",
    "c1ccncc1",
    "CS(=O)(=O)O",
    "OP(=O)(O)O",
    "[Fe+2]",
    "[Cr+7]",
    "[NH3]->[Cu]",
    "c1cccc1",
]


def pyg_reference(smiles, features):
    """The graph PyG's own `from_rdmol` makes (the "zinc" columns derived from it as before)."""
    from rdkit import Chem
    from torch_geometric.utils.smiles import e_map, from_rdmol

    from urpe.data.molecules.featurize import OTHER_BOND, ZINC_BOND_TYPES, zinc_atom_type

    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return None
    try:
        if features == "rdkit":
            return from_rdmol(mol)
        Chem.Kekulize(mol, clearAromaticFlags=True)
        data = from_rdmol(mol)
    except ValueError:  # a value outside PyG's lists; KekulizeException is a ValueError
        return None
    data.x = torch.tensor([[zinc_atom_type(a)] for a in mol.GetAtoms()]).view(-1, 1)
    codes = torch.tensor([ZINC_BOND_TYPES.get(n, OTHER_BOND) for n in e_map["bond_type"]])
    data.edge_attr = codes[data.edge_attr[:, 0]].view(-1, 1)
    return data


@pytest.mark.parametrize("features", ["zinc", "rdkit"])
def test_tensors_are_pyg_from_rdmol_made_without_pyg(features):
    """`molecule_tensors` (torch and RDKit only) equals PyG's `from_rdmol` column by column, on
    MOSES molecules and edge cases, and refuses what it refuses."""
    from rdkit import Chem, RDLogger
    from torch_geometric.utils.smiles import e_map, x_map

    from urpe.data.molecules import FEATURIZATIONS, molecule_tensors

    from .test_graph_paths import moses_sample

    RDLogger.DisableLog("rdApp.*")
    spec = FEATURIZATIONS["rdkit"]
    assert spec.node_cardinalities == tuple(len(v) for v in x_map.values())
    assert spec.edge_cardinalities == tuple(len(v) for v in e_map.values())
    refused = 0
    for smiles in SMILES + EDGE_CASES + moses_sample(60, seed=3):
        expected = pyg_reference(smiles, features)
        mol = Chem.MolFromSmiles(smiles)
        got = None if mol is None else molecule_tensors(mol, features)
        if expected is None:
            assert got is None, smiles
            refused += 1
            continue
        for name in ("x", "edge_index", "edge_attr"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (smiles, name)
    assert refused >= 2  # "[Cr+7]" and the dative bond, at least


def test_tensors_are_the_graphs_with_their_paths():
    featurizer = MoleculeFeaturizer("rdkit", max_distance=3)
    graphs, tensors = featurizer.graphs(SMILES + ["C1CC"]), featurizer.tensors(SMILES + ["C1CC"])
    assert tensors[-1] is None and graphs[-1] is None
    for graph, plain in zip(graphs[:-1], tensors[:-1], strict=True):
        assert type(plain).__module__ == "urpe.graph.batching" and same_graph(plain, graph)
