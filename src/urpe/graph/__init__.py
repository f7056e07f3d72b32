"""Graph Transformers (Graphormer) with URPE on graphs.

Nothing here imports PyTorch Geometric; PyG's `Data`, `Batch` and DataLoaders work with all of
it. Torch and numpy only: `Graphormer`, `GraphormerConfig` (presets in `GRAPHORMER_PRESETS`:
"slim", Graphormer's ZINC model, and "tiny"), `GraphEncodingConfig`, `GraphormerEncodings` and
its pieces, `DenseGraphBatch`, `relation_index`, `to_dense_graph_batch`, `Graph`, `GraphBatch`,
`collate_graphs` (graphs and their batches without PyG), and `ShortestPaths` (a transform, PyG's
kind) with `shortest_paths`, which import SciPy (the `graph` extra) only for a graph of more than
`paths.DENSE_SEARCH_MAX_NODES` (64) nodes.

    from torch_geometric.loader import DataLoader
    dataset = SomePyGDataset(..., pre_transform=urpe.graph.ShortestPaths())
    for batch in DataLoader(dataset, batch_size=32):
        graphs = urpe.graph.to_dense_graph_batch(batch, max_hops=5)   # (B, N, ...) tensors
        inputs = encodings(graphs)  # x (B, N+1, dim), bias (B, H, N+1, N+1), relation, mask
"""

from __future__ import annotations

from .batching import Graph, GraphBatch, collate_graphs, to_dense_graph_batch
from .config import GraphEncodingConfig
from .dense import FAR, NO_EDGE, UNREACHABLE, DenseGraphBatch
from .encodings import (
    DegreeEncoding,
    EdgePathBias,
    FeatureEncoder,
    GraphInputs,
    GraphormerEncodings,
    SpatialBias,
    relation_index,
)
from .model import GRAPHORMER_PRESETS, READOUTS, Graphormer, GraphormerConfig
from .paths import ShortestPaths, shortest_paths

__all__ = [
    "FAR",
    "GRAPHORMER_PRESETS",
    "READOUTS",
    "Graphormer",
    "GraphormerConfig",
    "NO_EDGE",
    "UNREACHABLE",
    "DegreeEncoding",
    "DenseGraphBatch",
    "Graph",
    "GraphBatch",
    "EdgePathBias",
    "FeatureEncoder",
    "GraphEncodingConfig",
    "GraphInputs",
    "GraphormerEncodings",
    "ShortestPaths",
    "SpatialBias",
    "collate_graphs",
    "relation_index",
    "shortest_paths",
    "to_dense_graph_batch",
]
