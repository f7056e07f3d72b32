"""Graphormer (+ URPE): C = 1 equals plain Graphormer exactly, the gate learns, one layer's
attention against softmax(QK^T/sqrt(d) + B) * C written out by hand, permutation equivariance,
batch independence, parameter counts, checkpoint round trip, bad configs."""

import pytest
import torch
from torch_geometric.data import Batch, Data

import urpe
import urpe.graph
from urpe.data.molecules import FEATURIZATIONS, smiles_to_graph
from urpe.graph import (
    GRAPHORMER_PRESETS,
    Graphormer,
    GraphormerConfig,
    ShortestPaths,
    to_dense_graph_batch,
)

from .graph_reference import SMILES

SPEC = FEATURIZATIONS["zinc"]


def molecules(smiles=SMILES):
    return [ShortestPaths()(smiles_to_graph(s)[0]) for s in smiles]


def model(urpe=False, seed=0, **changes):
    config = GraphormerConfig(
        **{
            "num_layers": 2,
            "dim": 16,
            "ffn_dim": 24,
            "num_heads": 4,
            "attention_dropout": 0.0,
            "max_distance": 3,
            "max_hops": 3,
            "gate": "relation" if urpe else None,
            **changes,
        }
    )
    torch.manual_seed(seed)
    net = Graphormer(
        config,
        node_cardinalities=SPEC.node_cardinalities,
        edge_cardinalities=SPEC.edge_cardinalities,
    )
    return net.double().eval()


