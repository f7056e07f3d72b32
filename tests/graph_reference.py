"""Independent references for the graph tests: networkx paths and Graphormer's formulas written
as plain loops over node pairs (slow on purpose, and sharing no code with urpe.graph)."""

from __future__ import annotations

import itertools

import networkx as nx
import torch

# Real molecules: MOSES's first two training SMILES, a salt (disconnected), single atoms,
# fused and bridged rings (many equally short paths), an eight-membered ring.
SMILES = [
    "CCCS(=O)c1ccc2[nH]c(=NC(=O)OC)[nH]c2c1",
    "CC(C)(C)C(=O)C(Oc1ccc(Cl)cc1)n1ccnc1",
    "CC(=O)Oc1ccccc1C(=O)O.[Na+].[Cl-]",
    "C",
    "[Na+].[Cl-]",
    "c1ccc2ccccc2c1",
    "C1CC2CCC1CC2",
    "O=C1CCCCCCC1",
    "Cc1ccc(cc1)S(=O)(=O)N1CCC2(CC1)OCCO2",
]


def to_networkx(data) -> nx.DiGraph:
    """A simple directed graph with each edge's feature tuple as attribute `f`."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(data.num_nodes))
    attr = data.edge_attr
    if attr is not None and attr.dim() == 1:
        attr = attr.unsqueeze(-1)  # (E, 1)
    for e, (u, v) in enumerate(data.edge_index.t().tolist()):
        feature = tuple(attr[e].tolist()) if attr is not None else ()
        graph.add_edge(u, v, f=feature, id=e)
    return graph


def lexmin_feature_path(graph: nx.DiGraph, i: int, j: int) -> list[tuple] | None:
    """The smallest sequence of edge features over all shortest paths from i to j."""
    if i == j:
        return []
    if not nx.has_path(graph, i, j):
        return None
    sequences = [
        [graph.edges[u, v]["f"] for u, v in itertools.pairwise(path)]
        for path in nx.all_shortest_paths(graph, i, j)
    ]
    return min(sequences)


def graphormer_bias_by_hand(
    graph: nx.DiGraph,
    spatial: torch.Tensor,
    virtual: torch.Tensor,
    edge_tables: list[torch.Tensor],
    hop_weights: torch.Tensor,
    max_distance: int,
    max_hops: int,
) -> torch.Tensor:
    """Graphormer's attention bias for one graph with its graph token, pair by pair.

    spatial: (H, max_distance + 3) entries for d = 0..max_distance, far, unreachable;
    virtual: (H,); edge_tables[f]: (cardinality_f, H); hop_weights: (K, H, H).
    Returns (H, N + 1, N + 1).
    """
    n, heads = graph.number_of_nodes(), spatial.shape[0]
    bias = torch.zeros(heads, n + 1, n + 1, dtype=spatial.dtype)
    bias[:, 0, :] = virtual[:, None]
    bias[:, :, 0] = virtual[:, None]
    lengths = dict(nx.all_pairs_shortest_path_length(graph))
    for i in range(n):
        for j in range(n):
            d = lengths[i].get(j)
            if d is None:
                bias[:, i + 1, j + 1] = spatial[:, max_distance + 2]
                continue
            bias[:, i + 1, j + 1] = spatial[:, min(d, max_distance + 1)]
            features = lexmin_feature_path(graph, i, j)[:max_hops]
            if not features:
                continue
            total = torch.zeros(heads, dtype=spatial.dtype)
            for k, feature in enumerate(features):
                embedded = sum(edge_tables[f][value] for f, value in enumerate(feature))
                total = total + (embedded / len(feature)) @ hop_weights[k]
            bias[:, i + 1, j + 1] += total / len(features)
    return bias
