"""Configuration of Graphormer's graph encodings (torch only)."""

from __future__ import annotations

from dataclasses import dataclass


def relation_count(max_distance: int) -> int:
    """R: entries of the relation index (distances 0..max_distance, far, unreachable, the graph
    token's virtual distance)."""
    return max_distance + 4


@dataclass(frozen=True)
class GraphEncodingConfig:
    """What `urpe.graph.GraphormerEncodings` builds.

    Node and edge inputs are either categorical (`*_cardinalities`: one category count per
    feature column, as ZINC's atom and bond types) or real-valued (`*_features`: the column
    count, embedded by a linear map). Give exactly one for nodes; at most one for edges (none
    turns the edge encoding off).

    Attributes:
        dim: width of the node embeddings (the Transformer's width).
        num_heads: H, one bias per head.
        max_degree: degrees above it share the last degree embedding (Graphormer: 511).
        max_distance: shortest-path distances 0..max_distance get their own entry in the
            spatial bias and relation index; larger ones share a "far" entry. Unreachable pairs
            and the graph token have entries of their own.
        max_hops: K, edges of each shortest path read by the edge encoding, one learned H x H
            matrix per hop (Graphormer's multi_hop_max_dist, 5 by default).
        directed: separate in- and out-degree embeddings; False embeds the in-degree only.
        init_std: standard deviation of every embedding's normal initialisation (Graphormer:
            0.02).
    """

    dim: int
    num_heads: int
    node_cardinalities: tuple[int, ...] | None = None
    node_features: int | None = None
    edge_cardinalities: tuple[int, ...] | None = None
    edge_features: int | None = None
    max_degree: int = 64
    max_distance: int = 20
    max_hops: int = 5
    directed: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("dim", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_degree", "max_distance", "max_hops"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.node_cardinalities is None) == (self.node_features is None):
            raise ValueError("give exactly one of node_cardinalities and node_features")
        if self.edge_cardinalities is not None and self.edge_features is not None:
            raise ValueError("give at most one of edge_cardinalities and edge_features")
        for name in ("node_cardinalities", "edge_cardinalities"):
            cards = getattr(self, name)
            if cards is not None:
                if len(cards) == 0 or any(int(c) < 1 for c in cards):
                    raise ValueError(f"{name} must be a non-empty list of counts >= 1: {cards}")
                object.__setattr__(self, name, tuple(int(c) for c in cards))
        for name in ("node_features", "edge_features"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def uses_edges(self) -> bool:
        return self.edge_cardinalities is not None or self.edge_features is not None

    @property
    def num_relations(self) -> int:
        """R: entries of the relation index (`relation_count`)."""
        return relation_count(self.max_distance)
