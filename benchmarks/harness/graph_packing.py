"""Graphormer training steps on packed molecule batches against today's padded ones (issue 32).

The graph experiment's model (`reproduce graph`'s "tiny" Graphormer with the URPE relation gate,
or any preset) on real molecules (moses-plogp, QM9, ZINC as the experiment loads them), one
batch of `batch_size` molecules per step: "padded" puts each molecule in its own row padded to
the batch's largest; the packed routes (`GraphormerConfig(pack=True, pack_length=P)`,
`urpe.graph.packing`) put molecules side by side in rows of P inputs: "packed" P = the largest
molecule, "packed-P" a fixed P, "packed-row" the whole batch in one row. All models hold the
same weights; a step is the experiment's: dense batch, forward, L1 loss, backward, AdamW. The
routes are timed interleaved (median over repeats, different batches in turn), and their
predictions on every batch are compared with the padded ones before timing (they must agree:
the routes compute the same function).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from urpe.bench.clocks import interleaved_medians

BASELINE = "padded"
ONE_ROW = 10**9  # a row length beyond any batch: the whole batch in one row


@dataclass(frozen=True)
class GraphBenchSettings:
    dataset: str = "moses-plogp"
    batch_size: int = 64  # the graph experiment's
    batches: int = 4  # distinct batches the steps cycle through
    model: str = "tiny"  # a GRAPHORMER_PRESETS name
    repeats: int = 9
    zinc_dir: str | None = None
    pack_lengths: tuple[int | None, ...] = (None, 64, ONE_ROW)  # the packed routes' rows


def route_name(pack_length: int | None) -> str:
    if pack_length is None:
        return "packed"
    return "packed-row" if pack_length >= ONE_ROW else f"packed-{pack_length}"


def molecule_batches(settings: GraphBenchSettings) -> list:
    """`batches` PyG batches of `batch_size` training molecules (ShortestPaths applied)."""
    from torch_geometric.data import Batch

    from urpe.data.molecules import load_molecules

    count = settings.batch_size * settings.batches
    data = load_molecules(
        settings.dataset, sizes=(count, 2, 2), seed=0, progress=False, zinc_dir=settings.zinc_dir
    )
    graphs = [data.train[i] for i in range(min(count, len(data.train)))]
    size = settings.batch_size
    return [Batch.from_data_list(graphs[i : i + size]) for i in range(0, len(graphs), size)]


def graphormer_routes(model: str, pack_lengths) -> dict[str, torch.nn.Module]:
    """{"padded": Graphormer with the URPE gate, route_name(P): the same weights packed}."""
    from urpe.data.molecules import FEATURIZATIONS
    from urpe.graph import Graphormer, GraphormerConfig

    spec = FEATURIZATIONS["zinc"]
    routes = {
        BASELINE: {},
        **{route_name(p): {"pack": True, "pack_length": p} for p in pack_lengths},
    }
    models = {}
    for name, packing in routes.items():
        config = GraphormerConfig.preset(model, gate="relation", **packing)
        models[name] = Graphormer(
            config,
            node_cardinalities=spec.node_cardinalities,
            edge_cardinalities=spec.edge_cardinalities,
        )
        models[name].load_state_dict(models[BASELINE].state_dict())
    return models


def _training_step(model: torch.nn.Module, batches: list) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    turn = [0]

    def step() -> None:
        batch = batches[turn[0] % len(batches)]
        turn[0] += 1
        optimizer.zero_grad(set_to_none=True)
        loss = (model(batch) - batch.y.reshape(-1).to(torch.float32)).abs().mean()
        loss.backward()
        optimizer.step()

    return step


def layout_facts(batches: list, max_hops: int, pack_lengths) -> dict:
    """Per route: rows, inputs (tokens) and attention pairs (per head) of a batch, averaged;
    and the molecules' mean and largest node counts."""
    from urpe.graph import to_dense_graph_batch
    from urpe.graph.packing import pack_layout

    facts: dict[str, dict[str, list[float]]] = {}

    def add(route: str, rows: int, width: int) -> None:
        entry = facts.setdefault(route, {"rows": [], "tokens": [], "pairs": []})
        for key, value in (("rows", rows), ("tokens", rows * width), ("pairs", rows * width**2)):
            entry[key].append(value)

    nodes_mean, nodes_max = [], []
    for batch in batches:
        dense = to_dense_graph_batch(batch, max_hops=max_hops)
        lengths = (~dense.padding_mask).sum(1) + 1  # (B,) graph token + nodes
        nodes_mean.append(float(lengths.float().mean()) - 1)
        nodes_max.append(dense.max_nodes)
        add(BASELINE, len(lengths), dense.max_nodes + 1)
        for p in pack_lengths:
            add(route_name(p), *pack_layout(lengths, p).graph.shape)
    routes = {r: {k: statistics.mean(v) for k, v in f.items()} for r, f in facts.items()}
    return {
        "nodes_mean": statistics.mean(nodes_mean),
        "nodes_max": statistics.mean(nodes_max),
        "routes": routes,
    }


def run_graph_bench(settings: GraphBenchSettings, progress=None) -> dict:
    """{settings, facts, threads, and per route: time_ms, ratio (to padded) and
    max_prediction_difference (to padded)}."""
    batches = molecule_batches(settings)
    models = graphormer_routes(settings.model, settings.pack_lengths)
    with torch.no_grad():
        expected = [models[BASELINE].eval()(b) for b in batches]
        difference = {}
        for name, model in models.items():
            got = [model.eval()(b) for b in batches]
            difference[name] = max(
                float((g - e).abs().max()) for g, e in zip(got, expected, strict=True)
            )
    calls = {name: _training_step(model.train(), batches) for name, model in models.items()}
    for call in calls.values():  # warm-up: the C++ kernel's first build, allocator
        call()
    times = interleaved_medians(calls, settings.repeats, progress=progress)
    return {
        "settings": vars(settings),
        "facts": layout_facts(batches, models[BASELINE].config.max_hops, settings.pack_lengths),
        "threads": torch.get_num_threads(),
        "time_ms": times,
        "ratio": {name: t / times[BASELINE] for name, t in times.items()},
        "max_prediction_difference": difference,
    }
