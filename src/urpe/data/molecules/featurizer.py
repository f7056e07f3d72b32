"""One object that turns a molecule into a Graphormer's input, wherever one is made: the
datasets (`load_molecules`), the user's files (`load_molecule_file`), and a trained model's
`predict` and `urpe evaluate` (the checkpoint records it, see `urpe.training.inputs`).

    featurizer = MoleculeFeaturizer("zinc")      # the featurisation, then the shortest paths
    graph = featurizer("CCO")                    # Data, or None where RDKit cannot read it
    featurizer.tensors(["CCO", "c1ccccc1"])      # urpe.graph.Graph each: no PyG needed
    featurizer.to_dict()                         # {"features": "zinc", "max_distance": None,
                                                 #  "shortest_paths": True}: what a checkpoint keeps

A transform in PyTorch Geometric's manner, in two steps: SMILES -> the molecule's graph with
categorical atom and bond features (`featurize.smiles_to_graph`, `features` names which) -> the
relation between every pair of atoms (`urpe.graph.ShortestPaths`: distances and one canonical
path per pair). `parse` and `relate` are the two steps, for a dataset that computes its target
from the parsed molecule before the relation; a graph that is already featurised (PyG's ZINC)
takes `relate` alone, or the featuriser itself. `tensors` makes the same graphs as
`urpe.graph.Graph`s, for a trained model's predictions, which never import PyTorch Geometric
(seconds of start-up).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rdkit import Chem, rdBase

from ...graph.batching import Graph
from ...graph.paths import ShortestPaths
from .featurize import FEATURIZATIONS, FeatureSpec, molecule_tensors, parse_smiles, smiles_to_graph

if TYPE_CHECKING:
    from torch_geometric.data import Data


class MoleculeFeaturizer:
    """SMILES (or a featurised graph) -> the model's input graph.

    Args:
        features: the featurisation, a name of `FEATURIZATIONS` ("zinc": atom and bond type as
            ZINC; "rdkit": PyG's richer RDKit features).
        max_distance: passed to `ShortestPaths` (distances above it stored as FAR).
        shortest_paths: add the relation (Graphormer needs it); False stops at the graph.

    Output: Data with x (N, F) long, edge_index (2, E), edge_attr (E, Fe) long, smiles (when
    made from SMILES), and with the relation spd and path_next_edge (N * N,) int16.
    """

    def __init__(
        self, features: str = "zinc", max_distance: int | None = None, shortest_paths: bool = True
    ) -> None:
        if features not in FEATURIZATIONS:
            choices = ", ".join(FEATURIZATIONS)
            raise ValueError(f"features must be one of {choices}, got {features!r}")
        self.features = features
        self.paths = ShortestPaths(max_distance=max_distance) if shortest_paths else None

    @property
    def max_distance(self) -> int | None:
        return None if self.paths is None else self.paths.max_distance

    @property
    def spec(self) -> FeatureSpec:
        """Categories per column of x and edge_attr (what the model's embeddings need)."""
        return FEATURIZATIONS[self.features]

    def parse(self, smiles: str) -> tuple[Data, Chem.Mol] | None:
        """The featurised graph (no relation yet) and RDKit's molecule; None when RDKit cannot
        read or featurise it (RDKit's messages are the caller's to silence)."""
        return smiles_to_graph(smiles, self.features) if smiles else None

    def relate(self, data: Data) -> Data:
        """The graph with the relation of every pair of its nodes added."""
        return data if self.paths is None else self.paths(data)

    def __call__(self, item: str | Data) -> Data | None:
        """The graph of a SMILES, or a graph's copy with the relation (as PyG transforms do)."""
        return self.forward(item if isinstance(item, str) else copy.copy(item))

    def forward(self, item: str | Data) -> Data | None:
        if not isinstance(item, str):
            return self.relate(item)
        parsed = self.parse(item)
        if parsed is None:
            return None
        data = parsed[0]
        data.smiles = item
        return self.relate(data)

    def graphs(self, smiles: Iterable[str]) -> list[Data | None]:
        """Each SMILES as the model's input, None where RDKit cannot read it (RDKit quiet)."""
        with rdBase.BlockLogs():
            return [self(text) for text in smiles]

    def tensors(self, smiles: Iterable[str]) -> list[Graph | None]:
        """`graphs` as `urpe.graph.Graph`s (the same tensors), made without PyTorch Geometric."""
        out: list[Graph | None] = []
        with rdBase.BlockLogs():
            for text in smiles:
                mol = parse_smiles(text) if text else None
                graph = None if mol is None else molecule_tensors(mol, self.features)
                out.append(None if graph is None else self.relate(graph))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON: what `from_dict` needs to make the same featuriser."""
        return {
            "features": self.features,
            "max_distance": self.max_distance,
            "shortest_paths": self.paths is not None,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> MoleculeFeaturizer:
        unknown = set(record) - {"features", "max_distance", "shortest_paths"}
        if unknown:
            raise ValueError(f"unknown featuriser settings {sorted(unknown)}")
        return cls(**record)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MoleculeFeaturizer) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.to_dict().items()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.features!r}, paths={self.paths!r})"
