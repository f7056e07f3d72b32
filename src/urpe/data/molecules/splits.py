"""What a molecule dataset is once built, whichever source it came from (a packaged dataset,
`datasets.py`, or the user's file, `files.py`): three `GraphSplit`s in a `MoleculeDataset`,
with the featuriser that made their graphs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch_geometric.data import Data, InMemoryDataset
from torch_geometric.data.collate import collate

from .featurize import FeatureSpec
from .featurizer import MoleculeFeaturizer

SPLITS = ("train", "val", "test")


class GraphSplit(InMemoryDataset):
    """One split of a dataset, in memory: a PyTorch Geometric dataset (index it, slice it, give
    it to `torch_geometric.loader.DataLoader`).

    Each graph: x (N, F) long, edge_index (2, E), edge_attr (E, Fe) long, y (1,) float32,
    smiles (str; absent for ZINC), and from `ShortestPaths`: spd and path_next_edge (N * N,).
    """

    def __init__(self, data: Data, slices: dict[str, torch.Tensor], transform=None) -> None:
        super().__init__(root=None, transform=transform, log=False)
        self._data, self.slices = data, slices

    @classmethod
    def from_graphs(cls, graphs: Sequence[Data]) -> GraphSplit:
        if not graphs:
            return cls(Data(), {})
        # PyG's InMemoryDataset.collate skips the slices for a single graph; keep them always.
        data, slices, _ = collate(Data, list(graphs), increment=False, add_batch=False)
        return cls(data, slices)

    def to_storage(self) -> dict[str, Any]:
        """Tensors, strings and numbers only: what the cache can load without unpickling."""
        return {"data": self._data.to_dict(), "slices": dict(self.slices)}

    @classmethod
    def from_storage(cls, storage: dict[str, Any]) -> GraphSplit:
        return cls(Data.from_dict(storage["data"]), storage["slices"])

    @property
    def targets(self) -> torch.Tensor:
        """Every graph's target, (len(self),)."""
        return self._data.y


def target_stats(split: GraphSplit) -> dict[str, float]:
    """Mean and sd of a split's targets (NaN for an empty split, sd 0 for one graph)."""
    if len(split) == 0:
        return {"mean": float("nan"), "std": float("nan")}
    y = split.targets.double()
    return {"mean": float(y.mean()), "std": float(y.std()) if y.numel() > 1 else 0.0}


@dataclass
class MoleculeDataset:
    """Three splits plus what a model and a report need to know about them.

    Attributes:
        name, target, unit: the dataset, its target's name and unit ("" for a user's file).
        featurizer: what turned its molecules into graphs (and turns new ones the same way).
        train, val, test: `GraphSplit`s.
        info: sizes, dropped molecules, target mean/sd per split, build time, source details.
        path: the cache entry the data was read from.
    """

    name: str
    target: str
    unit: str
    featurizer: MoleculeFeaturizer
    train: GraphSplit
    val: GraphSplit
    test: GraphSplit
    info: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @property
    def features(self) -> str:
        """The featurisation's name (`featurize.FEATURIZATIONS`)."""
        return self.featurizer.features

    @property
    def feature_spec(self) -> FeatureSpec:
        """Categories per column of x and edge_attr."""
        return self.featurizer.spec

    def split(self, name: str) -> GraphSplit:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return getattr(self, name)
