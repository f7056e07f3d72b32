"""One gate spec, three front doors: every registered gate (and one registered by the test)
through `TransformerConfig`, `GraphormerConfig` and `urpe.hf.add_urpe` on a tiny Llama. Each door
builds the gate from the registry, runs forward and backward, the gate gets a gradient, and at
init "ones" the output equals the ungated model; a door that cannot run a gate (the registry says
what it reads) refuses it in one line."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch_geometric.data import Batch

import urpe
import urpe.hf
from tests.hf_families import families, inputs, outputs
from urpe.data.molecules import FEATURIZATIONS, smiles_to_graph
from urpe.encodings import GATE_REGISTRY, EncodingSpec, register_gate, registered
from urpe.graph import Graphormer, GraphormerConfig, ShortestPaths

from .graph_reference import SMILES
from .tiny import tiny_config

DOORS = ("transformer", "graphormer", "hf")
LLAMA = families()["llama"]


def refused(door: str, name: str) -> bool:
    """Read from the registry's declarations, never from the gate's name: token sequences carry
    no relation index, graph nodes no order."""
    entry = GATE_REGISTRY[name]
    return (door == "hf" and entry.uses_relation) or (door == "graphormer" and entry.uses_order)


def transformer(gate):
    """(gated, ungated with the same weights, forward) for a Transformer encoder."""
    config = tiny_config(
        num_layers=2, dim=8, ffn_dim=None, max_len=6, position="rpe", gate=gate, num_relations=4
    )
    gated = urpe.TransformerEncoder(config).double()
    plain = urpe.TransformerEncoder(replace(config, gate=None)).double()
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(0))
    relation = torch.randint(0, 4, (2, 6, 6), generator=torch.Generator().manual_seed(1))
    positions = urpe.Positions.graph(relation)  # aligned positions, with a relation
    return gated, plain, lambda model: model(tokens, positions=positions)


def graphormer(gate):
    config = GraphormerConfig(
        num_layers=2,
        dim=8,
        ffn_dim=8,
        num_heads=2,
        attention_dropout=0.0,
        max_distance=3,
        max_hops=2,
        gate=gate,
    )
    zinc = FEATURIZATIONS["zinc"]
    sizes = dict(
        node_cardinalities=zinc.node_cardinalities, edge_cardinalities=zinc.edge_cardinalities
    )
    gated = Graphormer(config, **sizes).double()
    plain = Graphormer(replace(config, gate=None), **sizes).double()
    batch = Batch.from_data_list([ShortestPaths()(smiles_to_graph(s)[0]) for s in SMILES[:3]])
    return gated, plain, lambda model: model(batch)


def hf(gate):
    plain = LLAMA.build("sdpa", torch.float64)
    gated = urpe.hf.add_urpe(copy.deepcopy(plain), gate=gate)
    feed, real = inputs(LLAMA)
    return gated, plain, lambda model: outputs(LLAMA, model, feed)[real]


BUILD = {"transformer": transformer, "graphormer": graphormer, "hf": hf}


def is_gate(key: str) -> bool:
    # layers.0.mixer.gate.table (Transformer, Graphormer), ...self_attn.urpe_gate.table (HF)
    return key.split(".")[-2] in ("gate", "urpe_gate")


def check_door(door: str, gate, ones_at_init: bool) -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(0)
    gated, plain, forward = BUILD[door](gate)
    gates = {n: p for n, p in gated.named_parameters() if is_gate(n)}
    assert gates, f"{door} built no gate for {gate}"
    result = plain.load_state_dict(gated.state_dict(), strict=False)  # the same other weights
    assert result.missing_keys == [] and all(is_gate(k) for k in result.unexpected_keys)
    gated.train(False), plain.train(False)
    out = forward(gated)
    if ones_at_init:
        torch.testing.assert_close(out, forward(plain), rtol=1e-10, atol=1e-10)
    out.square().sum().backward()
    for name, p in gates.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    return gates


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("name", list(GATE_REGISTRY))
def test_every_registered_gate_runs_in_every_door_or_is_refused_in_one_line(name, door):
    if refused(door, name):
        with pytest.raises(ValueError) as error:
            BUILD[door](name)
        message = str(error.value)
        assert f"gate {name!r} reads" in message and "choose one of" in message
        assert "\n" not in message
        return
    ones = GATE_REGISTRY[name].options.get("init") == "ones"
    check_door(door, name, ones_at_init=ones)


class HeadGate(torch.nn.Module):
    """c_ij = table[h]: a gate that reads no position at all, so every door can run it."""

    def __init__(self, num_heads: int, init: str):
        super().__init__()
        start = torch.ones(num_heads) if init == "ones" else torch.rand(num_heads) + 2
        self.table = torch.nn.Parameter(start)

    def forward(self, positions):
        return self.table.view(1, -1, 1, 1)  # (1, H, 1, 1): broadcast over every pair


@pytest.mark.parametrize("door", DOORS)
def test_a_gate_registered_in_a_test_runs_in_every_door_with_its_options(door):
    build = lambda s: HeadGate(s.num_heads, s.init)  # noqa: E731
    with registered(register_gate, "test-head", HeadGate, build, options={"init": "ones"}):
        gates = check_door(door, "test-head", ones_at_init=True)
        assert all(torch.equal(p, torch.ones_like(p)) for p in gates.values())
        # The spec's option reaches the module in every door.
        gates = check_door(door, {"name": "test-head", "init": "normal"}, ones_at_init=False)
        assert all((p > 1).all() for p in gates.values())
        with pytest.raises(ValueError, match="gate 'test-head' has no option 'scale'"):
            BUILD[door]({"name": "test-head", "scale": 2})
    assert "test-head" not in GATE_REGISTRY


def test_registered_restores_the_registry_even_when_the_block_raises():
    before = dict(GATE_REGISTRY)
    build = lambda s: HeadGate(s.num_heads, "ones")  # noqa: E731
    with pytest.raises(RuntimeError, match="inside"):
        with registered(register_gate, "test-head", HeadGate, build):
            register_gate("test-other", build)(HeadGate)  # registered inside: undone too
            raise RuntimeError("inside")
    assert GATE_REGISTRY == before
    with pytest.raises(ValueError, match="already taken"):
        with registered(register_gate, "toeplitz", HeadGate, build):
            pass
    assert GATE_REGISTRY == before


def test_a_spec_is_a_name_or_a_dict_and_round_trips_through_json():
    assert EncodingSpec.of("toeplitz") == EncodingSpec("toeplitz")
    spec = EncodingSpec.of({"name": "toeplitz", "init": "normal"})
    assert (
        spec == EncodingSpec("toeplitz", {"init": "normal"})
        and str(spec) == "toeplitz(init='normal')"
    )
    assert spec.to_json() == {"name": "toeplitz", "init": "normal"}
    assert EncodingSpec.of(spec.to_json()) == spec and EncodingSpec("t5").to_json() == "t5"
    with pytest.raises(ValueError, match="needs a 'name'"):
        EncodingSpec.of({"init": "normal"})
    with pytest.raises(TypeError, match="an encoding spec is a name"):
        EncodingSpec.of(3)


def test_the_same_spec_builds_the_same_gate_in_each_door():
    """A spec's options mean the same everywhere: a t5 gate with 8 buckets and a softplus."""
    spec = {"name": "t5", "num_buckets": 8, "bucket_max_distance": 16, "activation": "softplus"}
    config = urpe.TransformerConfig(vocab_size=5, num_layers=1, dim=8, num_heads=2, gate=spec)
    llama = urpe.hf.add_urpe(LLAMA.build("sdpa", torch.float32), gate=spec)
    for gate in (
        urpe.TransformerEncoder(config).layers[0].mixer.gate,
        llama.model.layers[0].self_attn.urpe_gate,
    ):
        assert gate.table.shape[1] == 8 and gate.bucket_max_distance == 16
        assert gate.activation is torch.nn.functional.softplus
    assert llama.config.urpe["gate"] == spec


def test_an_option_may_not_hide_a_size_the_door_gives():
    build = lambda s: HeadGate(s.num_heads, "ones")  # noqa: E731
    with pytest.raises(ValueError, match=r"declares options \['num_heads'\], names"):
        with registered(register_gate, "test-head", HeadGate, build, options={"num_heads": 2}):
            pass
    assert "test-head" not in GATE_REGISTRY
