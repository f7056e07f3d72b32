"""A checkpoint records its input encoding as data (`urpe.training.inputs`): the tokenizer of a
text model, the featuriser, target and unit of a model of molecules; loading builds the bundle
from that record alone, never from the run's experiment name. Checkpoints written before the
record existed (a training run's, and `save_model`'s flat record) keep loading."""

import json

import pytest
import torch

from urpe import load_model, save_model
from urpe.data.molecules import FEATURIZATIONS, MoleculeFeaturizer
from urpe.data.text import CharTokenizer
from urpe.graph import Graphormer, GraphormerConfig
from urpe.models import TransformerConfig
from urpe.models.lm import LanguageModel
from urpe.training.bundles import MoleculeModel, TextModel
from urpe.training.checkpoint import model_spec, write_checkpoint
from urpe.training.inputs import MoleculeInputs, TextInputs, input_record
from urpe.training.models import EncoderTokenClassifier
from urpe.training.objectives import Objective
from urpe.training.optim import OptimConfig

TEXT = "abcdefgh \n"


def language_model():
    tokenizer = CharTokenizer(TEXT)
    config = TransformerConfig(vocab_size=tokenizer.vocab_size, num_layers=1, dim=16, num_heads=2)
    return LanguageModel(config, 16), tokenizer


def graphormer():
    spec = FEATURIZATIONS["zinc"]
    return Graphormer(
        GraphormerConfig.preset("tiny"),
        node_cardinalities=spec.node_cardinalities,
        edge_cardinalities=spec.edge_cardinalities,
    )


def training_checkpoint(run_dir, model, run, inputs=None):
    """What a training run writes at step 7 (the objective's on_save_checkpoint, then the
    checkpoint IO), without training."""
    checkpoint = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "global_step": 7,
    }
    Objective(model, OptimConfig(), run=run, inputs=inputs).on_save_checkpoint(checkpoint)
    return write_checkpoint(checkpoint, run_dir / "checkpoints" / "step-00000007")


def old_training_checkpoint(run_dir, model, run):
    """A training checkpoint as urpe wrote it before the input record: no "inputs", no files."""
    checkpoint = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "global_step": 7,
        "urpe": {
            "model": model_spec(model),
            "state_dict_prefix": "model.",
            "objective": {"class": "Objective"},
            "run": run,
        },
    }
    return write_checkpoint(checkpoint, run_dir / "checkpoints" / "step-00000007")


def config_of(directory):
    return json.loads((directory / "config.json").read_text())


def test_a_training_checkpoint_carries_its_tokenizer_and_metric(tmp_path):
    model, tokenizer = language_model()
    run = {"experiment": "graph", "metric": "perplexity"}  # neither is read
    step = training_checkpoint(tmp_path / "run", model, run, TextInputs(tokenizer, "bpc"))
    assert config_of(step)["inputs"] == {
        "kind": "text",
        "tokenizer": {"file": "tokenizer.json", "kind": "char", "vocab_size": len(TEXT)},
        "metric": "bpc",
    }
    assert json.loads((step / "tokenizer.json").read_text()) == tokenizer.to_json()
    loaded = load_model(step)
    assert isinstance(loaded, TextModel) and loaded.tokenizer == tokenizer
    assert loaded.metric == "bpc"
    assert isinstance(loaded.generate("abc", 3, temperature=0), str)


def test_a_prompt_that_is_neither_text_nor_ids_is_named(tmp_path):
    """`generate(3.5)` said "'float' object is not iterable"."""
    model, tokenizer = language_model()
    save_model(model, tmp_path / "lm", tokenizer=tokenizer)
    loaded = load_model(tmp_path / "lm")
    for prompt in (3.5, None, 7, {"text": "abc"}):
        with pytest.raises(TypeError, match=r"a prompt is text \(a str\) or token ids: .* got "):
            loaded.generate(prompt, 3)
    ids = torch.tensor([1, 2])
    assert loaded.generate([1, 2], 3, temperature=0) == loaded.generate(ids, 3, temperature=0)


def test_a_training_checkpoint_carries_its_featurizer_target_and_unit(tmp_path):
    model = graphormer()
    featurizer = MoleculeFeaturizer("zinc", max_distance=5)
    run = {"experiment": "lm", "dataset": "moses-plogp", "target": "plogp"}  # none is read
    inputs = MoleculeInputs(featurizer, "gap", "eV")
    step = training_checkpoint(tmp_path / "run", model, run, inputs)
    assert config_of(step)["inputs"] == {
        "kind": "molecules",
        "featurizer": {"features": "zinc", "max_distance": 5, "shortest_paths": True},
        "target": "gap",
        "unit": "eV",
    }
    loaded = load_model(step)
    assert isinstance(loaded, MoleculeModel) and loaded.featurizer == featurizer
    assert (loaded.target, loaded.unit, loaded.quantity) == ("gap", "eV", "gap (eV)")
    graph = loaded.graphs(["CCO"])[0]
    assert torch.equal(graph.spd, featurizer("CCO").spd)
    assert loaded.predict(["CCO", "bad("])[1] is None


def test_a_model_of_tensors_says_so_and_loads_as_the_module(tmp_path):
    config = TransformerConfig(vocab_size=12, num_layers=1, dim=16, num_heads=2)
    model = EncoderTokenClassifier(config, 5)
    step = training_checkpoint(tmp_path / "run", model, {"experiment": "lm", "metric": "bpc"})
    assert config_of(step)["inputs"] == {"kind": "tensors"}
    assert isinstance(load_model(step), EncoderTokenClassifier)


