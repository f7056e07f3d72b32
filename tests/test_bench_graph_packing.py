"""The packed-against-padded Graphormer benchmark (benchmarks/bench_graph_packing.py) on a few
real molecules: every route timed, compared with padded, and predicting what padded predicts."""

from __future__ import annotations

import json

import pytest
import torch
from torch_geometric.data import Batch

from harness import graph_packing

from .test_graph_model import molecules


@pytest.mark.slow  # seconds: four tiny-preset Graphormers, each trained a step or two
def test_every_route_is_timed_against_padded_and_predicts_the_same(monkeypatch, tmp_path):
    graphs = molecules()
    for i, graph in enumerate(graphs):
        graph.y = torch.tensor([0.5 * i])  # a target, as the data sets' molecules carry
    batches = [Batch.from_data_list(graphs[:3]), Batch.from_data_list(graphs[3:6])]
    monkeypatch.setattr(graph_packing, "molecule_batches", lambda settings: batches)
    settings = graph_packing.GraphBenchSettings(repeats=1, pack_lengths=(None, 30, 10**9))
    result = graph_packing.run_graph_bench(settings)
    routes = ["padded", "packed", "packed-30", "packed-row"]
    assert list(result["time_ms"]) == routes and result["ratio"]["padded"] == 1.0
    assert all(result["max_prediction_difference"][r] < 1e-5 for r in routes)
    facts = result["facts"]["routes"]
    assert facts["packed-row"]["rows"] == 1
    # Packing never holds more inputs than padding, and one row holds exactly the real ones.
    assert facts["packed-row"]["tokens"] <= facts["packed"]["tokens"] <= facts["padded"]["tokens"]
    real = sum(g.num_nodes + 1 for g in graphs[:6]) / len(batches)
    assert facts["packed-row"]["tokens"] == pytest.approx(real)
    json.dumps(result)  # the script writes it as JSON
