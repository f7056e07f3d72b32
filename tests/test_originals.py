"""urpe's encodings against the original implementations that ship as packages: Hugging Face
transformers' T5 relative bias, BLOOM's and MPT's ALiBi and Llama's RoPE. Graphormer's own
algorithms ship in no installable package (transformers 5 dropped its Graphormer model; the
`graphormer-pretrained` sdist does not build), so its Floyd-Warshall path and multi-hop edge
encoding are transcribed here from its published code and compared on real molecules.

Run with -s to see the measured errors."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch_geometric.data import Batch

import urpe
from urpe.data.molecules import FEATURIZATIONS, smiles_to_graph
from urpe.encodings import alibi_slopes, porting, t5_buckets
from urpe.graph import EdgePathBias, ShortestPaths, to_dense_graph_batch

from .graph_reference import SMILES, to_networkx
from .test_graph_paths import moses_sample

F64 = dict(dtype=torch.float64)
SEQ = urpe.Positions.sequence


def measured(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    err = (got - want).abs().max().item()
    rel = err / max(want.abs().max().item(), 1e-300)
    print(f"{name}: max abs error {err:.3g}, relative to the largest value {rel:.3g}")
    return err


# ------------------------------------------------------------------------------------------- T5
def t5_attention(is_decoder: bool, heads=4, d_kv=8, buckets=32, max_distance=20):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(
        d_model=heads * d_kv,
        d_kv=d_kv,
        num_heads=heads,
        dropout_rate=0.0,
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=max_distance,
        is_decoder=is_decoder,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = T5Attention(config, has_relative_attention_bias=True, layer_idx=0).double().eval()
    with torch.no_grad():
        layer.relative_attention_bias.weight.normal_()
    return layer


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("buckets", "max_distance"), [(32, 128), (64, 128), (8, 20), (16, 9)])
def test_t5_buckets_equal_transformers(bidirectional, buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    offsets = torch.arange(-3000, 3001)
    want = T5Attention._relative_position_bucket(offsets, bidirectional, buckets, max_distance)
    assert torch.equal(t5_buckets(offsets, buckets, max_distance, bidirectional), want)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_t5_bias_with_converted_table_equals_compute_bias(is_decoder):
    layer = t5_attention(is_decoder)
    bias = urpe.T5Bias(4, 32, 20, bidirectional=not is_decoder).double()
    with torch.no_grad():
        bias.table.copy_(porting.t5_table(layer.relative_attention_bias.weight))
    for lq, past in [(37, 0), (1, 40), (5, 11)]:  # full, one decoding step, a chunk after a cache
        want = layer.compute_bias(lq, past + lq, past_seen_tokens=past)[0]  # (H, Lq, Lk)
        term = bias.bias(torch.zeros(1, 4, lq, 8, **F64), SEQ(lq, past=past), 1.0)
        assert torch.equal(term.dense(lq, past + lq)[0], want)


def test_t5_encoder_attention_output_equals_transformers():
    layer = t5_attention(is_decoder=False)
    bias = urpe.T5Bias(4, 32, 20, bidirectional=True).double()
    with torch.no_grad():
        bias.table.copy_(porting.t5_table(layer.relative_attention_bias.weight))
    x = torch.randn(2, 30, 32, **F64)
    want = layer(x)[0]

    def heads(t):
        return t.view(2, 30, 4, 8).transpose(1, 2)  # (B, H, L, D)

    q, k, v = heads(layer.q(x)), heads(layer.k(x)), heads(layer.v(x))
    term = bias.bias(q, SEQ(30), 1.0)
    out = urpe.attention(q, k, v, bias=term, scale=1.0, backend="reference")  # T5: no 1/sqrt(d)
    got = layer.o(out.transpose(1, 2).reshape(2, 30, 32))
    assert measured("T5 encoder attention vs transformers", got, want) < 1e-12


# ---------------------------------------------------------------------------------------- ALiBi
def causal_softmax(bias: torch.Tensor) -> torch.Tensor:
    """softmax over keys j <= i of a (H, L, L) logit term, zero scores otherwise."""
    length = bias.shape[-1]
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.softmax(bias.masked_fill(~mask, -torch.inf), -1)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 24, 32])
def test_alibi_equals_bloom_and_mpt(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    length = 50
    bloom = build_alibi_tensor(torch.ones(1, length), heads, torch.float64)[:, 0]  # (H, L): m j
    mpt = build_mpt_alibi_tensor(heads, length).double()[:, 0]  # (H, L): m (j - L + 1)
    slopes = alibi_slopes(heads).double()
    # All three hold float32 slopes: exact below 16 heads, within a few float32 ulps beyond.
    torch.testing.assert_close(bloom[:, 1], slopes, rtol=1e-6, atol=0)
    torch.testing.assert_close(mpt[:, -2], -slopes, rtol=1e-6, atol=0)
    ours = urpe.ALiBi(heads).bias(torch.zeros(1, heads, length, 4, **F64), SEQ(length), 1.0)
    ours = ours.dense(length, length)[0].double()  # (H, L, L): -m |i - j|
    # BLOOM and MPT add m j (a per-row shift of -m |i - j| under the causal mask): equal weights.
    for name, theirs in (("BLOOM", bloom), ("MPT", mpt)):
        theirs = theirs[:, None, :].expand(heads, length, length)
        err = measured(
            f"ALiBi attention weights vs {name} (H={heads})",
            causal_softmax(ours),
            causal_softmax(theirs),
        )
        assert err < 1e-6


# ----------------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_equals_llama(head_dim):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim)
    rotary = LlamaRotaryEmbedding(config)
    q, k = torch.randn(2, 2, 9, head_dim), torch.randn(2, 2, 9, head_dim)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [3, 17, 100, 511, 512, 1023, 2047, 4000, 9]])
    cos, sin = rotary(q, ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours = urpe.RotaryEncoding(head_dim)
    got_q, got_k = ours.rotate(q, ids), ours.rotate(k, ids)
    # Both compute angles in float32 (up to 4000 rad here): compare each with float64 angles.
    exact = urpe.RotaryEncoding(head_dim).double()
    exact.inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, **F64) / head_dim)
    truth = exact.rotate(q.double(), ids)
    ours_err = measured(f"RoPE vs float64 angles, urpe (D={head_dim})", got_q.double(), truth)
    llama_err = measured(f"RoPE vs float64 angles, Llama (D={head_dim})", want_q.double(), truth)
    assert ours_err <= 1.5 * llama_err + 1e-6
    assert measured(f"RoPE q vs Llama (D={head_dim})", got_q, want_q) < 2e-3
    assert measured(f"RoPE k vs Llama (D={head_dim})", got_k, want_k) < 2e-3
    # The attention scores depend on the offset only, in both.
    torch.testing.assert_close(
        got_q @ got_k.transpose(-2, -1), want_q @ want_k.transpose(-2, -1), rtol=1e-3, atol=5e-3
    )


# ----------------------------------------------------------------------------------- Graphormer
def floyd_warshall(adjacency):
    """Graphormer's `algos.floyd_warshall`: distances (510 = unreachable) and, per pair, the
    intermediate node k of the last improvement (-1: direct edge or none)."""
    n = len(adjacency)
    dist = [[0 if i == j else (1 if adjacency[i][j] else 510) for j in range(n)] for i in range(n)]
    path = [[-1] * n for _ in range(n)]
    for k in range(n):
        for i in range(n):
            for j in range(n):
                if dist[i][j] > dist[i][k] + dist[k][j]:
                    dist[i][j] = dist[i][k] + dist[k][j]
                    path[i][j] = k
    for i in range(n):
        for j in range(n):
            if dist[i][j] >= 510:
                dist[i][j], path[i][j] = 510, 510
    return dist, path


def graphormer_path(path, i, j):
    """Graphormer's `get_all_edges` plus the ends: the node sequence from i to j."""

    def inner(a, b):
        k = path[a][b]
        return [] if k == -1 else inner(a, k) + [k] + inner(k, b)

    return [i, *inner(i, j), j]


