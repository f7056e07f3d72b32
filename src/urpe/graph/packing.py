"""Packed graph batches: several graphs side by side in one row instead of one graph per row
padded to the largest (torch only).

A batch of B graphs of n_g = nodes + 1 inputs (graph token first) becomes R rows of P inputs:
each graph is a contiguous run of its row (a document), placed first-fit in batch order, the
row's tail (if any) a document of its own. Attention stays inside each document, so every
graph's inputs, bias and relation index are exactly those of the padded batch and its outputs
are the same; what changes is the work: R * P tokens instead of B * max n_g, and R * P^2 pairs
instead of B * (max n_g)^2 per head. With P = max n_g (the default) R is about
B * mean n_g / max n_g.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .encodings import GraphInputs


@dataclass
class PackedLayout:
    """Where each graph of a batch sits in the packed rows.

    Attributes:
        row, start, length: (B,) long, graph g occupies row[g], columns start[g] ..
            start[g] + length[g] - 1 (its graph token at start[g]).
        graph: (R, P) long, the graph at each place, or B + r on row r's unused tail.
        local: (R, P) long, the place's index inside its graph's padded inputs (0 on the tail).
    """

    row: Tensor
    start: Tensor
    length: Tensor
    graph: Tensor
    local: Tensor

    @property
    def num_graphs(self) -> int:
        return self.row.shape[0]

    @property
    def document_ids(self) -> Tensor:
        """(R, P) long: one id per graph, another per row tail (`urpe.attention`'s
        document_ids)."""
        return self.graph

    def same_document(self) -> Tensor:
        """(R, 1, P, P) bool: True where query and key belong to one graph (or one tail)."""
        return (self.graph[:, :, None] == self.graph[:, None, :])[:, None]


def pack_layout(lengths: Tensor, row_length: int | None = None) -> PackedLayout:
    """First-fit placement of graphs of `lengths` (B,) inputs into rows of `row_length`, or of
    the longest graph where that is longer (the default)."""
    sizes = [int(n) for n in lengths.tolist()]
    capacity = max([*sizes, 1 if row_length is None else row_length])
    used: list[int] = []  # columns filled per row
    row, start = [], []
    for size in sizes:
        r = next((i for i, filled in enumerate(used) if filled + size <= capacity), len(used))
        if r == len(used):
            used.append(0)
        row.append(r)
        start.append(used[r])
        used[r] += size
    device = lengths.device
    num_rows, width = max(len(used), 1), max(max(used, default=1), 1)
    row_t = torch.tensor(row, dtype=torch.long, device=device)
    start_t = torch.tensor(start, dtype=torch.long, device=device)
    length_t = lengths.to(device=device, dtype=torch.long)
    # Tails first (graph B + r, local 0), then every graph's run written over its places.
    graph = (torch.arange(num_rows, device=device) + len(sizes))[:, None].repeat(1, width)
    local = torch.zeros(num_rows, width, dtype=torch.long, device=device)
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=device), length_t)  # (T,)
    inside = torch.arange(len(owner), device=device) - (length_t.cumsum(0) - length_t)[owner]
    graph[row_t[owner], start_t[owner] + inside] = owner
    local[row_t[owner], start_t[owner] + inside] = inside
    return PackedLayout(row_t, start_t, length_t, graph, local)


def pack_inputs(inputs: GraphInputs, layout: PackedLayout) -> GraphInputs:
    """The padded batch's inputs (x (B, L, dim), bias (B, H, L, L), relation (B, L, L)) laid out
    in packed rows: x (R, P, dim), bias (R, H, P, P) and relation (R, P, P), each graph's block
    copied, zero across documents (never attended); padding_mask all False (tails are their own
    documents)."""
    batch = layout.num_graphs
    graph = layout.graph.clamp(max=batch - 1)  # (R, P) tails read graph B - 1, then are zeroed
    real = layout.graph < batch  # (R, P)
    x = inputs.x[graph, layout.local] * real[..., None]  # (R, P, dim)
    pairs = (layout.graph[:, :, None] == layout.graph[:, None, :]) & real[:, :, None]  # (R, P, P)
    rows = graph[:, :, None]
    query, key = layout.local[:, :, None], layout.local[:, None, :]
    bias = inputs.bias.permute(0, 2, 3, 1)[rows, query, key]  # (R, P, P, H)
    bias = (bias * pairs[..., None]).permute(0, 3, 1, 2)  # (R, H, P, P)
    relation = torch.where(pairs, inputs.relation[rows, query, key], 0)  # (R, P, P)
    padding_mask = torch.zeros_like(real)
    return GraphInputs(x=x, padding_mask=padding_mask, bias=bias, relation=relation)


def graph_token_states(hidden: Tensor, layout: PackedLayout) -> Tensor:
    """(R, P, dim) packed states -> (B, dim), each graph's token."""
    return hidden[layout.row, layout.start]


def mean_node_states(hidden: Tensor, layout: PackedLayout) -> Tensor:
    """(R, P, dim) packed states -> (B, dim), the mean over each graph's nodes (zeros for a
    graph without nodes)."""
    batch = layout.num_graphs
    node = (layout.graph < batch) & (layout.local > 0)  # (R, P) real nodes, not graph tokens
    total = hidden.new_zeros(batch, hidden.shape[-1])
    total.index_add_(0, layout.graph[node], hidden[node])
    count = (layout.length - 1).clamp(min=1).to(hidden.dtype)[:, None]
    return total / count
