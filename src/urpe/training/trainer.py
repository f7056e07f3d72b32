"""A Lightning `Trainer` set up the way urpe's experiments want it: step-based, seeded,
deterministic, logging CSV and TensorBoard under one directory, devices passed through."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tqdm.auto import tqdm


@dataclass
class TrainConfig:
    """max_steps: optimizer updates. val_every: steps between validations (None: only at the
    end). accelerator/devices/strategy/precision/num_nodes go to `lightning.Trainer` unchanged, so
    the same run scales from a laptop CPU to many GPUs. extra: any other Trainer keyword."""

    max_steps: int = 1000
    val_every: int | None = None
    log_every: int = 25
    accelerator: str = "auto"
    devices: int | str | list[int] = "auto"
    strategy: str = "auto"
    precision: str | int | None = None
    num_nodes: int = 1
    deterministic: bool | str = True
    tensorboard: bool = True
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


class StepProgressBar(Callback):
    """One tqdm bar per run: step / max_steps with the current loss and accuracy.

    Lightning's own bar counts batches per epoch, which an endless stream does not have.
    """

    def __init__(self, description: str = "", position: int = 1, leave: bool = False):
        self.description, self.position, self.leave = description, position, leave
        self.bar: tqdm | None = None

    def on_train_start(self, trainer, module) -> None:
        if trainer.is_global_zero:
            self.bar = tqdm(
                total=trainer.max_steps, desc=self.description, position=self.position,
                leave=self.leave, dynamic_ncols=True, unit="step",
            )  # fmt: skip

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.bar is None:
            return
        self.bar.update(trainer.global_step - self.bar.n)
        metrics = trainer.progress_bar_metrics
        shown = {
            name.split("/")[-1] if name.startswith("train/") else name.replace("/", "_"): v
            for name, v in metrics.items()
            if name in ("train/loss", "train/acc", "val/acc")
        }
        self.bar.set_postfix({k: f"{float(v):.3f}" for k, v in shown.items()}, refresh=False)

    def on_train_end(self, trainer, module) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def quiet_lightning() -> None:
    """Silence Lightning's start-up banners and the CPU/worker advice irrelevant here."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for pattern in (
        ".*does not have many workers.*",
        ".*GPU available but not used.*",
        ".*torch.use_deterministic_algorithms.*",
        ".*LeafSpec.*",
        ".*isinstance.*treespec.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def build_trainer(
    config: TrainConfig,
    out_dir: str | Path,
    name: str = "run",
    callbacks: list[Callback] | None = None,
    progress_description: str = "",
) -> L.Trainer:
    """A step-based Trainer logging to `out_dir/<name>/` (metrics.csv, TensorBoard events)."""
    out_dir = Path(out_dir)
    loggers = [CSVLogger(out_dir, name=name, version="")]
    if config.tensorboard:
        loggers.append(TensorBoardLogger(out_dir, name=name, version="", default_hp_metric=False))
    callbacks = list(callbacks or [])
    if config.progress:
        callbacks.append(StepProgressBar(progress_description))
    kwargs: dict[str, Any] = dict(
        max_steps=config.max_steps,
        accelerator=config.accelerator,
        devices=config.devices,
        strategy=config.strategy,
        num_nodes=config.num_nodes,
        deterministic=config.deterministic,
        logger=loggers,
        callbacks=callbacks,
        log_every_n_steps=config.log_every,
        # An endless training stream has no epochs: validate every `val_every` steps instead.
        val_check_interval=config.val_every or config.max_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=str(out_dir),
    )
    if config.precision is not None:
        kwargs["precision"] = config.precision
    kwargs.update(config.extra)
    return L.Trainer(**kwargs)