def test_old_training_checkpoints_keep_loading(tmp_path):
    """No record: the run's config says which experiment wrote it and that experiment's
    encoding (the tokenizer in the run folder; the features, target and dataset's unit)."""
    model, tokenizer = language_model()
    tokenizer.save(tmp_path / "lm" / "tokenizer")  # where `urpe reproduce lm` keeps it
    step = old_training_checkpoint(
        tmp_path / "lm", model, {"experiment": "lm", "metric": "perplexity"}
    )
    assert "inputs" not in config_of(step) and not (step / "tokenizer.json").exists()
    loaded = load_model(step)
    assert isinstance(loaded, TextModel) and loaded.tokenizer == tokenizer
    assert loaded.metric == "perplexity"

    run = {
        "experiment": "graph",
        "dataset": "qm9",
        "target": "gap",
        "data": {"sizes": None, "split_seed": 0, "features": "zinc"},
    }
    loaded = load_model(old_training_checkpoint(tmp_path / "graph", graphormer(), run))
    assert isinstance(loaded, MoleculeModel) and loaded.featurizer == MoleculeFeaturizer("zinc")
    assert (loaded.target, loaded.unit) == ("gap", "eV")
    file_run = {**run, "dataset": "csv:sha256-0123456789ab", "target": "logP"}
    loaded = load_model(old_training_checkpoint(tmp_path / "file", graphormer(), file_run))
    assert (loaded.target, loaded.unit) == ("logP", "")

    config = TransformerConfig(vocab_size=12, num_layers=1, dim=16, num_heads=2)
    synthetic = old_training_checkpoint(
        tmp_path / "synthetic", EncoderTokenClassifier(config, 5), {"experiment": "synthetic"}
    )
    assert isinstance(load_model(synthetic), EncoderTokenClassifier)


def test_save_models_first_records_keep_loading(tmp_path):
    """`save_model` wrote {"kind": "molecules", "features", "target", "unit"} and, for text,
    {"kind": "text", "metric"} beside tokenizer.json."""
    save_model(graphormer(), tmp_path / "graph")
    config = config_of(tmp_path / "graph")
    config["inputs"] = {
        "kind": "molecules",
        "features": "rdkit",
        "target": "heavy",
        "unit": "atoms",
        "max_distance": 3,
    }
    (tmp_path / "graph" / "config.json").write_text(json.dumps(config))
    loaded = load_model(tmp_path / "graph")
    assert loaded.featurizer == MoleculeFeaturizer("rdkit", max_distance=3)
    assert (loaded.target, loaded.unit) == ("heavy", "atoms")

    model, tokenizer = language_model()
    save_model(model, tmp_path / "lm", tokenizer=tokenizer)
    config = config_of(tmp_path / "lm")
    config["inputs"] = {"kind": "text", "metric": "perplexity"}
    (tmp_path / "lm" / "config.json").write_text(json.dumps(config))
    loaded = load_model(tmp_path / "lm")
    assert isinstance(loaded, TextModel) and loaded.tokenizer == tokenizer
    assert loaded.metric == "perplexity"


@pytest.mark.parametrize(
    "config, record",
    [
        (
            {"inputs": {"kind": "molecules", "features": "zinc", "target": "y", "unit": ""}},
            {
                "kind": "molecules",
                "target": "y",
                "unit": "",
                "featurizer": {"features": "zinc", "max_distance": None, "shortest_paths": True},
            },
        ),
        ({"run": {"experiment": "lm", "metric": "bpc"}}, {"kind": "text", "metric": "bpc"}),
        ({"run": {"experiment": "synthetic"}}, {"kind": "tensors"}),
        ({"run": {"experiment": "finetune", "metric": "perplexity"}}, {"kind": "tensors"}),
        ({"inputs": {"kind": "tensors"}, "run": {"experiment": "lm"}}, {"kind": "tensors"}),
        ({"inputs": {}, "run": {}}, {"kind": "tensors"}),
    ],
)
def test_input_record_reads_every_form(config, record):
    assert input_record(config) == record


def test_a_bundle_saves_with_its_encoding_and_a_given_entry_over_it(tmp_path):
    featurizer = MoleculeFeaturizer("zinc", max_distance=4)
    save_model(graphormer(), tmp_path / "a", inputs=MoleculeInputs(featurizer, "gap", "eV"))
    loaded = load_model(tmp_path / "a")
    loaded.save(tmp_path / "b")
    assert config_of(tmp_path / "b")["inputs"] == config_of(tmp_path / "a")["inputs"]
    save_model(loaded, tmp_path / "c", inputs={"unit": "meV"})
    again = load_model(tmp_path / "c")
    assert (again.unit, again.target, again.featurizer) == ("meV", "gap", featurizer)


def test_the_tokenizer_must_sit_beside_the_weights(tmp_path):
    model, tokenizer = language_model()
    save_model(model, tmp_path / "lm", tokenizer=tokenizer)
    config = config_of(tmp_path / "lm")
    config["inputs"]["tokenizer"]["file"] = "../elsewhere.json"
    (tmp_path / "lm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="must be a file beside the weights"):
        load_model(tmp_path / "lm")
