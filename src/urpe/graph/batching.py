"""Dense batching: a batch of graphs (a PyTorch Geometric `Batch`, as any PyG DataLoader yields
it, or `collate_graphs` of `Graph`s) to padded (B, N, ...) tensors, the form attention needs.

Torch only: a trained model predicts without importing PyTorch Geometric (whose own import
takes seconds), on graphs it batches with `collate_graphs` as PyG's `Batch.from_data_list`
batches the same fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .dense import NO_EDGE, UNREACHABLE, DenseGraphBatch


@dataclass
class Graph:
    """One graph as tensors, read as a PyG `Data` is: x (N, F), edge_index (2, E), edge_attr
    (E, Fe) or None, and, once `urpe.graph.ShortestPaths` has seen it, spd and path_next_edge
    (N * N,). Other attributes (a SMILES, a target) may be set on it as on a `Data`."""

    x: Tensor
    edge_index: Tensor
    edge_attr: Tensor | None = None
    spd: Tensor | None = None
    path_next_edge: Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.x.shape[0]

    def fields(self) -> dict[str, Tensor]:
        """The tensors it holds by name (None left out): `Data(**graph.fields())`."""
        return {k: v for k, v in vars(self).items() if isinstance(v, Tensor)}


@dataclass
class GraphBatch:
    """Graphs side by side, as PyG's `Batch` holds them: nodes and edges concatenated,
    edge_index shifted to rows of the batch, `batch` (sum N,) the graph of each node."""

    x: Tensor
    edge_index: Tensor
    edge_attr: Tensor | None
    spd: Tensor | None
    path_next_edge: Tensor | None  # per graph: positions in its own edges, as stored
    batch: Tensor
    num_graphs: int

    def to(self, device: torch.device | str) -> GraphBatch:
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        return GraphBatch(**moved)


def collate_graphs(graphs: Sequence[Any]) -> GraphBatch:
    """One `GraphBatch` of graphs (`Graph`s, or anything with their attributes)."""
    if not graphs:
        raise ValueError("collate_graphs needs at least one graph")
    sizes = torch.tensor([g.num_nodes for g in graphs])  # (B,)
    offsets = torch.cumsum(sizes, 0) - sizes

    def joined(name: str) -> Tensor | None:
        parts = [getattr(g, name, None) for g in graphs]
        return None if any(p is None for p in parts) else torch.cat(parts)

    return GraphBatch(
        x=torch.cat([g.x for g in graphs]),
        edge_index=torch.cat(
            [g.edge_index + offset for g, offset in zip(graphs, offsets.tolist(), strict=True)], 1
        ),
        edge_attr=joined("edge_attr"),
        spd=joined("spd"),
        path_next_edge=joined("path_next_edge"),
        batch=torch.repeat_interleave(torch.arange(len(graphs)), sizes),
        num_graphs=len(graphs),
    )


def pad_nodes(values: Tensor, node_graph: Tensor, num_graphs: int) -> tuple[Tensor, Tensor]:
    """Rows of nodes sorted by graph, (sum N, ...), as (B, N_max, ...) with zeros after each
    graph's nodes, and the (B, N_max) mask of real nodes (PyG's `to_dense_batch`)."""
    sizes = torch.bincount(node_graph, minlength=num_graphs)  # (B,)
    width = int(sizes.max()) if sizes.numel() else 0
    slot = (
        torch.arange(node_graph.shape[0], device=values.device)
        - (torch.cumsum(sizes, 0) - sizes)[node_graph]
    )  # (sum N,) each node's place in its graph
    dense = values.new_zeros((num_graphs, width, *values.shape[1:]))
    dense[node_graph, slot] = values
    real = torch.zeros((num_graphs, width), dtype=torch.bool, device=values.device)
    real[node_graph, slot] = True
    return dense, real


def _require(data: Any, name: str) -> Tensor:
    value = getattr(data, name, None)
    if value is None:
        hint = (
            " (apply urpe.graph.ShortestPaths to the dataset, best as its pre_transform)"
            if name in ("spd", "path_next_edge")
            else ""
        )
        raise ValueError(f"the batch has no `{name}`{hint}")
    return value


def to_dense_graph_batch(batch: Any, max_hops: int = 5) -> DenseGraphBatch:
    """Pad a batch of graphs to (B, N, ...) tensors and unroll the shortest paths.

    Args:
        batch: a `torch_geometric.data.Batch` (or a single `Data`), or a `GraphBatch`, whose
            graphs went through `urpe.graph.ShortestPaths`; needs `x`, `edge_index`, `spd`,
            `path_next_edge`, and uses `edge_attr` when present.
        max_hops: K, how many edges of each shortest path to unroll (Graphormer's
            multi_hop_max_dist, 5 by default there too).

    Returns:
        A `DenseGraphBatch`. A graph's entries depend only on that graph: the other graphs in
        the batch and the amount of padding change nothing but the padded positions.
    """
    if max_hops < 0:
        raise ValueError(f"max_hops must be >= 0, got {max_hops}")
    x = _require(batch, "x")
    edge_index = _require(batch, "edge_index").long()
    spd_flat = _require(batch, "spd").long()
    next_flat = _require(batch, "path_next_edge").long()
    num_nodes_total = x.shape[0]
    device = x.device
    node_graph = getattr(batch, "batch", None)
    if node_graph is None:
        node_graph = torch.zeros(num_nodes_total, dtype=torch.long, device=device)
    num_graphs = int(batch.num_graphs) if hasattr(batch, "num_graphs") else 1

    x = x if x.dim() > 1 else x.unsqueeze(-1)  # (sum N, F)
    x_dense, real = pad_nodes(x, node_graph, num_graphs)  # (B, N, F), (B, N)
    num_nodes = real.sum(1)  # (B,)
    n_max = x_dense.shape[1]
    node_ptr = torch.cumsum(num_nodes, 0) - num_nodes  # (B,) first node of each graph

    num_edges_total = edge_index.shape[1]
    in_degree = torch.bincount(edge_index[1], minlength=num_nodes_total)  # (sum N,)
    out_degree = torch.bincount(edge_index[0], minlength=num_nodes_total)
    in_degree, _ = pad_nodes(in_degree, node_graph, num_graphs)  # (B, N)
    out_degree, _ = pad_nodes(out_degree, node_graph, num_graphs)

    expected = int((num_nodes**2).sum())
    if spd_flat.numel() != expected or next_flat.numel() != expected:
        raise ValueError(
            f"spd/path_next_edge hold {spd_flat.numel()}/{next_flat.numel()} entries, but the "
            f"graphs' N*N sum to {expected}: were nodes added or removed after ShortestPaths?"
        )
    # Each graph stored its (N_b, N_b) matrices row-major; a boolean mask over (B, N, N)
    # enumerates positions in the same (b, i, j) order, so one masked assignment unflattens all.
    pairs = real[:, :, None] & real[:, None, :]  # (B, N, N)
    spd = torch.full((num_graphs, n_max, n_max), UNREACHABLE, dtype=torch.long, device=device)
    spd[pairs] = spd_flat
    next_edge = torch.full_like(spd, NO_EDGE)
    # Stored edge positions are per graph; shift them to rows of the batch's edge_index.
    edge_graph = node_graph[edge_index[0]]  # (E,)
    edges_per_graph = torch.bincount(edge_graph, minlength=num_graphs)
    edge_ptr = torch.cumsum(edges_per_graph, 0) - edges_per_graph  # (B,)
    graph_of_pair = torch.arange(num_graphs, device=device)[:, None, None].expand_as(spd)[pairs]
    next_edge[pairs] = torch.where(next_flat >= 0, next_flat + edge_ptr[graph_of_pair], NO_EDGE)
    if num_edges_total and int(next_edge.max()) >= num_edges_total:
        raise ValueError("path_next_edge refers to edges the batch does not have")

    # Walk every path at once: `here` is the current node (local index) of the walk from i to j.
    edge_target = edge_index[1] - node_ptr[edge_graph]  # (E,) local index of each edge's target
    here = torch.arange(n_max, device=device)[None, :, None].expand_as(spd).clone()  # (B, N, N)
    rows = torch.arange(num_graphs, device=device)[:, None, None] * n_max * n_max
    cols = torch.arange(n_max, device=device)[None, None, :]
    next_edge_flat = next_edge.reshape(-1)
    hops = []
    for _ in range(max_hops):
        edge = next_edge_flat[rows + here * n_max + cols]  # (B, N, N) next_edge[b, here, j]
        hops.append(edge)
        step = edge >= 0
        here = torch.where(step, edge_target[edge.clamp(min=0)], here) if num_edges_total else here
    path_edges = (
        torch.stack(hops, -1)
        if hops
        else torch.empty((num_graphs, n_max, n_max, 0), dtype=torch.long, device=device)
    )  # (B, N, N, K)

    edge_attr = getattr(batch, "edge_attr", None)
    if edge_attr is not None and edge_attr.dim() == 1:
        edge_attr = edge_attr.unsqueeze(-1)  # (E, Fe)
    return DenseGraphBatch(
        x=x_dense,
        padding_mask=~real,
        in_degree=in_degree,
        out_degree=out_degree,
        spd=spd,
        path_edges=path_edges,
        edge_attr=edge_attr,
    )
