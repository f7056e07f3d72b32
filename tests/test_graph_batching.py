"""Dense batching: a graph's tensors do not depend on the other graphs in its batch or on the
padding; paths unroll to the stored shortest paths; degrees match RDKit."""

import pytest
import rdkit  # noqa: F401  (an extra `make test` installs: missing, it fails here)
import torch
import torch_geometric  # noqa: F401  (an extra `make test` installs: missing, it fails here)
from torch_geometric.data import Batch, Data
from torch_geometric.loader import DataLoader

from urpe.data.molecules import smiles_to_graph
from urpe.graph import NO_EDGE, UNREACHABLE, ShortestPaths, to_dense_graph_batch

from .graph_reference import SMILES


def graphs(features="rdkit"):
    out = []
    for smiles in SMILES:
        data, mol = smiles_to_graph(smiles, features)
        data.degrees = torch.tensor([a.GetDegree() for a in mol.GetAtoms()])
        out.append(ShortestPaths()(data))
    return out


def crop(dense, b, n):
    """Graph b's own part of a dense batch, edges given by their features."""
    return {
        "x": dense.x[b, :n],
        "in_degree": dense.in_degree[b, :n],
        "spd": dense.spd[b, :n, :n],
        "path_features": dense.path_edge_features()[b, :n, :n],
        "path_length": dense.path_length[b, :n, :n],
    }


def test_a_graphs_tensors_do_not_depend_on_its_batch():
    data = graphs()
    alone = [to_dense_graph_batch(Batch.from_data_list([g]), max_hops=4) for g in data]
    for order in (list(range(len(data))), list(reversed(range(len(data))))):
        together = to_dense_graph_batch(Batch.from_data_list([data[i] for i in order]), 4)
        assert together.max_nodes == max(g.num_nodes for g in data)
        for b, i in enumerate(order):
            n = data[i].num_nodes
            mine, reference = crop(together, b, n), crop(alone[i], 0, n)
            for key in mine:
                assert torch.equal(mine[key], reference[key]), (SMILES[i], key)
            assert not together.padding_mask[b, :n].any()
            assert together.padding_mask[b, n:].all()
            assert (together.spd[b, n:] == UNREACHABLE).all()
            assert (together.spd[b, :, n:] == UNREACHABLE).all()
            assert (together.path_edges[b, n:] == NO_EDGE).all()


def test_paths_unroll_to_stored_paths_truncated_at_max_hops():
    data = graphs()
    batch = Batch.from_data_list(data)
    dense = to_dense_graph_batch(batch, max_hops=3)
    offset = 0
    for b, g in enumerate(data):
        n = g.num_nodes
        next_edge = g.path_next_edge.view(n, n).long()
        spd = g.spd.view(n, n).long()
        for i in range(n):
            for j in range(n):
                here, expected = i, []
                while next_edge[here, j] >= 0 and len(expected) < 3:
                    e = int(next_edge[here, j])
                    expected.append(e + offset)
                    here = int(g.edge_index[1, e])
                got = dense.path_edges[b, i, j]
                assert got[: len(expected)].tolist() == expected
                assert (got[len(expected) :] == NO_EDGE).all()
                assert dense.path_length[b, i, j] == (
                    min(int(spd[i, j]), 3) if spd[i, j] > 0 else 0
                )
        offset += g.edge_index.shape[1]


def test_degrees_match_rdkit():
    data = graphs()
    dense = to_dense_graph_batch(Batch.from_data_list(data))
    for b, g in enumerate(data):
        n = g.num_nodes
        assert torch.equal(dense.in_degree[b, :n], g.degrees)
        assert torch.equal(dense.out_degree[b, :n], g.degrees)


def test_works_on_a_dataloader_batch_and_a_single_graph():
    data = graphs("zinc")
    batch = next(iter(DataLoader(data, batch_size=4, shuffle=False)))
    dense = to_dense_graph_batch(batch)
    assert dense.x.shape[:2] == dense.padding_mask.shape and dense.x.shape[0] == 4
    assert dense.edge_attr.shape == (batch.edge_index.shape[1], 1)
    single = to_dense_graph_batch(data[0], max_hops=0)
    assert single.x.shape[0] == 1 and single.path_edges.shape[-1] == 0


def test_missing_shortest_paths_is_a_clear_error():
    data, _ = smiles_to_graph("CCO")
    with pytest.raises(ValueError, match="ShortestPaths"):
        to_dense_graph_batch(Batch.from_data_list([data]))
    broken = ShortestPaths()(smiles_to_graph("CCO")[0])
    broken.x = torch.cat([broken.x, broken.x[:1]])  # a node added after the transform
    with pytest.raises(ValueError, match="N\\*N"):
        to_dense_graph_batch(Batch.from_data_list([broken]))
    with pytest.raises(ValueError, match="max_hops"):
        to_dense_graph_batch(Batch.from_data_list([ShortestPaths()(data)]), max_hops=-1)


def test_graph_without_edges_in_a_batch():
    lonely = ShortestPaths()(
        Data(x=torch.zeros(2, 1, dtype=torch.long), edge_index=torch.zeros(2, 0, dtype=torch.long))
    )
    data = graphs("zinc")[:2]
    lonely.edge_attr = torch.zeros(0, 1, dtype=torch.long)
    dense = to_dense_graph_batch(Batch.from_data_list([lonely, *data]))
    assert dense.spd[0, :2, :2].tolist() == [[0, -1], [-1, 0]]
    assert (dense.path_edges[0] == NO_EDGE).all()


def test_pad_nodes_is_pygs_to_dense_batch():
    from torch_geometric.utils import to_dense_batch

    from urpe.graph.batching import pad_nodes

    generator = torch.Generator().manual_seed(0)
    for sizes in ([3, 0, 5, 1], [1], [0, 2], [4, 4]):
        node_graph = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        values = torch.randn(sum(sizes), 2, 3, generator=generator)
        dense, real = pad_nodes(values, node_graph, len(sizes))
        expected, expected_real = to_dense_batch(values, node_graph, batch_size=len(sizes))
        assert torch.equal(dense, expected) and torch.equal(real, expected_real)


def test_collate_graphs_batches_as_pyg_does():
    """`collate_graphs` of `Graph`s gives the dense batch that PyG's `Batch` of the same graphs
    gives, on every field, paths included."""
    from urpe.graph import Graph, collate_graphs

    data = graphs()
    plain = [Graph(d.x, d.edge_index, d.edge_attr, d.spd, d.path_next_edge) for d in data]
    ours = to_dense_graph_batch(collate_graphs(plain), max_hops=4)
    theirs = to_dense_graph_batch(Batch.from_data_list(data), max_hops=4)
    for name in ("x", "padding_mask", "in_degree", "out_degree", "spd", "path_edges", "edge_attr"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    with pytest.raises(ValueError, match="at least one graph"):
        collate_graphs([])
