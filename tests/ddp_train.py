"""Run by tests/test_ddp.py: a tiny training, written so torchrun can start it on N processes.

usage: python ddp_train.py OUT DEVICES ACCUMULATE   (under torchrun for DEVICES > 1)
Each rank saves its final weights to OUT/rank<r>.safetensors.
"""

import functools
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import TensorDataset

from urpe.models import TransformerConfig
from urpe.tasks import get_task
from urpe.training import (
    EncoderTokenClassifier,
    GeneratedStream,
    OptimConfig,
    StepDataModule,
    TokenClassification,
    TrainConfig,
    fit,
    quiet_lightning,
)
from urpe.training.checkpoint import save_weights


def main(out: Path, devices: int, accumulate: int) -> None:
    quiet_lightning()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    config = TransformerConfig(
        vocab_size=6, max_len=8, num_layers=2, dim=16, num_heads=2, position="rpe", gate="toeplitz"
    )
    objective = TokenClassification(
        EncoderTokenClassifier(config, 7), 7, OptimConfig(lr=3e-3, warmup_steps=2, total_steps=12)
    )
    sample = functools.partial(get_task("etp"), length=8, vocab_size=6)
    held_out = TensorDataset(*sample(30, generator=torch.Generator().manual_seed(1)))
    data = StepDataModule(
        GeneratedStream(lambda b, g: sample(b, generator=g), 16, 0), held_out, eval_batch_size=8
    )
    train = TrainConfig(
        max_steps=12,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        accumulate_grad_batches=accumulate,
        checkpoint_every=0,
        seed=0,
        gradient_clip_val=1.0,
    )
    metrics = fit(objective, data, train, out / "run")
    rank = objective.trainer.global_rank
    save_weights(objective.model.state_dict(), out / f"rank{rank}.safetensors")
    (out / f"rank{rank}.metrics").write_text(repr(metrics))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
