"""Graphormer's encodings: against Graphormer's formulas written pair by pair, permutation
equivariance, batch independence, the relation index, and URPE's gate through urpe.attention."""

import pytest
import rdkit  # noqa: F401  (an extra `make test` installs: missing, it fails here)
import torch
import torch_geometric  # noqa: F401  (an extra `make test` installs: missing, it fails here)
from torch_geometric.data import Batch, Data

import urpe
from urpe.data.molecules import FEATURIZATIONS, smiles_to_graph
from urpe.graph import (
    FAR,
    UNREACHABLE,
    FeatureEncoder,
    GraphEncodingConfig,
    GraphormerEncodings,
    ShortestPaths,
    relation_index,
    to_dense_graph_batch,
)

from .graph_reference import SMILES, graphormer_bias_by_hand, to_networkx

SPEC = FEATURIZATIONS["rdkit"]


def encodings(max_distance=4, max_hops=3, heads=3, dim=8, directed=False):
    config = GraphEncodingConfig(
        dim=dim,
        num_heads=heads,
        node_cardinalities=SPEC.node_cardinalities,
        edge_cardinalities=SPEC.edge_cardinalities,
        max_distance=max_distance,
        max_hops=max_hops,
        max_degree=3,
        directed=directed,
        init_std=1.0,  # large values, so that a wrong entry cannot hide in rounding
    )
    return GraphormerEncodings(config).double()


def molecule(smiles):
    return ShortestPaths()(smiles_to_graph(smiles, "rdkit")[0])


def test_bias_equals_graphormer_by_hand():
    torch.manual_seed(1)
    module = encodings(max_distance=4, max_hops=3)
    data = [molecule(s) for s in SMILES]
    inputs = module(to_dense_graph_batch(Batch.from_data_list(data), max_hops=3))
    table = module.spatial.table.detach()  # (H, D + 4)
    edge_weight = module.edge.edge_encoder.table.weight.detach()  # (sum cards, H)
    edge_tables = list(torch.split(edge_weight, list(SPEC.edge_cardinalities)))
    for b, g in enumerate(data):
        n = g.num_nodes
        expected = graphormer_bias_by_hand(
            to_networkx(g),
            table[:, :7],
            table[:, 7],
            edge_tables,
            module.edge.hop_weights.detach(),
            max_distance=4,
            max_hops=3,
        )
        torch.testing.assert_close(inputs.bias[b, :, : n + 1, : n + 1], expected)


def test_node_inputs_graph_token_and_degrees():
    module = encodings()
    data = [molecule(s) for s in SMILES[:3]]
    inputs = module(to_dense_graph_batch(Batch.from_data_list(data)))
    node_weight = module.node_encoder.table.weight.detach()
    tables = torch.split(node_weight, list(SPEC.node_cardinalities))
    for b, g in enumerate(data):
        assert torch.equal(inputs.x[b, 0], module.graph_token.detach())
        degree = torch.zeros(g.num_nodes, dtype=torch.long).index_add_(
            0, g.edge_index[1], torch.ones(g.edge_index.shape[1], dtype=torch.long)
        )
        for i in range(g.num_nodes):
            expected = sum(t[v] for t, v in zip(tables, g.x[i].tolist(), strict=True))
            expected = expected + module.degree.in_degree.weight[min(int(degree[i]), 3)]
            torch.testing.assert_close(inputs.x[b, i + 1], expected.detach())
        assert not inputs.padding_mask[b, : g.num_nodes + 1].any()
        assert inputs.padding_mask[b, g.num_nodes + 1 :].all()


def test_relabelling_nodes_permutes_every_output():
    module = encodings()
    data = molecule("CC(C)Cc1ccc(cc1)C(C)C(=O)O.[Na+]")
    n = data.num_nodes
    perm = torch.randperm(n)
    inverse = torch.argsort(perm)
    relabelled = ShortestPaths()(
        Data(x=data.x[perm], edge_index=inverse[data.edge_index], edge_attr=data.edge_attr)
    )
    a = module(to_dense_graph_batch(data))
    b = module(to_dense_graph_batch(relabelled))
    positions = torch.cat([torch.zeros(1, dtype=torch.long), perm + 1])  # token stays first
    torch.testing.assert_close(b.x[0], a.x[0, positions])
    torch.testing.assert_close(b.bias[0], a.bias[0][:, positions][:, :, positions])
    assert torch.equal(b.relation[0], a.relation[0][positions][:, positions])


