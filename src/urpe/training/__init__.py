"""Training on PyTorch Lightning: objectives that receive their model, data as a function of
(seed, step), safe checkpoints, and `fit` (resumable, multi-device, multi-node).

The core (`urpe.kernels` ... `urpe.models`) never imports this; it needs the `train` extra
(`pip install 'urpe[train]'`). Names are imported lazily, so `urpe.training.files` (atomic
writes, standard library only) loads without Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "checkpoint",
    "load_model": "bundles",
    "save_model": "checkpoint",
    "MoleculeModel": "bundles",
    "TextModel": "bundles",
    "read_checkpoint_config": "checkpoint",
    "InputEncoding": "inputs",
    "MoleculeInputs": "inputs",
    "TextInputs": "inputs",
    "GeneratedStream": "data",
    "IndexedStream": "data",
    "StepBatches": "data",
    "StepDataModule": "data",
    "derive_seed": "data",
    "EncoderTokenClassifier": "models",
    "Objective": "objectives",
    "TokenClassification": "objectives",
    "GraphRegression": "regression",
    "mean_absolute_error": "regression",
    "OptimConfig": "optim",
    "build_optimizer": "optim",
    "warmup_polynomial_decay": "optim",
    "TrainConfig": "trainer",
    "build_trainer": "trainer",
    "fit": "trainer",
    "quiet_lightning": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy names too (`dir`, the API reference, completion)
    return sorted({*globals(), *_EXPORTS})
