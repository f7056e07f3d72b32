"""What a checkpoint records about its inputs: how raw data becomes the model's input, kept as
data in config.json's "inputs", so that loading a model never guesses it.

    {"kind": "text", "tokenizer": {"file": "tokenizer.json", "kind": "char", "vocab_size": 65},
     "metric": "bpc"}
    {"kind": "molecules", "featurizer": {"features": "zinc", "max_distance": null,
     "shortest_paths": true}, "target": "gap", "unit": "eV"}
    {"kind": "tensors"}    # the model takes tensors as they are (the synthetic tasks' tokens)

A training run hands its encoding to its objective (`Objective(..., inputs=TextInputs(...))`),
which writes the record into every checkpoint; `save_model` writes it into the folder it makes.
The tokenizer itself travels as tokenizer.json beside the weights (the record names the file).
`read_inputs(config, directory)` makes the objects again: `TextInputs` (the tokenizer, the
metric its losses are reported in) or `MoleculeInputs` (the featuriser, the target, its unit).

Older checkpoints: a training checkpoint written before the record existed has none, and
`save_model`'s first record of a molecule model was flat ({"kind", "features", "max_distance",
"target", "unit"}). `input_record(config)` reads both as the records above: such a checkpoint's
run config names the experiment that wrote it, and each experiment then had one encoding (text
for "lm", its tokenizer in the run folder; molecules for "graph", its features, target and
dataset in the run config). That is the only place an experiment's name is read, and only for a
checkpoint without a record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

TEXT, MOLECULES, TENSORS = "text", "molecules", "tensors"
TOKENIZER_FILE = "tokenizer.json"
# Checkpoints without a record: the encoding the experiment that wrote them always had.
LEGACY_KINDS = {"lm": TEXT, "graph": MOLECULES}


class InputEncoding:
    """How raw data becomes a model's input: its JSON record and the files that go with it."""

    kind: ClassVar[str] = TENSORS

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def files(self) -> dict[str, str]:
        """File name -> text, written beside the weights."""
        return {}


def default_metric(tokenizer: Any) -> str:
    """Bits per token for character and byte tokens, perplexity for subwords and words."""
    return "bpc" if tokenizer.kind in ("char", "byte") else "perplexity"


class TextInputs(InputEncoding):
    """Text through a `urpe.data.text` tokenizer; `metric` ("bpc" or "perplexity") is how the
    model's losses are reported."""

    kind = TEXT

    def __init__(self, tokenizer: Any, metric: str | None = None):
        self.tokenizer, self.metric = tokenizer, metric or default_metric(tokenizer)

    def record(self) -> dict[str, Any]:
        tokenizer = {
            "file": TOKENIZER_FILE,
            "kind": self.tokenizer.kind,
            "vocab_size": self.tokenizer.vocab_size,
        }
        return {"kind": self.kind, "tokenizer": tokenizer, "metric": self.metric}

    def files(self) -> dict[str, str]:
        return {TOKENIZER_FILE: json.dumps(self.tokenizer.to_json(), ensure_ascii=True)}


class MoleculeInputs(InputEncoding):
    """SMILES through a `urpe.data.molecules.MoleculeFeaturizer`, predicting `target` in `unit`
    ("" where the data names none, as a user's file)."""

    kind = MOLECULES

    def __init__(self, featurizer: Any, target: str, unit: str = ""):
        self.featurizer, self.target, self.unit = featurizer, target, unit

    def record(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "featurizer": self.featurizer.to_dict(),
            "target": self.target,
            "unit": self.unit,
        }


@dataclass
class RecordedInputs(InputEncoding):
    """A record given as JSON (to `save_model`), kept as it is (upgraded to the current form)."""

    given: dict[str, Any]
    written: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return dict(self.given)

    def files(self) -> dict[str, str]:
        return dict(self.written)


def input_record(config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint config's "inputs" in the current form, older checkpoints' included (see the
    module docstring); {"kind": "tensors"} where nothing needs encoding."""
    record = dict(config.get("inputs") or {})
    run = config.get("run") or {}
    kind = record.get("kind") or LEGACY_KINDS.get(run.get("experiment"), TENSORS)
    if kind == TEXT and "metric" not in record and run.get("metric"):
        record["metric"] = run["metric"]  # a training checkpoint: its run's metric
    if kind == MOLECULES and "featurizer" not in record:
        target = record.get("target") or run.get("target", "target")
        unit = record.get("unit")
        if unit is None:
            unit = _legacy_unit(run.get("dataset"), target)
        features = record.get("features") or (run.get("data") or {}).get("features", "zinc")
        featurizer = {
            "features": features,
            "max_distance": record.get("max_distance"),
            "shortest_paths": True,
        }
        return {"kind": kind, "featurizer": featurizer, "target": target, "unit": unit}
    return {**record, "kind": kind}


def _legacy_unit(dataset: str | None, target: str) -> str:
    if not dataset:
        return ""
    from ..data.molecules.datasets import molecule_unit

    return molecule_unit(dataset, target)


def read_inputs(config: dict[str, Any], directory: Path) -> InputEncoding | None:
    """The encoding a checkpoint's config records, its tokenizer read from `directory`; None
    when there is nothing to encode, or the tokenizer is missing (the model alone then)."""
    record = input_record(config)
    if record["kind"] == TEXT:
        from ..data.text.errors import DatasetError
        from ..data.text.tokenizers import load_tokenizer

        location = directory  # an older checkpoint: tokenizer.json near it (its run folder)
        if "tokenizer" in record:
            name = str(record["tokenizer"].get("file", ""))
            if not name or Path(name).name != name:
                raise ValueError(
                    f"{directory}: the tokenizer must be a file beside the weights, not {name!r}"
                )
            location = directory / name
        try:
            return TextInputs(load_tokenizer(location), record.get("metric"))
        except DatasetError:
            return None
    if record["kind"] == MOLECULES:
        from ..data.molecules.featurizer import MoleculeFeaturizer

        featurizer = MoleculeFeaturizer.from_dict(record["featurizer"])
        return MoleculeInputs(featurizer, record["target"], record.get("unit", ""))
    return None


def encoding_to_save(
    current: InputEncoding | None,
    tokenizer: Any = None,
    inputs: InputEncoding | dict[str, Any] | None = None,
) -> InputEncoding:
    """What `save_model` records: `inputs` when it is an encoding; else a `tokenizer` given
    (the model reads text; `inputs` may name its "metric"); else the bundle's own encoding
    (`current`) with the entries of an `inputs` dict over it; else that dict."""
    if isinstance(inputs, InputEncoding):
        return inputs
    given = dict(inputs or {})
    if tokenizer is not None:
        metric = given.get("metric") or getattr(current, "metric", None)
        return TextInputs(tokenizer, metric)
    if not given:
        return current or InputEncoding()
    base = current.record() if current is not None else {}
    files = current.files() if current is not None else {}
    return RecordedInputs(input_record({"inputs": {**base, **given}}), files)
