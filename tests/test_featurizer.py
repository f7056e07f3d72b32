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
