"""Configs written before encoding specs keep loading and build the same model: TransformerConfig
dicts with the flat gate fields (gate_init, gate_activation, num_buckets, bucket_max_distance,
encoding_options), a real checkpoint of that format, Graphormer configs with urpe=True, and
urpe.hf folders whose config.urpe is version 1 (max_distance, num_buckets, ...). Each is checked
by parameter names, shapes and values; the old keyword arguments still work, with a warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import urpe
import urpe.hf
from tests.hf_families import families
from urpe.encodings import EncodingSpec, RelativeEncoding, register_position, registered
from urpe.graph import Graphormer
from urpe.training.checkpoint import load_module, load_weights

from .tiny import tiny_config

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "results/lm/checkpoint-txl+urpe-seed0"  # saved before encoding specs


def old_transformer(**changes) -> dict:
    """A TransformerConfig as `to_dict` wrote it before specs: every flat field present."""
    return {
        "vocab_size": 11,
        "max_len": 6,
        "num_layers": 2,
        "dim": 8,
        "num_heads": 2,
        "ffn_dim": 16,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "norm_first": False,
        "activation": "gelu",
        "embedding_norm": True,
        "position": "rpe",
        "absolute": None,
        "gate": "toeplitz",
        "gate_init": "ones",
        "gate_activation": None,
        "normalization": "softmax",
        "share_position": True,
        "num_buckets": 32,
        "bucket_max_distance": 128,
        "num_relations": 32,
        "encoding_options": {},
        "markers": False,
        "mixers": {},
        "conv_kernel_size": 3,
        "attention_backend": "auto",
        "tie_embeddings": True,
        **changes,
    }


def built(config: urpe.TransformerConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return urpe.TransformerEncoder(config).state_dict()


def same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    "old, new, tables",
    [
        # Flat fields at their defaults name no option: the spec is the bare name.
        ({}, dict(position="rpe", gate="toeplitz"), {"layers.0.mixer.gate.table": (2, 11)}),
        (
            dict(gate_init="normal", gate_activation="softplus"),
            dict(gate={"name": "toeplitz", "init": "normal", "activation": "softplus"}),
            {"layers.0.mixer.gate.table": (2, 11)},
        ),
        # num_buckets and bucket_max_distance set both T5 tables, as they always did.
        (
            dict(position="t5", gate="t5", num_buckets=16, bucket_max_distance=64),
            dict(
                position={"name": "t5", "num_buckets": 16, "bucket_max_distance": 64},
                gate={"name": "t5", "num_buckets": 16, "bucket_max_distance": 64},
            ),
            {"layers.0.mixer.position.table": (2, 16), "layers.0.mixer.gate.table": (2, 16)},
        ),
        # ... and are ignored by encodings without buckets, as they always were.
        (dict(num_buckets=16, gate=None), dict(position="rpe", gate=None), {}),
        (
            dict(position="relation", gate="relation", num_relations=5),
            dict(position="relation", gate="relation", num_relations=5),
            {"layers.0.mixer.position.table": (2, 5), "layers.0.mixer.gate.table": (2, 5)},
        ),
    ],
)
def test_an_old_transformer_config_loads_as_the_same_model(old, new, tables):
    config = urpe.TransformerConfig.from_dict(old_transformer(**old))
    modern = old_transformer(**new)
    for legacy in (
        "gate_init",
        "gate_activation",
        "num_buckets",
        "bucket_max_distance",
        "encoding_options",
    ):
        modern.pop(legacy)
    assert config == urpe.TransformerConfig.from_dict(modern)
    assert config.to_dict() == json.loads(json.dumps(modern))  # written in the new form
    state = built(config)
    for key, shape in tables.items():
        assert tuple(state[key].shape) == shape, key
    same_state(state, built(urpe.TransformerConfig.from_dict(modern)))
    if config.gate is not None and "init" not in config.gate.options:
        assert torch.equal(
            state["layers.0.mixer.gate.table"], torch.ones(tables["layers.0.mixer.gate.table"])
        )


def test_old_keyword_arguments_warn_and_build_the_same_model():
    spec = {"name": "t5", "init": "normal", "num_buckets": 8}
    new = urpe.TransformerConfig(
        vocab_size=11, max_len=6, num_layers=2, dim=8, num_heads=2, gate=spec
    )
    with pytest.warns(DeprecationWarning, match="gate_init, num_buckets are deprecated"):
        old = tiny_config(
            num_layers=2,
            dim=8,
            ffn_dim=None,
            max_len=6,
            gate="t5",
            gate_init="normal",
            num_buckets=8,
        )
    assert old == new and old.gate_init is None and old.num_buckets is None
    same_state(built(old), built(new))
    gate = urpe.TransformerEncoder(old).layers[0].mixer.gate
    assert gate.table.shape == (2, 8) and not torch.equal(gate.table, torch.ones(2, 8))


def test_old_encoding_options_set_the_declared_option():
    class WindowBias(RelativeEncoding):
        def __init__(self, window):
            super().__init__()
            self.window = window

    build = lambda s: WindowBias(s.window)  # noqa: E731
    with registered(register_position, "window", WindowBias, build, options={"window": 2}):
        config = urpe.TransformerConfig.from_dict(
            old_transformer(position="window", gate=None, encoding_options={"window": 5})
        )
        assert config.position == EncodingSpec("window", {"window": 5})
        assert urpe.TransformerEncoder(config).layers[1].mixer.position.window == 5
        with pytest.raises(ValueError, match="not declared by position='rpe'"):
            urpe.TransformerConfig.from_dict(old_transformer(encoding_options={"window": 5}))


def test_a_checkpoint_saved_before_specs_loads_every_weight_under_its_old_name():
    saved = load_weights(CHECKPOINT / "model.safetensors")
    model = load_module(CHECKPOINT)
    assert model.config.gate == EncodingSpec("toeplitz") and model.config.gate_init is None
    state = model.state_dict()
    assert "decoder.layers.0.mixer.gate.table" in state
    expected = {k.removeprefix("model."): v for k, v in saved.items()}
    assert set(state) == set(expected)
    for key, value in state.items():
        assert torch.equal(value, expected[key]), key


def test_an_old_graphormer_config_with_urpe_true_loads_as_the_relation_gate():
    old = {
        "graphormer": {
            "num_layers": 2,
            "dim": 8,
            "ffn_dim": 8,
            "num_heads": 2,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "norm_first": True,
            "max_distance": 3,
            "max_hops": 2,
            "max_degree": 64,
            "readout": "graph-token",
            "urpe": True,
            "backend": "auto",
            "init_std": 0.02,
        },
        "node_cardinalities": [28],
        "node_features": None,
        "edge_cardinalities": [4],
        "edge_features": None,
        "directed": False,
    }
    torch.manual_seed(0)
    model = Graphormer.from_model_config(old)
    assert model.config.gate == EncodingSpec("relation")
    tables = {k: v for k, v in model.state_dict().items() if ".gate." in k}
    assert list(tables) == ["layers.0.mixer.gate.table", "layers.1.mixer.gate.table"]
    assert all(torch.equal(t, torch.ones(2, 7)) for t in tables.values())  # R = 3 + 4
    new = {**old, "graphormer": {**old["graphormer"], "gate": "relation"}}
    new["graphormer"].pop("urpe")
    assert model.model_config() == new
    torch.manual_seed(0)
    same_state(model.state_dict(), Graphormer.from_model_config(new).state_dict())
    plain = {**old, "graphormer": {**old["graphormer"], "urpe": False}}
    assert Graphormer.from_model_config(plain).config.gate is None
    with pytest.warns(DeprecationWarning, match="gate='relation'"):
        assert urpe.graph.GraphormerConfig(urpe=True).gate == EncodingSpec("relation")


LLAMA = families()["llama"]
OLD_ENTRIES = {
    "toeplitz": {"max_distance": 5, "num_buckets": None, "bucket_max_distance": 64},
    "buckets": {"max_distance": None, "num_buckets": 8, "bucket_max_distance": 20},
}


@pytest.mark.parametrize("kind", sorted(OLD_ENTRIES))
def test_an_hf_folder_with_a_version_1_entry_loads_its_gates(tmp_path, kind):
    entry = {
        **OLD_ENTRIES[kind],
        "shared": False,
        "layers": [1],
        "attn_implementation": "sdpa",
        "version": 1,
        "load": "...",
    }
    gate = (
        "toeplitz"
        if kind == "toeplitz"
        else {"name": "t5", "num_buckets": 8, "bucket_max_distance": 20}
    )
    reach = {} if kind == "buckets" else {"max_distance": 5}
    model = urpe.hf.add_urpe(LLAMA.build("sdpa", torch.float64), gate=gate, layers=[1], **reach)
    with torch.no_grad():
        for p in urpe.hf.gate_parameters(model):
            p.add_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) / 10)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["urpe"] = entry  # what urpe wrote before gate specs
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = urpe.hf.from_pretrained(
        tmp_path, transformers.AutoModelForCausalLM, dtype=torch.float64
    )
    gates = {n: p for n, p in loaded.named_parameters() if "urpe" in n}
    width = 11 if kind == "toeplitz" else 8
    assert list(gates) == ["model.layers.1.self_attn.urpe_gate.table"]
    assert gates["model.layers.1.self_attn.urpe_gate.table"].shape == (4, width)
    for (n, p), (m, q) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n
    assert EncodingSpec.of(loaded.config.urpe["gate"]) == EncodingSpec.of(gate)


def test_add_urpe_num_buckets_still_means_buckets_over_the_context():
    with pytest.warns(DeprecationWarning, match="gate=\\{'name': 't5'"):
        old = urpe.hf.add_urpe(LLAMA.build("sdpa", torch.float32), num_buckets=8)
    new = urpe.hf.add_urpe(
        LLAMA.build("sdpa", torch.float32), gate={"name": "t5", "num_buckets": 8}
    )
    assert old.config.urpe == new.config.urpe
    assert old.config.urpe["gate"] == {"name": "t5", "num_buckets": 8, "bucket_max_distance": 64}
    from urpe.experiments.finetune.presets import VARIANTS

    buckets = urpe.hf.add_urpe(LLAMA.build("sdpa", torch.float32), **VARIANTS["urpe-buckets"].urpe)
    gate = buckets.model.layers[0].self_attn.urpe_gate
    assert gate.table.shape == (4, 32) and gate.bucket_max_distance == 64  # the context length
