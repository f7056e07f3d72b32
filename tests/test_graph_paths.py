"""Shortest paths: distances against RDKit and networkx, canonical paths against networkx's
enumeration of all shortest paths, on real molecules (salts and single atoms included)."""

import gzip
import importlib.util
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch
import torch_geometric  # noqa: F401  (an extra `make test` installs: missing, it fails here)
from rdkit import Chem
from torch_geometric.data import Data

from urpe.data.molecules import smiles_to_graph
from urpe.graph import FAR, UNREACHABLE, ShortestPaths, paths, shortest_paths

from .graph_reference import SMILES, lexmin_feature_path, to_networkx


def moses_sample(count: int, seed: int = 1) -> list[str]:
    spec = importlib.util.find_spec("moses")
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset/data/test.csv.gz"
    with gzip.open(path, "rt") as handle:
        lines = handle.read().splitlines()[1:]
    picks = np.random.default_rng(seed).choice(len(lines), count, replace=False)
    return [lines[i] for i in picks]


def walk(next_edge: np.ndarray, edge_index: np.ndarray, i: int, j: int) -> list[int]:
    """Edges of the stored path from i to j, followed one at a time."""
    edges, here = [], i
    while next_edge[here, j] >= 0:
        edge = int(next_edge[here, j])
        assert edge_index[0, edge] == here
        edges.append(edge)
        here = int(edge_index[1, edge])
        assert len(edges) <= next_edge.shape[0]
    assert here == j or not edges
    return edges


@pytest.mark.parametrize("features", ["zinc", "rdkit"])
def test_spd_matches_rdkit_distance_matrix(features):
    for smiles in SMILES + moses_sample(25):
        data, mol = smiles_to_graph(smiles, features)
        data = ShortestPaths()(data)
        n = data.num_nodes
        spd = data.spd.view(n, n).long().numpy()
        expected = Chem.GetDistanceMatrix(mol)  # 1e8 marks disconnected pairs
        expected = np.where(expected > 1e6, UNREACHABLE, expected).astype(np.int64)
        np.testing.assert_array_equal(spd, expected, err_msg=smiles)


def test_paths_are_lexicographically_smallest_shortest_paths():
    for smiles in SMILES + moses_sample(8, seed=2):
        data, _ = smiles_to_graph(smiles, "rdkit")  # 3 bond features: many distinct sequences
        data = ShortestPaths()(data)
        n = data.num_nodes
        spd = data.spd.view(n, n).long().numpy()
        next_edge = data.path_next_edge.view(n, n).long().numpy()
        graph = to_networkx(data)
        edge_index = data.edge_index.numpy()
        attr = data.edge_attr.numpy()
        for i in range(n):
            for j in range(n):
                expected = lexmin_feature_path(graph, i, j)
                edges = walk(next_edge, edge_index, i, j)
                if expected is None:
                    assert spd[i, j] == UNREACHABLE and edges == []
                    continue
                assert len(edges) == spd[i, j]
                assert [tuple(attr[e].tolist()) for e in edges] == expected, (smiles, i, j)


def test_directed_graph_with_self_loop_and_parallel_edges():
    # 0 -> 1 -> 2, 0 -> 2 twice (features 5 and 3), a self-loop on 1, 3 isolated, 2 -> 0.
    edge_index = torch.tensor([[0, 1, 0, 0, 1, 2], [1, 2, 2, 2, 1, 0]])
    edge_attr = torch.tensor([[1], [1], [5], [3], [0], [2]])
    spd, next_edge = shortest_paths(edge_index, 4, edge_attr)
    graph = nx.DiGraph(edge_index.t().tolist())
    graph.add_node(3)
    for i in range(4):
        for j in range(4):
            d = nx.shortest_path_length(graph, i, j) if nx.has_path(graph, i, j) else -1
            assert spd[i, j] == d
    assert next_edge[0, 2] == 3  # the parallel edge with the smaller feature
    assert next_edge[1, 0] == 1 and next_edge[1, 1] == -1  # self-loops never lie on a path
    assert next_edge[3, 0] == -1 and spd[0, 3] == UNREACHABLE


