"""Shortest paths of a graph, computed once per graph: distances and one canonical shortest path
per pair, as a transform in PyTorch Geometric's manner (without importing it: numpy, and SciPy for
large graphs).

For every ordered pair (i, j) the transform stores
- `spd[i, j]`: the number of edges on a shortest path from i to j (0 on the diagonal),
  `UNREACHABLE` (-1) when j cannot be reached from i, `FAR` (-2) when the distance exceeds the
  transform's `max_distance`;
- `path_next_edge[i, j]`: the edge (its position in `edge_index`) that a shortest path from i to
  j takes first, -1 on the diagonal and for unreachable pairs.

The whole path from i to j follows by walking: take edge `path_next_edge[i, j]` to its target u,
then `path_next_edge[u, j]`, and so on, until j. Storing the first edge instead of the whole path
keeps the cache at two (N, N) integer matrices per graph whatever the number of hops;
`urpe.graph.to_dense_graph_batch` does the walk for a whole batch at once.

Which shortest path. Where several shortest paths join i and j (rings), the choice matters to
Graphormer's edge encoding, which reads the edge features along the path. Graphormer's
Floyd-Warshall takes whichever path its loop order finds first, so the encoding of a pair can
change when the atoms are renumbered. Here the chosen path is the one whose sequence of edge
features (read from i towards j) is lexicographically smallest; all paths with that smallest
sequence give the same encoding, so relabelling the nodes permutes the encodings exactly.
Distances come from a breadth-first search from every node at once, one (N, N) matrix product per
level (numpy; `scipy.sparse.csgraph` above `DENSE_SEARCH_MAX_NODES` nodes, where the dense
products would cost more than SciPy's sparse search); the canonical next edges from a dynamic
programme over distance levels (one vectorised numpy step per level, never a loop over node
pairs):

    key(u, j) = min over edges u -> v with d(v, j) = d(u, j) - 1 of (feature(u -> v), rank(v, j))

where rank(v, j) orders the best remaining feature sequences of all pairs one level closer.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .dense import FAR, UNREACHABLE

# Stored as int16 to keep the cache small: (N, N) per graph for both matrices.
STORAGE_DTYPE = torch.int16
_STORAGE_MAX = torch.iinfo(STORAGE_DTYPE).max

# Graphs up to this size (drug-like molecules have a few dozen atoms) get their distances from
# dense matrix products: no SciPy import, a third of a second of `urpe predict`'s start-up. Each
# level costs an (N, N) product, and a graph has up to N - 1 levels: at 64 nodes a search costs
# about what SciPy's sparse one does (0.3-2.6 ms either way), at 128 up to 100 times more.
DENSE_SEARCH_MAX_NODES = 64


def _edge_feature_ids(edge_attr: np.ndarray | None, num_edges: int) -> np.ndarray:
    """One integer per edge that orders edges by their feature vectors, lexicographically.

    Equal feature vectors get equal ids. Without features every edge gets 0.
    """
    if edge_attr is None or num_edges == 0:
        return np.zeros(num_edges, dtype=np.int64)
    rows = edge_attr.reshape(num_edges, -1)  # (E, Fe)
    _, ids = np.unique(rows, axis=0, return_inverse=True)
    return ids.reshape(-1).astype(np.int64)


def shortest_paths(
    edge_index: np.ndarray | Tensor,
    num_nodes: int,
    edge_attr: np.ndarray | Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """All-pairs shortest-path distances and canonical first edges of a directed graph.

    Args:
        edge_index: (2, E) source and target of every edge; an undirected graph lists both
            directions, as PyTorch Geometric does. Self-loops and repeated edges are allowed.
        num_nodes: N.
        edge_attr: (E,) or (E, Fe) edge features used to choose among equally short paths (the
            lexicographically smallest feature sequence wins); None treats all edges alike.

    Returns:
        (spd, next_edge), both (N, N) int64. spd holds d(i, j) in edges, `UNREACHABLE` where no
        path exists; next_edge the first edge of the chosen shortest path from i to j, -1 on the
        diagonal and where j is unreachable.
    """
    edge_index = np.asarray(edge_index, dtype=np.int64).reshape(2, -1)
    n, num_edges = int(num_nodes), edge_index.shape[1]
    if num_edges and (edge_index.min() < 0 or edge_index.max() >= n):
        raise ValueError(f"edge_index refers to nodes outside 0..{n - 1}")
    if edge_attr is not None:
        edge_attr = np.asarray(edge_attr)
        if edge_attr.shape[0] != num_edges:
            raise ValueError(f"edge_attr has {edge_attr.shape[0]} rows for {num_edges} edges")
    next_edge = np.full((n, n), -1, dtype=np.int64)
    if n == 0:
        return np.zeros((0, 0), dtype=np.int64), next_edge
    src, dst = edge_index
    spd = distances(src, dst, n)
    if num_edges == 0:
        return spd, next_edge

    feature = _edge_feature_ids(edge_attr, num_edges)  # (E,)
    # Candidate (edge, target) pairs: edge u -> v lies on a shortest path from u to j exactly
    # when d(v, j) = d(u, j) - 1. Self-loops never qualify.
    d_src, d_dst = spd[src], spd[dst]  # (E, N) each
    on_path = (d_dst >= 0) & (d_src == d_dst + 1)
    cand_edge, cand_target = np.nonzero(on_path)  # (C,), (C,)
    cand_level = d_src[cand_edge, cand_target]  # (C,) distance from the edge's source to j
    # rank[v, j]: position of the best feature sequence from v to j among all pairs at the
    # same distance; the diagonal (empty sequence) has rank 0.
    rank = np.zeros((n, n), dtype=np.int64)
    num_ranks = 1
    for level in range(1, int(cand_level.max(initial=0)) + 1):
        at_level = cand_level == level
        e, j = cand_edge[at_level], cand_target[at_level]
        if e.size == 0:
            continue
        u, v = src[e], dst[e]
        key = feature[e] * num_ranks + rank[v, j]  # (feature, remaining rank), lexicographic
        group = u * n + j
        # Sort by (pair, key, edge id): the first row of each pair is its chosen edge; among
        # edges with equal keys the smallest id wins (their feature sequences are identical).
        order = np.lexsort((e, key, group))
        first = np.ones(order.size, dtype=bool)
        first[1:] = group[order[1:]] != group[order[:-1]]
        chosen = order[first]
        next_edge[u[chosen], j[chosen]] = e[chosen]
        best_key = key[chosen]
        # Dense ranks of the chosen keys order the sequences of this level for the next one.
        distinct, level_rank = np.unique(best_key, return_inverse=True)
        rank[u[chosen], j[chosen]] = level_rank.reshape(-1)
        num_ranks = max(num_ranks, distinct.size)
    return spd, next_edge


def distances(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> np.ndarray:
    """(N, N) int64: the number of edges on a shortest path from i to j along the directed edges
    src -> dst (E,) each, 0 on the diagonal, `UNREACHABLE` where j cannot be reached from i."""
    n = num_nodes
    if n > DENSE_SEARCH_MAX_NODES:
        try:
            from scipy.sparse import coo_matrix
            from scipy.sparse.csgraph import shortest_path
        except ImportError as error:  # named so that the CLI says what to install
            raise ModuleNotFoundError(
                f"shortest paths of a graph of more than {DENSE_SEARCH_MAX_NODES} nodes need "
                f"SciPy: pip install 'urpe[graph]' ({error})",
                name="scipy",
            ) from error

        adjacency = coo_matrix((np.ones(src.size), (src, dst)), shape=(n, n)).tocsr()
        dist = shortest_path(adjacency, directed=True, unweighted=True)  # (N, N), inf if none
        return np.where(np.isfinite(dist), dist, UNREACHABLE).astype(np.int64)
    # float32 products count walks exactly (at most N per entry); only "> 0" is read.
    adjacency = np.zeros((n, n), dtype=np.float32)
    adjacency[src, dst] = 1.0
    spd = np.full((n, n), UNREACHABLE, dtype=np.int64)
    np.fill_diagonal(spd, 0)
    reached = np.eye(n, dtype=bool)  # (source, node): distance known
    frontier = np.eye(n, dtype=np.float32)  # (source, node): reached at the last level
    for level in range(1, n):
        new = (frontier @ adjacency > 0) & ~reached  # one more edge from the last level
        if not new.any():
            break
        spd[new] = level
        reached |= new
        frontier = new.astype(np.float32)
    return spd


class ShortestPaths:
    """Adds `spd` and `path_next_edge` to a graph: its shortest-path distances and the first edge
    of one canonical shortest path per pair (see the module docstring).

    A transform as PyTorch Geometric's are (its datasets take it as `pre_transform` or
    `transform`): called on a graph (a PyG `Data`, or a `urpe.graph.Graph`), it returns a shallow
    copy with the two added and leaves its input as it was; `forward` adds them in place.

    Both are stored flattened, shape (N * N,) in row-major (i, j) order, dtype int16, so that
    PyTorch Geometric's batching concatenates graphs of different sizes; `path_next_edge` holds
    positions within the graph's own `edge_index` (not shifted by batching).
    `urpe.graph.to_dense_graph_batch` turns them back into (B, N, N) tensors.

    Use it as a `pre_transform`, so that it runs once per graph and is cached with the dataset.

    Args:
        max_distance: if given, distances above it are stored as `FAR` (-2); their paths are
            kept. None stores every distance.
        use_edge_attr: choose among equally short paths by `edge_attr` (lexicographically
            smallest feature sequence); False ignores features (first edge by position).
    """

    def __init__(self, max_distance: int | None = None, use_edge_attr: bool = True) -> None:
        if max_distance is not None and max_distance < 0:
            raise ValueError(f"max_distance must be >= 0 or None, got {max_distance}")
        self.max_distance = max_distance
        self.use_edge_attr = use_edge_attr

    def __call__(self, data: Any) -> Any:
        return self.forward(copy.copy(data))

    def forward(self, data: Any) -> Any:
        n = data.num_nodes
        if n is None:
            raise ValueError("ShortestPaths needs a graph with a known number of nodes")
        num_edges = data.edge_index.shape[1] if data.edge_index is not None else 0
        if n > _STORAGE_MAX or num_edges > _STORAGE_MAX:
            raise ValueError(
                f"ShortestPaths stores int16 indices: at most {_STORAGE_MAX} nodes and edges per "
                f"graph, got {n} nodes and {num_edges} edges"
            )
        edge_index = (
            data.edge_index.cpu().numpy()
            if data.edge_index is not None
            else np.zeros((2, 0), dtype=np.int64)
        )
        edge_attr = None
        if self.use_edge_attr and data.edge_attr is not None:
            edge_attr = data.edge_attr.detach().cpu().numpy()
        spd, next_edge = shortest_paths(edge_index, n, edge_attr)
        if self.max_distance is not None:
            spd[spd > self.max_distance] = FAR
        data.spd = torch.from_numpy(spd.reshape(-1)).to(STORAGE_DTYPE)  # (N*N,)
        data.path_next_edge = torch.from_numpy(next_edge.reshape(-1)).to(STORAGE_DTYPE)
        return data

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_distance={self.max_distance}, "
            f"use_edge_attr={self.use_edge_attr})"
        )
