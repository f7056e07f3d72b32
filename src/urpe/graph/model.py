"""Graphormer (Ying et al. 2021) with URPE on graphs as a switch (torch only, plus PyTorch Geometric
when it is called on a PyG `Batch`).

    config = GraphormerConfig.preset("slim", gate="relation")
    model = Graphormer(config, node_cardinalities=(28,), edge_cardinalities=(4,))
    prediction = model(batch)                      # a torch_geometric Batch -> (num_graphs,)

Per batch, once: `GraphormerEncodings` turns the graphs into L = N + 1 inputs (graph token first),
a dense per-head bias B (spatial + edge encoding, (B, H, L, L)) and the relation index r(i, j)
(shortest-path distance, far, unreachable, the graph token's virtual distance). Every layer then
attends with

    A = softmax(Q K^T / sqrt(d) + B) * C_l[h, r(i, j)]         (URPE; C = 1 without it)

where C_l is layer l's own (H, R) table, ones at initialisation, passed to the kernels as a
`Relation` term: the tiled CPU kernels (cpp, blockwise) read it tile by tile, no (B, H, L, L) gate
is built. With
C all ones the model computes exactly what plain Graphormer computes. URPE adds H * R
parameters per layer (slim, R = max_distance + 4 = 24: 12 * 8 * 24 = 2,304; the paper reports
+2,416 for its Graphormer, whose relation count it does not state).

Readout: the graph token's final state (Graphormer), or the mean over real nodes; then
Graphormer's head (Linear, GELU, LayerNorm, Linear to one number), scaled by the target statistics
stored in the model (`set_target_statistics`), so predictions are in the data's units.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..encodings import (
    GATE_REGISTRY,
    EncodingSettings,
    EncodingSpec,
    Positions,
    SpecLike,
    build_encoding,
    check_runs,
    resolve,
)
from ..kernels import BACKENDS, AttentionCalls
from ..nn import AttentionContext, MultiheadAttention, TransformerLayer
from .config import GraphEncodingConfig, relation_count
from .dense import DenseGraphBatch
from .encodings import GraphInputs, GraphormerEncodings
from .packing import graph_token_states, mean_node_states, pack_inputs, pack_layout

READOUTS = ("graph-token", "mean")


@dataclass(frozen=True)
class GraphormerConfig:
    """Architecture of a `Graphormer` (the data's feature sizes are given to the model).

    Attributes:
        num_layers, dim, ffn_dim, num_heads: the Transformer (dim divisible by num_heads).
        dropout: on embeddings, residual branches and inside the feed-forward net.
        attention_dropout: on the attention weights (after the gate, as in URPE).
        norm_first: pre-LN (Graphormer) or post-LN.
        max_distance: distances 0..max_distance get their own bias (and gate) entry.
        max_hops: K, edges per shortest path read by the edge encoding.
        max_degree: degrees above it share one embedding.
        readout: "graph-token" (Graphormer) or "mean" over the real nodes.
        gate: URPE's gate C, one per layer: None, or a gate spec (`urpe.encodings.EncodingSpec`:
            a name in GATE_REGISTRY or {"name": ..., <option>: ...}) whose gate reads relations
            or nothing positional; "relation" (URPE on graphs) is indexed like the spatial bias,
            ones at init. Gates that read sequence order are refused: nodes have none.
        urpe: deprecated alias, True for gate="relation" (older configs load).
        backend: `urpe.attention` backend ("auto": the C++ tile loop on CPU, Triton on CUDA).
        init_std: std of the embeddings' normal initialisation.
        pack: run the layers on packed rows (`urpe.graph.packing`: graphs side by side, each
            attending only to itself) instead of one row per graph padded to the largest; the
            same outputs, less padding (a batch that would keep a row per graph runs padded).
        pack_length: the packed rows' length in inputs (nodes + graph token per graph), at
            least the batch's largest graph (None: that). A length beyond the batch's inputs
            makes one row.
    """

    num_layers: int = 12
    dim: int = 80
    ffn_dim: int = 80
    num_heads: int = 8
    dropout: float = 0.0
    attention_dropout: float = 0.1
    norm_first: bool = True
    max_distance: int = 20
    max_hops: int = 5
    max_degree: int = 64
    readout: str = "graph-token"
    urpe: bool = False
    backend: str = "auto"
    init_std: float = 0.02
    gate: SpecLike | None = None
    pack: bool = False
    pack_length: int | None = None

    def __post_init__(self) -> None:
        if self.urpe:
            warnings.warn(
                "GraphormerConfig(urpe=True) is deprecated: give gate='relation'",
                DeprecationWarning,
                stacklevel=3,
            )
        object.__setattr__(self, "gate", _gate_of(self.gate, self.urpe))
        object.__setattr__(self, "urpe", False)
        for name in ("num_layers", "dim", "ffn_dim", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} must be divisible by num_heads={self.num_heads}")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("max_distance", "max_hops", "max_degree"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(
                f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {self.backend!r}"
            )
        if self.pack_length is not None and (not self.pack or self.pack_length < 1):
            raise ValueError(
                f"pack_length needs pack=True and must be >= 1, got {self.pack_length}"
            )
        if self.readout not in READOUTS:
            raise ValueError(f"readout must be one of {', '.join(READOUTS)}, got {self.readout!r}")
        if self.gate is not None:
            _, entry = resolve(GATE_REGISTRY, self.gate, "gate", (None, *GATE_REGISTRY))
            check_runs(GATE_REGISTRY, entry, self.gate_settings())

    def gate_settings(self) -> EncodingSettings:
        """What a gate of this model is built from: its sizes and the relation count; the nodes
        of a graph have no order."""
        return EncodingSettings(
            num_heads=self.num_heads,
            head_dim=self.dim // self.num_heads,
            dim=self.dim,
            max_length=0,
            num_relations=relation_count(self.max_distance),
            ordered=False,
            model="a Graphormer",
        )

    @classmethod
    def preset(cls, name: str, **changes: Any) -> GraphormerConfig:
        """A named preset (`GRAPHORMER_PRESETS`) with `changes` applied."""
        if name not in GRAPHORMER_PRESETS:
            raise ValueError(
                f"unknown Graphormer preset {name!r}; choose from {', '.join(GRAPHORMER_PRESETS)}"
            )
        return replace(GRAPHORMER_PRESETS[name], **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field but the deprecated `urpe`, JSON-ready (the gate as a name or a dict)."""
        data = {k: v for k, v in asdict(self).items() if k != "urpe"}
        data["gate"] = None if self.gate is None else self.gate.to_json()
        if not self.pack:  # the same model either way: unpacked configs keep their old form
            del data["pack"], data["pack_length"]
        return data

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GraphormerConfig:
        """The inverse of `to_dict`; also reads older configs' `urpe: true` (no warning)."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown GraphormerConfig fields {sorted(unknown)}")
        values = dict(values)
        values["gate"] = _gate_of(values.get("gate"), values.pop("urpe", False))
        return cls(**values)


def _gate_of(gate: SpecLike | None, urpe: bool) -> EncodingSpec | None:
    """The gate spec of a config that may use the deprecated `urpe` switch."""
    if urpe:
        if gate is not None and EncodingSpec.of(gate).name != "relation":
            raise ValueError(f"urpe=True means gate='relation'; give gate={gate!r} alone")
        return EncodingSpec.of(gate or "relation")
    return None if gate is None else EncodingSpec.of(gate)


GRAPHORMER_PRESETS: dict[str, GraphormerConfig] = {
    # Graphormer's ZINC model ("graphormer_slim"): 12 pre-LN layers, width 80, FFN 80, 8 heads;
    # its ZINC script uses dropout 0.0 and attention dropout 0.1.
    "slim": GraphormerConfig(),
    # For 2 CPU cores: 4 layers, width 64 (a few minutes per run on a few thousand molecules).
    "tiny": GraphormerConfig(num_layers=4, dim=64, ffn_dim=64, num_heads=8, attention_dropout=0.0),
}


class Graphormer(nn.Module):
    """Graph regression: a batch of graphs -> one number per graph.

    Args:
        config: the architecture (`GraphormerConfig`).
        node_cardinalities / node_features: categorical node feature columns (category counts,
            e.g. ZINC's 28 atom types) or the width of real-valued node features; exactly one.
        edge_cardinalities / edge_features: the same for edges; neither turns the edge encoding
            off.
        directed: separate in- and out-degree embeddings.
    """

    def __init__(
        self,
        config: GraphormerConfig,
        *,
        node_cardinalities: tuple[int, ...] | list[int] | None = None,
        node_features: int | None = None,
        edge_cardinalities: tuple[int, ...] | list[int] | None = None,
        edge_features: int | None = None,
        directed: bool = False,
    ):
        super().__init__()
        if not isinstance(config, GraphormerConfig):
            raise TypeError(f"config must be a GraphormerConfig, got {type(config).__name__}")
        self.config = config
        self.encoding_config = GraphEncodingConfig(
            dim=config.dim,
            num_heads=config.num_heads,
            node_cardinalities=tuple(node_cardinalities) if node_cardinalities else None,
            node_features=node_features,
            edge_cardinalities=tuple(edge_cardinalities) if edge_cardinalities else None,
            edge_features=edge_features,
            max_degree=config.max_degree,
            max_distance=config.max_distance,
            max_hops=config.max_hops,
            directed=directed,
            init_std=config.init_std,
        )
        self.encodings = GraphormerEncodings(self.encoding_config)
        self.input_dropout = nn.Dropout(config.dropout)
        # the layers' attention calls, prepared once per kind and kept from pass to pass
        self.attention_calls = AttentionCalls()
        self.layers = nn.ModuleList(
            TransformerLayer(
                MultiheadAttention(
                    config.dim,
                    config.num_heads,
                    # One gate per layer (B is shared: computed once per batch by the encodings).
                    gate=self._new_gate(),
                    dropout=config.attention_dropout,
                    backend=config.backend,
                ),
                config.dim,
                config.ffn_dim,
                dropout=config.dropout,
                norm_first=config.norm_first,
            )
            for _ in range(config.num_layers)
        )
        # Pre-LN leaves the residual stream unnormalised: Graphormer normalises it once at the end.
        self.final_norm = nn.LayerNorm(config.dim) if config.norm_first else nn.Identity()
        self.head = nn.Sequential(
            nn.Linear(config.dim, config.dim),
            nn.GELU(),
            nn.LayerNorm(config.dim),
            nn.Linear(config.dim, 1),
        )
        # prediction = shift + scale * head(h): the head learns standardised targets.
        self.register_buffer("target_shift", torch.zeros(()))
        self.register_buffer("target_scale", torch.ones(()))

    def _new_gate(self) -> nn.Module | None:
        if self.config.gate is None:
            return None
        return build_encoding(GATE_REGISTRY, self.config.gate, self.config.gate_settings(), "gate")

    # -------------------------------------------------------------------------------- set-up
    def set_target_statistics(self, mean: float, std: float) -> None:
        """Predict mean + std * (head output): call with the training targets' statistics."""
        if not std > 0:
            raise ValueError(f"std must be > 0, got {std}")
        self.target_shift.fill_(float(mean))
        self.target_scale.fill_(float(std))

    def gate_tables(self) -> list[Tensor]:
        """The layers' URPE gates, each (H, R) (empty without URPE); column r of layer l is
        C_l for relation r (see `urpe.graph.relation_index`)."""
        return [layer.mixer.gate.table for layer in self.layers if layer.mixer.gate is not None]

    # ---------------------------------------------------------------------------------- forward
    def dense(self, batch: Any) -> DenseGraphBatch:
        """A PyG `Batch` (or `Data`) as a `DenseGraphBatch` (returned as is if it already is)."""
        if isinstance(batch, DenseGraphBatch):
            return batch
        from .batching import to_dense_graph_batch

        return to_dense_graph_batch(batch, max_hops=self.config.max_hops)

    def _layers(self, inputs: GraphInputs, attn_mask: Tensor | None = None) -> Tensor:
        """Final hidden states (rows, L, dim) of the Transformer over `inputs`."""
        context = AttentionContext(
            positions=Positions.graph(inputs.relation),  # the gates read relation (B, L, L)
            key_padding_mask=inputs.padding_mask,
            attn_mask=attn_mask,
            bias=inputs.bias,  # (B, H, L, L), computed once, the same for every layer
            calls=self.attention_calls,
        )
        x = self.input_dropout(inputs.x)  # (B, L, dim)
        for layer in self.layers:
            x = layer(x, context)
        return self.final_norm(x)

    def embed(self, batch: Any) -> tuple[Tensor, Tensor]:
        """Final hidden states (B, L, dim) over [graph token, nodes], and the (B, L) padding
        mask (True = padded node; never the graph token); one padded row per graph."""
        inputs = self.encodings(self.dense(batch))
        return self._layers(inputs), inputs.padding_mask

    def _pooled_padded(self, inputs: GraphInputs) -> Tensor:
        """(B, dim) readout of one padded row per graph."""
        hidden = self._layers(inputs)  # (B, L, dim)
        if self.config.readout == "graph-token":
            return hidden[:, 0]
        real = (~inputs.padding_mask[:, 1:]).to(hidden.dtype).unsqueeze(-1)  # (B, N, 1)
        # A graph with no nodes pools to zeros instead of 0 / 0.
        return (hidden[:, 1:] * real).sum(1) / real.sum(1).clamp(min=1)

    def _pooled_packed(self, inputs: GraphInputs) -> Tensor:
        """(B, dim) readout of the packed route (`urpe.graph.packing`); a batch that packing
        would leave in as many rows as graphs takes the padded route (the same, cheaper)."""
        layout = pack_layout((~inputs.padding_mask).sum(1), self.config.pack_length)
        if layout.graph.shape[0] >= layout.num_graphs:
            return self._pooled_padded(inputs)
        # Each graph attends only to itself: a (R, 1, P, P) mask, no larger than the bias the
        # rows carry anyway.
        hidden = self._layers(pack_inputs(inputs, layout), layout.same_document())
        if self.config.readout == "graph-token":
            return graph_token_states(hidden, layout)
        return mean_node_states(hidden, layout)

    def forward(self, batch: Any) -> Tensor:
        """batch: a `torch_geometric.data.Batch` whose graphs went through
        `urpe.graph.ShortestPaths`, or a `DenseGraphBatch` -> predictions (num_graphs,)."""
        inputs = self.encodings(self.dense(batch))
        route = self._pooled_packed if self.config.pack else self._pooled_padded
        out = self.head(route(inputs)).squeeze(-1)  # (B,)
        return self.target_shift + self.target_scale * out

    # ------------------------------------------------------------------------- checkpointing
    def model_config(self) -> dict[str, Any]:
        """JSON description from which `from_model_config` rebuilds this model (fresh weights)."""
        e = self.encoding_config
        return {
            "graphormer": self.config.to_dict(),
            "node_cardinalities": list(e.node_cardinalities) if e.node_cardinalities else None,
            "node_features": e.node_features,
            "edge_cardinalities": list(e.edge_cardinalities) if e.edge_cardinalities else None,
            "edge_features": e.edge_features,
            "directed": e.directed,
        }

    @classmethod
    def from_model_config(cls, config: dict[str, Any]) -> Graphormer:
        values = dict(config)
        return cls(GraphormerConfig.from_dict(values.pop("graphormer")), **values)
