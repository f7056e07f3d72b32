"""Graphormer's graph encodings (Ying et al. 2021) as modules, plus the relation index that URPE's
gate C is looked up with on graphs (torch only).

From a `DenseGraphBatch` of B graphs padded to N nodes, `GraphormerEncodings` makes the input of a
Transformer over N + 1 positions, the graph token first:

    h_i  = node_embedding(x_i) + degree_embedding(deg_i)              i = 1..N
    h_0  = graph_token
    B_ij = spatial[h, rel(i, j)] + edge_ij                             (per head h)
    edge_ij = 1 / n_ij * sum_{k < n_ij} (mean_f emb_f(e_k)) W_k        n_ij = min(d(i, j), K)

rel(i, j) is the shortest-path distance d(i, j) for 0 <= d <= max_distance, then one entry each
for "farther", "unreachable" and, on row and column 0, the graph token's virtual distance. The
same index selects URPE's gate entry: A = softmax(QK^T / sqrt(d) + B) * C[h, rel(i, j)].

Where this follows Graphormer's code and where it differs:
- Node and edge features: one embedding per categorical column, summed for nodes and averaged
  for edges, as Graphormer's atom and edge encoders (which share one offset table).
- Degrees: Graphormer adds an in-degree and an out-degree embedding even for undirected graphs,
  where the two are equal; here undirected graphs get one table (the same function, half the
  parameters) and `directed=True` gives both. Degrees above max_degree share the last entry
  (Graphormer's table has 512 rows and no clipping).
- Spatial bias: Graphormer has one entry per distance up to 510 (unreachable is 510); here
  distances beyond max_distance share a "far" entry and unreachable pairs have their own. The
  graph token's virtual distance is Graphormer's `graph_token_virtual_distance`: one value per
  head for row 0 and column 0, stored as the last column of the same table.
- Edge encoding: Graphormer's multi-hop encoding, as above, with K = max_hops (its
  multi_hop_max_dist) learned H x H matrices (Graphormer allocates 128 and uses the first K).
  The shortest path is a canonical one (see `urpe.graph.paths`), so relabelling nodes permutes
  the bias exactly; Graphormer's path choice depends on node order.
- Padding: Graphormer writes -inf into the bias of padded keys; here the bias stays finite and
  `padding_mask` is returned for the attention's key_padding_mask, which also zeroes C there.
- Initialisation: every table N(0, init_std = 0.02), as Graphormer's `init_params`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..encodings import RelationBias
from .config import GraphEncodingConfig
from .dense import FAR, UNREACHABLE, DenseGraphBatch


def relation_index(spd: Tensor, max_distance: int) -> Tensor:
    """Relation index of a Transformer over [graph token, nodes], from shortest-path distances.

    Args:
        spd: (B, N, N) long distances with `UNREACHABLE` (-1) and `FAR` (-2) markers, as in
            `DenseGraphBatch.spd` (padded pairs carry -1).
        max_distance: D.

    Returns:
        (B, N + 1, N + 1) long with values in [0, D + 4):
        d for 0 <= d <= D; D + 1 for d > D or FAR; D + 2 for unreachable (and padded) pairs;
        D + 3 on row 0 and column 0, the graph token's virtual distance.
    """
    far, unreachable, virtual = max_distance + 1, max_distance + 2, max_distance + 3
    index = spd.clamp(max=far)
    index = torch.where(spd == FAR, far, index)
    index = torch.where(spd == UNREACHABLE, unreachable, index)
    # Prepend the graph token's row and column.
    return F.pad(index, (1, 0, 1, 0), value=virtual)  # (B, N+1, N+1)


class FeatureEncoder(nn.Module):
    """Embeds node or edge features: categorical columns through one learned table each (summed
    or averaged over columns, as Graphormer's atom and edge encoders), or real-valued features
    through a linear map.

    Args:
        dim: output width.
        cardinalities: categories per column (x[..., f] in [0, cardinalities[f])), or None.
        in_features: width of real-valued input, or None. Exactly one of the two.
        reduce: "sum" or "mean" over categorical columns.
        init_std: std of the normal initialisation.
    """

    def __init__(
        self,
        dim: int,
        cardinalities: Sequence[int] | None = None,
        in_features: int | None = None,
        reduce: str = "sum",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if (cardinalities is None) == (in_features is None):
            raise ValueError("give exactly one of cardinalities and in_features")
        if reduce not in ("sum", "mean"):
            raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")
        self.reduce = reduce
        self.cardinalities = tuple(cardinalities) if cardinalities is not None else None
        if self.cardinalities is not None:
            cards = torch.tensor(self.cardinalities)
            # One table for all columns; column f's categories start at offsets[f].
            self.register_buffer("offsets", torch.cumsum(cards, 0) - cards, persistent=False)
            self.table = nn.Embedding(int(cards.sum()), dim)
            nn.init.normal_(self.table.weight, std=init_std)
            self.linear = None
        else:
            self.linear = nn.Linear(in_features, dim)
            nn.init.normal_(self.linear.weight, std=init_std)
            nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., F) -> (..., dim)."""
        if self.linear is not None:
            return self.linear(x if x.is_floating_point() else x.float())
        if x.is_floating_point():
            raise TypeError(
                "categorical features must be integers; use in_features= for real-valued ones"
            )
        if x.dim() == 0 or x.shape[-1] != len(self.cardinalities):
            raise ValueError(
                f"expected {len(self.cardinalities)} feature columns, got {x.shape[-1]}"
            )
        if x.numel():
            bad = (x < 0) | (x >= self.offsets.new_tensor(self.cardinalities))
            if bad.any():
                column = int(bad.reshape(-1, x.shape[-1]).any(0).nonzero()[0])
                raise ValueError(
                    f"feature column {column} has values outside 0.."
                    f"{self.cardinalities[column] - 1}"
                )
        embedded = self.table(x.long() + self.offsets)  # (..., F, dim)
        return embedded.sum(-2) if self.reduce == "sum" else embedded.mean(-2)


class DegreeEncoding(nn.Module):
    """Graphormer's centrality encoding: a learned embedding of each node's degree, added to its
    features. Degrees above `max_degree` share the last entry.

    Args:
        dim: width.
        max_degree: largest degree with its own entry.
        directed: separate in- and out-degree tables (summed); False uses the in-degree only.
    """

    def __init__(
        self, dim: int, max_degree: int = 64, directed: bool = False, init_std: float = 0.02
    ):
        super().__init__()
        self.max_degree = max_degree
        self.in_degree = nn.Embedding(max_degree + 1, dim)
        self.out_degree = nn.Embedding(max_degree + 1, dim) if directed else None
        for table in (self.in_degree, self.out_degree):
            if table is not None:
                nn.init.normal_(table.weight, std=init_std)

    def forward(self, in_degree: Tensor, out_degree: Tensor | None = None) -> Tensor:
        """in_degree, out_degree: (B, N) long -> (B, N, dim)."""
        out = self.in_degree(in_degree.clamp(0, self.max_degree))
        if self.out_degree is not None:
            if out_degree is None:
                raise ValueError("a directed DegreeEncoding needs out_degree")
            out = out + self.out_degree(out_degree.clamp(0, self.max_degree))
        return out


class SpatialBias(RelationBias):
    """Graphormer's spatial encoding, b_ij = table[h, rel(i, j)] over shortest-path distance, far,
    unreachable and the graph token's virtual distance: a `RelationBias` (same `table`, same
    state-dict key) called on the relation index alone."""

    def forward(self, relation: Tensor) -> Tensor:
        """relation: (B, L, L) long -> dense bias (B, H, L, L)."""
        return self.term(relation).dense(relation.shape[1], relation.shape[2])


class EdgePathBias(nn.Module):
    """Graphormer's multi-hop edge encoding: per head, the edge features along the shortest path
    from i to j, each hop through its own learned H x H matrix, averaged over the path:

        c_ij = 1 / n_ij * sum_{k < n_ij} E(e_k) W_k,      n_ij = min(d(i, j), K)

    E(e) is the per-head embedding of an edge's features (categorical columns averaged). Pairs
    without a path (i = j, unreachable, padding) get 0.

    Args:
        num_heads: H.
        max_hops: K.
        cardinalities / in_features: the edge features, as for `FeatureEncoder`.
    """

    def __init__(
        self,
        num_heads: int,
        max_hops: int,
        cardinalities: Sequence[int] | None = None,
        in_features: int | None = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        self.max_hops = max_hops
        self.edge_encoder = FeatureEncoder(
            num_heads, cardinalities, in_features, reduce="mean", init_std=init_std
        )
        self.hop_weights = nn.Parameter(torch.randn(max_hops, num_heads, num_heads) * init_std)

    def forward(self, path_edges: Tensor, edge_attr: Tensor) -> Tensor:
        """path_edges: (B, N, N, K') edge rows or -1; edge_attr: (E, Fe) -> (B, H, N, N)."""
        if path_edges.shape[-1] < self.max_hops:
            raise ValueError(
                f"the batch unrolled {path_edges.shape[-1]} hops but the edge encoding reads "
                f"{self.max_hops}: build it with to_dense_graph_batch(..., max_hops="
                f"{self.max_hops})"
            )
        path_edges = path_edges[..., : self.max_hops]  # (B, N, N, K)
        per_edge = self.edge_encoder(edge_attr)  # (E, H)
        # Row E is zero, for "no edge here".
        per_edge = torch.cat([per_edge, per_edge.new_zeros(1, per_edge.shape[-1])])
        index = torch.where(path_edges >= 0, path_edges, per_edge.shape[0] - 1)
        along = per_edge[index]  # (B, N, N, K, H)
        total = torch.einsum("bijkh,khg->bijg", along, self.hop_weights)  # (B, N, N, H)
        hops = (path_edges >= 0).sum(-1).clamp(min=1)  # (B, N, N)
        return (total / hops.unsqueeze(-1)).permute(0, 3, 1, 2)  # (B, H, N, N)


@dataclass
class GraphInputs:
    """What a Transformer over [graph token, nodes] needs, L = N + 1 positions.

    Attributes:
        x: (B, L, dim) input embeddings, the graph token at position 0.
        padding_mask: (B, L) bool, True marks padding (never the graph token).
        bias: (B, H, L, L) attention bias B (spatial + edge encoding); finite everywhere, the
            padding mask handles padded keys.
        relation: (B, L, L) long relation index in [0, num_relations), for URPE's gate
            C[h, relation] (see `relation_index`).
    """

    x: Tensor
    padding_mask: Tensor
    bias: Tensor
    relation: Tensor


class GraphormerEncodings(nn.Module):
    """All of Graphormer's graph encodings: node and degree embeddings, the graph token, the
    spatial and edge biases, and the relation index for URPE's gate. See the module docstring.
    """

    def __init__(self, config: GraphEncodingConfig):
        super().__init__()
        self.config = config
        std = config.init_std
        self.node_encoder = FeatureEncoder(
            config.dim, config.node_cardinalities, config.node_features, "sum", std
        )
        self.degree = DegreeEncoding(config.dim, config.max_degree, config.directed, std)
        self.graph_token = nn.Parameter(torch.randn(config.dim) * std)
        self.spatial = SpatialBias(config.num_heads, config.num_relations, std)
        self.edge = (
            EdgePathBias(
                config.num_heads,
                config.max_hops,
                config.edge_cardinalities,
                config.edge_features,
                std,
            )
            if config.uses_edges
            else None
        )

    def forward(self, graphs: DenseGraphBatch) -> GraphInputs:
        num_graphs = graphs.num_graphs
        nodes = self.node_encoder(graphs.x) + self.degree(graphs.in_degree, graphs.out_degree)
        token = self.graph_token.expand(num_graphs, 1, -1)  # (B, 1, dim)
        x = torch.cat([token, nodes], 1)  # (B, N+1, dim)
        padding_mask = F.pad(graphs.padding_mask, (1, 0), value=False)  # (B, N+1)
        relation = relation_index(graphs.spd, self.config.max_distance)  # (B, N+1, N+1)
        bias = self.spatial(relation)  # (B, H, N+1, N+1)
        if self.edge is not None:
            if graphs.edge_attr is None:
                raise ValueError("the edge encoding needs edge_attr, and the batch has none")
            edge = self.edge(graphs.path_edges, graphs.edge_attr)  # (B, H, N, N)
            bias = bias + F.pad(edge, (1, 0, 1, 0))
        return GraphInputs(x=x, padding_mask=padding_mask, bias=bias, relation=relation)