def randomise(net):
    """Non-trivial weights everywhere (Graphormer's 0.02 init makes every bias tiny)."""
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return net


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_urpe_with_gate_of_ones_equals_plain_graphormer_exactly(backend, norm_first):
    plain = randomise(model(backend=backend, norm_first=norm_first))
    gated = model(urpe=True, backend=backend, norm_first=norm_first)
    result = gated.load_state_dict(plain.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert sorted(result.missing_keys) == [f"layers.{i}.mixer.gate.table" for i in range(2)]
    batch = Batch.from_data_list(molecules())
    assert all(torch.equal(t, torch.ones_like(t)) for t in gated.gate_tables())
    assert torch.equal(gated(batch), plain(batch))
    # And a gate away from ones changes the predictions (the comparison above can fail).
    with torch.no_grad():
        gated.gate_tables()[0][:, 1] = 0.5
    assert not torch.allclose(gated(batch), plain(batch))


def test_every_layers_gate_gets_a_gradient():
    net = randomise(model(urpe=True))
    with torch.no_grad():
        for table in net.gate_tables():
            table.fill_(1.0)
    net(Batch.from_data_list(molecules())).square().sum().backward()
    first, last = net.gate_tables()
    # Layer 0: every relation these molecules have (distances 0..3, far, graph token) gets a
    # gradient in every head.
    assert (first.grad[:, [0, 1, 2, 3, 4, 6]] != 0).all()
    # Last layer: the readout reads the graph token's row only, whose relation to every key is
    # the token's virtual distance, so only that column matters.
    assert (last.grad[:, 6] != 0).all()
    assert (last.grad[:, :6] == 0).all()


def test_one_layer_attention_is_softmax_plus_bias_times_gate_by_hand():
    net = randomise(model(urpe=True))
    graphs = to_dense_graph_batch(Batch.from_data_list(molecules()), max_hops=3)
    inputs = net.encodings(graphs)
    layer = net.layers[0]
    mixer = layer.mixer
    x = layer.norm_mixer(inputs.x)  # pre-LN: the mixer sees the normalised input
    got = mixer(
        x,
        key_padding_mask=inputs.padding_mask,
        positions=urpe.Positions.graph(inputs.relation),
        bias=inputs.bias,
    )
    b, length, _ = x.shape
    h, d = mixer.num_heads, mixer.head_dim
    q = mixer.q_proj(x).view(b, length, h, d).transpose(1, 2)  # (B, H, L, d)
    k = mixer.k_proj(x).view(b, length, h, d).transpose(1, 2)
    v = mixer.v_proj(x).view(b, length, h, d).transpose(1, 2)
    table = mixer.gate.table  # (H, R)
    expected = torch.zeros(b, length, h * d, dtype=x.dtype)
    for g in range(b):
        real = (~inputs.padding_mask[g]).nonzero().flatten()
        for head in range(h):
            logits = q[g, head] @ k[g, head].T / d**0.5 + inputs.bias[g, head]  # (L, L)
            weights = torch.softmax(logits[:, real], dim=-1)  # padded keys take no part
            gate = table[head][inputs.relation[g][:, real]]  # (L, n)
            expected[g, :, head * d : (head + 1) * d] = (weights * gate) @ v[g, head][real]
    expected = mixer.out_proj(expected)
    real_rows = ~inputs.padding_mask
    torch.testing.assert_close(got[real_rows], expected[real_rows])


@pytest.mark.parametrize("readout", ["graph-token", "mean"])
@pytest.mark.parametrize("urpe_gate", [False, True])
def test_relabelling_nodes_leaves_predictions_unchanged(readout, urpe_gate):
    net = randomise(model(urpe=urpe_gate, readout=readout))
    data = molecules()
    generator = torch.Generator().manual_seed(3)
    relabelled = []
    for g in data:
        perm = torch.randperm(g.num_nodes, generator=generator)
        inverse = torch.argsort(perm)
        relabelled.append(
            ShortestPaths()(
                Data(x=g.x[perm], edge_index=inverse[g.edge_index], edge_attr=g.edge_attr)
            )
        )
    before = net(Batch.from_data_list(data))
    after = net(Batch.from_data_list(relabelled))
    torch.testing.assert_close(after, before, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("readout", ["graph-token", "mean"])
def test_a_graphs_prediction_does_not_depend_on_its_batch(readout):
    net = randomise(model(urpe=True, readout=readout))
    with torch.no_grad():
        for table in net.gate_tables():
            table.uniform_(0.2, 1.8)
    data = molecules()
    alone = torch.cat([net(Batch.from_data_list([g])) for g in data])
    together = net(Batch.from_data_list(data))
    reversed_ = net(Batch.from_data_list(data[::-1])).flip(0)
    torch.testing.assert_close(together, alone, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(reversed_, alone, rtol=1e-10, atol=1e-10)
    # A dense batch padded further gives the same predictions.
    dense = to_dense_graph_batch(Batch.from_data_list(data), max_hops=3)
    assert dense.max_nodes < 40
    pad = 40 - dense.max_nodes
    wider = urpe.graph.DenseGraphBatch(
        x=torch.nn.functional.pad(dense.x, (0, 0, 0, pad)),
        padding_mask=torch.nn.functional.pad(dense.padding_mask, (0, pad), value=True),
        in_degree=torch.nn.functional.pad(dense.in_degree, (0, pad)),
        out_degree=torch.nn.functional.pad(dense.out_degree, (0, pad)),
        spd=torch.nn.functional.pad(dense.spd, (0, pad, 0, pad), value=urpe.graph.UNREACHABLE),
        path_edges=torch.nn.functional.pad(
            dense.path_edges, (0, 0, 0, pad, 0, pad), value=urpe.graph.NO_EDGE
        ),
        edge_attr=dense.edge_attr,
    )
    torch.testing.assert_close(net(wider), alone, rtol=1e-10, atol=1e-10)


def test_targets_statistics_scale_the_output_and_survive_a_checkpoint_round_trip():
    net = randomise(model(urpe=True))
    batch = Batch.from_data_list(molecules())
    raw = net(batch)
    net.set_target_statistics(mean=3.0, std=2.0)
    torch.testing.assert_close(net(batch), 3.0 + 2.0 * raw)
    rebuilt = Graphormer.from_model_config(net.model_config()).double().eval()
    rebuilt.load_state_dict(net.state_dict(), strict=True)
    assert torch.equal(rebuilt(batch), net(batch))
    with pytest.raises(ValueError, match="std"):
        net.set_target_statistics(0.0, 0.0)


def test_urpe_adds_one_gate_entry_per_head_for_every_relation_the_data_can_hold():
    """R is read off the data: a batch with every kind of pair (distances 0..D, farther than D,
    unreachable, padding, the graph token) holds exactly the relations 0..R-1 that the gate has
    columns for, and URPE adds layers x heads x R parameters, no more."""
    from urpe.graph import relation_index

    def count(net):
        return sum(p.numel() for p in net.parameters())

    max_distance = 1  # molecules have longer paths: "farther than D" occurs
    graphs = molecules([*SMILES[:3], "C.C"])  # "C.C": two atoms, no path between them
    dense = to_dense_graph_batch(Batch.from_data_list(graphs), max_hops=3)
    seen = relation_index(dense.spd, max_distance).unique().tolist()
    gated, plain = model(urpe=True, max_distance=max_distance), model(max_distance=max_distance)
    width = gated.gate_tables()[0].shape[1]
    assert seen == list(range(width))
    assert count(gated) - count(plain) == 2 * 4 * len(seen)  # 2 layers, 4 heads
    assert gated(dense).shape == (4,)


@pytest.mark.parametrize("name", sorted(GRAPHORMER_PRESETS))
def test_every_preset_builds_and_predicts(name):
    net = Graphormer(
        GraphormerConfig.preset(name, num_layers=1, gate="relation"),
        node_cardinalities=SPEC.node_cardinalities,
        edge_cardinalities=SPEC.edge_cardinalities,
    ).eval()
    out = net(Batch.from_data_list(molecules(SMILES[:2])))
    assert out.shape == (2,) and torch.isfinite(out).all()


def test_spatial_bias_is_a_relation_bias_under_the_old_state_dict_key():
    net = model()
    assert isinstance(net.encodings.spatial, urpe.RelationBias)
    assert "encodings.spatial.table" in net.state_dict()
    relation = torch.randint(0, 7, (2, 5, 5))
    table = net.encodings.spatial.table
    torch.testing.assert_close(net.encodings.spatial(relation), table[:, relation].movedim(0, 1))


def test_dense_batch_and_pyg_batch_give_the_same_predictions():
    net = randomise(model(urpe=True))
    batch = Batch.from_data_list(molecules())
    assert torch.equal(net(batch), net(to_dense_graph_batch(batch, max_hops=3)))


def test_graph_with_a_single_atom_and_real_valued_features():
    config = GraphormerConfig(num_layers=1, dim=8, ffn_dim=8, num_heads=2, gate="relation")
    net = Graphormer(config, node_features=3, edge_features=2).double().eval()
    single = ShortestPaths()(
        Data(
            x=torch.randn(1, 3, dtype=torch.float64),
            edge_index=torch.zeros(2, 0, dtype=torch.long),
            edge_attr=torch.zeros(0, 2, dtype=torch.float64),
        )
    )
    out = net(Batch.from_data_list([single]))
    assert out.shape == (1,) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(dim=30, num_heads=4), "divisible"),
        (dict(num_layers=0), "num_layers"),
        (dict(readout="max"), "readout"),
        (dict(dropout=1.0), "dropout"),
        (dict(max_hops=-1), "max_hops"),
    ],
)
def test_bad_configs_are_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        GraphormerConfig(**changes)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown Graphormer preset"):
        GraphormerConfig.preset("huge")
    with pytest.raises(TypeError, match="GraphormerConfig"):
        Graphormer({"num_layers": 2}, node_cardinalities=(28,))
    with pytest.raises(ValueError, match="exactly one"):
        Graphormer(GraphormerConfig())
    net = model()
    plain = Batch.from_data_list([smiles_to_graph("CCO")[0]])  # no ShortestPaths
    with pytest.raises(ValueError, match="ShortestPaths"):
        net(plain)