def test_outputs_do_not_depend_on_the_batch():
    module = encodings()
    data = [molecule(s) for s in SMILES]
    together = module(to_dense_graph_batch(Batch.from_data_list(data)))
    for b, g in enumerate(data):
        alone = module(to_dense_graph_batch(Batch.from_data_list([g])))
        m = g.num_nodes + 1
        torch.testing.assert_close(together.x[b, :m], alone.x[0])
        torch.testing.assert_close(together.bias[b, :, :m, :m], alone.bias[0])
        assert torch.equal(together.relation[b, :m, :m], alone.relation[0])


def test_relation_index_marks_far_unreachable_and_the_graph_token():
    spd = torch.tensor([[[0, 1, 5, FAR], [1, 0, UNREACHABLE, 2], [5, 3, 0, 1], [2, 2, 1, 0]]])
    index = relation_index(spd, max_distance=3)  # far 4, unreachable 5, token 6
    assert index.shape == (1, 5, 5)
    assert (index[0, 0] == 6).all() and (index[0, :, 0] == 6).all()
    assert index[0, 1:, 1:].tolist() == [[0, 1, 4, 4], [1, 0, 5, 2], [4, 3, 0, 1], [2, 2, 1, 0]]


def test_urpe_gate_of_ones_leaves_attention_unchanged_and_learns():
    module = encodings().float()
    inputs = module(to_dense_graph_batch(Batch.from_data_list([molecule(s) for s in SMILES])))
    batch, length = inputs.relation.shape[:2]
    heads = inputs.bias.shape[1]
    q, k, v = (torch.randn(batch, heads, length, 4) for _ in range(3))
    gate_table = torch.ones(heads, module.config.num_relations, requires_grad=True)
    gate = urpe.Relation(gate_table, inputs.relation)
    kwargs = dict(bias=inputs.bias, key_padding_mask=inputs.padding_mask, backend="reference")
    plain = urpe.attention(q, k, v, **kwargs)
    gated = urpe.attention(q, k, v, gate=gate, **kwargs)
    real_queries = (~inputs.padding_mask)[:, None, :, None].expand_as(plain)  # (B, H, L, D)
    torch.testing.assert_close(gated[real_queries], plain[real_queries])
    gated[real_queries].square().sum().backward()
    assert gate_table.grad.abs().sum() > 0
    assert module.spatial.table.grad.abs().sum() > 0
    assert module.edge.hop_weights.grad.abs().sum() > 0


def test_bad_inputs_are_clear_errors():
    encoder = FeatureEncoder(4, cardinalities=(3, 2))
    with pytest.raises(ValueError, match="column 1"):
        encoder(torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="2 feature columns"):
        encoder(torch.tensor([[0, 1, 1]]))
    with pytest.raises(TypeError, match="integers"):
        encoder(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="exactly one"):
        GraphEncodingConfig(dim=8, num_heads=2)
    with pytest.raises(ValueError, match="max_hops"):
        GraphEncodingConfig(dim=8, num_heads=2, node_features=3, max_hops=-1)
    module = encodings(max_hops=3)
    dense = to_dense_graph_batch(molecule("CCO"), max_hops=2)
    with pytest.raises(ValueError, match="max_hops=3"):
        module(dense)


def test_real_valued_features_and_directed_degrees():
    config = GraphEncodingConfig(
        dim=6, num_heads=2, node_features=3, edge_features=2, directed=True
    )
    module = GraphormerEncodings(config)
    data = ShortestPaths()(
        Data(
            x=torch.randn(3, 3),
            edge_index=torch.tensor([[0, 1], [1, 2]]),
            edge_attr=torch.randn(2, 2),
        )
    )
    dense = to_dense_graph_batch(data)
    assert dense.in_degree.tolist() == [[0, 1, 1]] and dense.out_degree.tolist() == [[1, 1, 0]]
    out = module(dense)
    assert out.bias.shape == (1, 2, 4, 4) and torch.isfinite(out.bias).all()
    assert out.relation[0, 3, 1] == config.max_distance + 2  # 2 -> 0 unreachable when directed
