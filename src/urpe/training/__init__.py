"""Training on PyTorch Lightning: a token classifier, generated data, the paper's schedule.

The core (`urpe.kernels` ... `urpe.models`) never imports this; it needs the `train` extra.
"""

from .data import GeneratedBatches, GeneratedDataModule
from .module import TokenClassifier
from .optim import OptimConfig, build_optimizer, warmup_polynomial_decay
from .trainer import StepProgressBar, TrainConfig, build_trainer, quiet_lightning

__all__ = [
    "GeneratedBatches",
    "GeneratedDataModule",
    "OptimConfig",
    "StepProgressBar",
    "TokenClassifier",
    "TrainConfig",
    "build_optimizer",
    "build_trainer",
    "quiet_lightning",
    "warmup_polynomial_decay",
]
