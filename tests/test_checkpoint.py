"""Checkpoints and records are never arbitrary pickles; configs survive JSON."""

import json
import pickle

import pytest
import torch

from urpe.cli import main
from urpe.models import TransformerConfig, TransformerDecoder
from urpe.training.bundles import load_model
from urpe.training.checkpoint import (
    CheckpointError,
    load_training_state,
    load_weights,
    read_checkpoint,
    save_weights,
    write_checkpoint,
)
from urpe.training.files import atomic_write_json, read_json

from .tiny import tiny_flags


class _Payload:
    """Unpickling this would create the file named `marker` (standing in for any code)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious(path, marker):
    path.write_bytes(pickle.dumps({"state": _Payload(str(marker))}))


def test_config_round_trips_through_json_with_mixers():
    config = TransformerConfig(
        vocab_size=11,
        max_len=16,
        num_layers=3,
        position="rpe",
        gate="toeplitz",
        mixers={0: "bilinear", 2: "conv"},
        markers=True,
    )
    again = TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.mixers == {0: "bilinear", 2: "conv"}
    with pytest.raises(ValueError, match="unknown TransformerConfig fields: colour"):
        TransformerConfig.from_dict({**config.to_dict(), "colour": "red"})


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path):
    decoder = TransformerDecoder(
        TransformerConfig(vocab_size=7, max_len=8, num_layers=1, dim=16, num_heads=2)
    )
    assert decoder.head.weight is decoder.embed.weight
    save_weights(decoder.state_dict(), tmp_path / "w.safetensors")
    weights = load_weights(tmp_path / "w.safetensors")
    assert weights["head.weight"] is weights["embed.weight"]
    fresh = TransformerDecoder(decoder.config)
    fresh.load_state_dict(weights)
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), decoder.state_dict().values(), strict=True)
    )


def _checkpoint(tmp_path):
    decoder = TransformerDecoder(
        TransformerConfig(vocab_size=7, max_len=8, num_layers=1, dim=16, num_heads=2)
    )
    from urpe.training.checkpoint import model_spec

    state = {
        "global_step": 3,
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(2)}}}],
        "state_dict": {f"model.{k}": v for k, v in decoder.state_dict().items()},
        "urpe": {"model": model_spec(decoder), "state_dict_prefix": "model."},
    }
    return decoder, write_checkpoint(state, tmp_path / "checkpoints" / "step-00000003")


def test_a_checkpoint_round_trips_and_loads_as_a_model(tmp_path):
    decoder, directory = _checkpoint(tmp_path)
    assert read_checkpoint(directory)["optimizer_states"][0]["state"][0]["exp_avg"].sum() == 2
    loaded = load_model(tmp_path)  # the run folder: its newest checkpoint
    tokens = torch.randint(7, (1, 5))
    assert torch.equal(loaded(tokens), decoder.eval()(tokens))


def test_a_malicious_training_state_is_refused_and_runs_nothing(tmp_path):
    _, directory = _checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    _malicious(directory / "training_state.pt", marker)
    with pytest.raises(CheckpointError, match="training_state.pt: refused to load"):
        read_checkpoint(directory)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_training_state(directory / "training_state.pt")
    assert not marker.exists()


def test_a_pickle_posing_as_weights_or_config_is_refused(tmp_path):
    _, directory = _checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    _malicious(directory / "model.safetensors", marker)
    with pytest.raises(CheckpointError, match="model.safetensors: not a safetensors file"):
        load_model(directory)
    _malicious(directory / "config.json", marker)
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(directory)
    assert not marker.exists()


def test_config_json_cannot_name_code_outside_urpe(tmp_path):
    _, directory = _checkpoint(tmp_path)
    config = read_json(directory / "config.json")
    config["model"]["class"] = "os:system"
    atomic_write_json(directory / "config.json", config)
    with pytest.raises(ValueError, match="only classes in urpe"):
        load_model(directory)


TINY = tiny_flags("synthetic", tasks="probe", checkpoint_every=None)


def test_malicious_files_in_a_results_folder_are_named_and_never_run(tmp_path, capsys):
    out, marker = tmp_path / "out", tmp_path / "pwned"
    assert (
        main(["reproduce", "synthetic", "--out", str(out), *TINY, "--checkpoint-every", "4"]) == 0
    )
    (record,) = (out / "records").glob("*.json")
    (run,) = (out / "runs").iterdir()
    _malicious(record, marker)
    _malicious(run / "checkpoints" / "step-00000008" / "training_state.pt", marker)
    capsys.readouterr()
    assert main(["reproduce", "synthetic", "--out", str(out), *TINY, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"{record}: not UTF-8 text" in err or f"{record}: invalid JSON" in err
    assert "training_state.pt: refused to load" in err and "starting the run again" in err
    assert "Traceback" not in err and not marker.exists()
    assert read_json(record)["result"]["accuracy"] >= 0  # trained again and rewritten


def test_every_torch_load_in_the_package_passes_weights_only_true():
    import ast
    from pathlib import Path

    import urpe

    calls = []
    for path in Path(urpe.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and getattr(node.func.value, "id", "") == "torch"
            ):
                keywords = {k.arg: k.value for k in node.keywords}
                flag = keywords.get("weights_only")
                calls.append((path.name, isinstance(flag, ast.Constant) and flag.value is True))
    assert calls and all(ok for _, ok in calls), calls
