"""Graph Transformers (Graphormer) with URPE on graphs.

Nothing here imports PyTorch Geometric; PyG's `Data`, `Batch` and DataLoaders work with all of
it. Torch-only parts: `Graphormer`, `GraphormerConfig` (presets in `GRAPHORMER_PRESETS`: "slim",
Graphormer's ZINC model, and "tiny"), `GraphEncodingConfig`, `GraphormerEncodings` and its
pieces, `DenseGraphBatch`, `relation_index`, `to_dense_graph_batch`, and `Graph`,
`GraphBatch`, `collate_graphs` (graphs and their batches without PyG). Parts that need SciPy
(the `graph` extra), loaded on first use: `ShortestPaths` (a transform, PyG's kind),
`shortest_paths`.

    from torch_geometric.loader import DataLoader
    dataset = SomePyGDataset(..., pre_transform=urpe.graph.ShortestPaths())
    for batch in DataLoader(dataset, batch_size=32):
        graphs = urpe.graph.to_dense_graph_batch(batch, max_hops=5)   # (B, N, ...) tensors
        inputs = encodings(graphs)  # x (B, N+1, dim), bias (B, H, N+1, N+1), relation, mask
"""

from __future__ import annotations

import importlib
from typing import Any

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

# Names that need scipy: imported when first asked for.
_LAZY = {"ShortestPaths": ".paths", "shortest_paths": ".paths"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name], __name__)
        except ImportError as error:
            raise ImportError(
                f"urpe.graph.{name} needs SciPy: pip install 'urpe[graph]' ({error})"
            ) from error
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy names too (`dir`, the API reference, completion)
    return sorted({*globals(), *_LAZY})


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