def graphormer_edge_bias(graph, path, dist, edge_tables, hop_weights, max_hops):
    """Graphormer's multi-hop edge encoding (`gen_edge_input` + `GraphAttnBias`) for one graph:
    (H, N, N), the features of the first max_hops edges of its path, averaged over columns,
    through one H x H matrix per hop, summed and divided by min(d, max_hops)."""
    n, heads = graph.number_of_nodes(), hop_weights.shape[-1]
    out = torch.zeros(heads, n, n, **F64)
    for i in range(n):
        for j in range(n):
            if i == j or dist[i][j] == 510:
                continue
            nodes = graphormer_path(path, i, j)
            total = torch.zeros(heads, **F64)
            for hop, (u, w) in enumerate(zip(nodes[:-1], nodes[1:], strict=False)):
                if hop == max_hops:
                    break
                feature = graph.edges[u, w]["f"]
                embedded = sum(edge_tables[f][value] for f, value in enumerate(feature))
                total = total + (embedded / len(feature)) @ hop_weights[hop]
            out[:, i, j] = total / min(dist[i][j], max_hops)
    return out


def test_paths_and_edge_encoding_against_graphormer_on_molecules():
    spec = FEATURIZATIONS["rdkit"]
    max_hops = 5
    torch.manual_seed(0)
    edge = EdgePathBias(4, max_hops, spec.edge_cardinalities, init_std=1.0).double()
    edge_weight = edge.edge_encoder.table.weight.detach()
    edge_tables = list(torch.split(edge_weight, list(spec.edge_cardinalities)))
    graphs = [ShortestPaths()(smiles_to_graph(s, "rdkit")[0]) for s in SMILES + moses_sample(16)]
    batch = to_dense_graph_batch(Batch.from_data_list(graphs), max_hops=max_hops)
    ours = edge(batch.path_edges, batch.edge_attr)  # (B, H, N, N)
    unique_err, pairs, multi, differ = 0.0, 0, 0, 0
    for b, data in enumerate(graphs):
        graph = to_networkx(data)
        n = data.num_nodes
        adjacency = [[graph.has_edge(i, j) for j in range(n)] for i in range(n)]
        dist, path = floyd_warshall(adjacency)
        spd = batch.spd[b, :n, :n]
        assert torch.equal(torch.where(spd < 0, 510, spd), torch.tensor(dist))
        theirs = graphormer_edge_bias(graph, path, dist, edge_tables, edge.hop_weights, max_hops)
        for i in range(n):
            for j in range(n):
                if i == j or dist[i][j] == 510:
                    continue
                pairs += 1
                gap = (ours[b, :, i, j] - theirs[:, i, j]).abs().max().item()
                if len(list(nx.all_shortest_paths(graph, i, j))) == 1:
                    unique_err = max(unique_err, gap)
                else:
                    multi += 1
                    differ += gap > 1e-12
    print(
        f"Graphormer edge encoding: {pairs} connected pairs in {len(graphs)} molecules; "
        f"unique-path pairs max abs error {unique_err:.3g}; {differ} of {multi} multi-path "
        f"pairs differ ({differ / max(multi, 1):.0%}): urpe takes the smallest feature sequence"
    )
    assert unique_err < 1e-12
    assert multi > 100 and 0 < differ < multi  # the choice matters, and often agrees