def test_empty_and_edgeless_graphs():
    spd, next_edge = shortest_paths(torch.zeros(2, 0, dtype=torch.long), 3)
    assert (np.diag(spd) == 0).all() and (spd[~np.eye(3, dtype=bool)] == UNREACHABLE).all()
    assert (next_edge == -1).all()
    data = ShortestPaths()(
        Data(x=torch.zeros(1, 1), edge_index=torch.zeros(2, 0, dtype=torch.long))
    )
    assert data.spd.tolist() == [0] and data.path_next_edge.tolist() == [-1]


def test_max_distance_marks_far_pairs_and_keeps_their_paths():
    chain = Data(x=torch.zeros(6, 1), edge_index=torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]))
    data = ShortestPaths(max_distance=2)(chain)
    spd = data.spd.view(6, 6)
    assert spd[0, 2] == 2 and spd[0, 3] == FAR and spd[3, 0] == UNREACHABLE
    assert data.path_next_edge.view(6, 6)[0, 5] == 0


def test_relabelling_nodes_permutes_the_chosen_paths_features():
    data, _ = smiles_to_graph("c1ccc2cc(C(=O)N)ccc2c1", "rdkit")
    n = data.num_nodes
    perm = torch.randperm(n)  # new node k is old node perm[k]
    inverse = torch.argsort(perm)
    permuted = Data(x=data.x[perm], edge_index=inverse[data.edge_index], edge_attr=data.edge_attr)
    features = []
    for graph in (data, permuted):
        graph = ShortestPaths()(graph)
        next_edge = graph.path_next_edge.view(n, n).long().numpy()
        features.append(
            {
                (i, j): [
                    tuple(graph.edge_attr[e].tolist())
                    for e in walk(next_edge, graph.edge_index.numpy(), i, j)
                ]
                for i in range(n)
                for j in range(n)
            }
        )
    for i in range(n):
        for j in range(n):
            assert features[1][(i, j)] == features[0][(int(perm[i]), int(perm[j]))]


def test_bad_edge_index_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        shortest_paths(torch.tensor([[0], [5]]), 3)
    with pytest.raises(ValueError, match="rows"):
        shortest_paths(torch.tensor([[0], [1]]), 3, torch.zeros(2, 1))


def scipy_distances(edge_index: np.ndarray, n: int) -> np.ndarray:
    """SciPy's breadth-first distances (what urpe used for every graph before), UNREACHABLE
    where none."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import shortest_path

    src, dst = edge_index
    adjacency = coo_matrix((np.ones(src.size), (src, dst)), shape=(n, n)).tocsr()
    dist = shortest_path(adjacency, directed=True, unweighted=True)
    return np.where(np.isfinite(dist), dist, UNREACHABLE).astype(np.int64)


def test_dense_search_equals_scipy_on_molecules_and_odd_graphs():
    """Distances from dense matrix products (graphs up to DENSE_SEARCH_MAX_NODES) equal SciPy's
    on real molecules and on directed graphs with self-loops, repeated edges, isolated nodes
    and several parts."""
    graphs = []
    for smiles in SMILES + moses_sample(40, seed=3):
        data, _ = smiles_to_graph(smiles, "zinc")
        graphs.append((data.edge_index.numpy(), data.num_nodes))
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 40))
        graphs.append((rng.integers(0, n, size=(2, int(rng.integers(0, 3 * n)))), n))
    chain = np.arange(paths.DENSE_SEARCH_MAX_NODES - 1)
    graphs.append((np.stack([chain, chain + 1]), paths.DENSE_SEARCH_MAX_NODES))  # deepest
    for edge_index, n in graphs:
        dense = paths.distances(edge_index[0], edge_index[1], n)
        np.testing.assert_array_equal(dense, scipy_distances(edge_index, n))


def test_large_graphs_are_searched_by_scipy(monkeypatch):
    """Above DENSE_SEARCH_MAX_NODES SciPy searches; both routes give the same paths."""
    rng = np.random.default_rng(1)
    n = paths.DENSE_SEARCH_MAX_NODES + 20
    edge_index = rng.integers(0, n, size=(2, 3 * n))
    edge_attr = rng.integers(0, 3, size=(3 * n, 1))
    large = shortest_paths(edge_index, n, edge_attr)
    monkeypatch.setattr(paths, "DENSE_SEARCH_MAX_NODES", n)  # the dense route for this graph
    dense = shortest_paths(edge_index, n, edge_attr)
    np.testing.assert_array_equal(large[0], scipy_distances(edge_index, n))
    np.testing.assert_array_equal(large[0], dense[0])
    np.testing.assert_array_equal(large[1], dense[1])
