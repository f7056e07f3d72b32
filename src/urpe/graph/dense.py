"""The dense form of a batch of graphs that Graphormer's encodings read (torch only).

`urpe.graph.to_dense_graph_batch` builds it from a PyTorch Geometric `Batch`; nothing here needs
PyTorch Geometric, so the encodings that consume it stay in the torch-only core.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

UNREACHABLE = -1  # spd of a pair with no path (and of pairs involving padding)
FAR = -2  # spd of a pair beyond the transform's max_distance
NO_EDGE = -1  # path_edges entry past the end of a path


@dataclass
class DenseGraphBatch:
    """B graphs padded to N nodes.

    Attributes:
        x: (B, N, F) node features (categorical, long; or float), zero at padding.
        padding_mask: (B, N) bool, True marks a padded node (the convention of
            `urpe.attention`'s key_padding_mask).
        in_degree, out_degree: (B, N) long, number of edges into / out of each node, 0 at
            padding. Equal for undirected graphs.
        spd: (B, N, N) long shortest-path distance from i to j; `UNREACHABLE` (-1) for pairs
            with no path and for every pair involving padding, `FAR` (-2) beyond the transform's
            max_distance.
        path_edges: (B, N, N, K) long, the k-th edge (a row of `edge_attr`) on the chosen shortest
            path from i to j, k < K = max_hops, counted from i; `NO_EDGE` (-1) past the end of the
            path (k >= d(i, j)) and for unreachable or padded pairs.
        edge_attr: (E, Fe) features of all E edges of the batch (long or float), or None.
    """

    x: Tensor
    padding_mask: Tensor
    in_degree: Tensor
    out_degree: Tensor
    spd: Tensor
    path_edges: Tensor
    edge_attr: Tensor | None

    @property
    def num_graphs(self) -> int:
        return self.x.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.x.shape[1]

    @property
    def max_hops(self) -> int:
        return self.path_edges.shape[-1]

    @property
    def path_length(self) -> Tensor:
        """(B, N, N) long: edges stored on each path, min(d(i, j), K); 0 when there is none."""
        return (self.path_edges >= 0).sum(-1)

    def path_edge_features(self, fill: int | float = -1) -> Tensor:
        """(B, N, N, K, Fe): the features of the edges along each path, `fill` past its end."""
        if self.edge_attr is None:
            raise ValueError("this batch has no edge_attr")
        attr = self.edge_attr if self.edge_attr.dim() > 1 else self.edge_attr.unsqueeze(-1)
        # Append one row of `fill` and send NO_EDGE there.
        padded = torch.cat([attr, attr.new_full((1, attr.shape[1]), fill)])  # (E+1, Fe)
        index = torch.where(self.path_edges >= 0, self.path_edges, attr.shape[0])
        return padded[index]

    def to(self, device: torch.device | str) -> DenseGraphBatch:
        """The same batch on another device."""
        return DenseGraphBatch(
            **{
                name: (value.to(device) if isinstance(value, Tensor) else value)
                for name, value in vars(self).items()
            }
        )
