"""`fit`: one training run on Lightning, step-based, checkpointed, resumable, scalable.

    metrics = fit(objective, data, TrainConfig(max_steps=800, checkpoint_every=200), run_dir)

- The Trainer counts optimiser updates (`max_steps`); validation every `val_every` updates.
- Checkpoints go to `run_dir/checkpoints/step-NNNNNNNN/` every `checkpoint_every` updates and at
  the end (see `checkpoint.py` for the format). `fit` resumes from the newest one, if any: the
  weights, optimiser, scheduler, loop counters and RNG states come back, and the data continues
  at the step counter (`data.py`), so a run killed at any instant ends with the same weights as
  one never interrupted (CPU; GPUs with deterministic kernels).
- Randomness inside a training step (dropout) is reseeded from (seed, step, micro-batch, rank)
  before every micro-batch, so it too is a function of the position, not of the history.
- accelerator / devices / num_nodes / strategy / precision / accumulate_grad_batches go to
  `lightning.Trainer`. Under `torchrun` or SLURM, Lightning reads the process layout from the
  environment; "fsdp" uses a full (gathered) state dict so checkpoints keep this format.
- Gradient clipping is Lightning's (`gradient_clip_val`, by norm).
- Logs: `run_dir/logs/metrics.csv` (and TensorBoard events when `tensorboard`).
"""

from __future__ import annotations

import csv
import logging
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies import FSDPStrategy

from .checkpoint import (
    STATE,
    CheckpointError,
    capture_rng_states,
    latest_checkpoint,
    read_checkpoint,
    restore_rng_states,
    step_directory,
    write_checkpoint,
)
from .data import derive_seed
from .precision import PRECISIONS, STRATEGIES, normalize_precision  # noqa: F401 (re-exported)


@dataclass
class TrainConfig:
    """max_steps: optimiser updates. val_every: updates between validations (None: only at the
    end). checkpoint_every: updates between checkpoints (None: only at the end; 0: never).
    accelerator/devices/num_nodes/strategy/precision/accumulate_grad_batches: Lightning's, so the
    same run scales from a laptop CPU to many GPUs on many nodes. extra: any other Trainer
    keyword."""

    max_steps: int = 1000
    val_every: int | None = None
    checkpoint_every: int | None = None
    log_every: int = 25
    accelerator: str = "auto"
    devices: int | str | list[int] = "auto"
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    seed: int = 0
    deterministic: bool | str = True
    tensorboard: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class SafeCheckpointIO(CheckpointIO):
    """Lightning's checkpoint IO in urpe's format. Lightning is handed the path
    `<checkpoint directory>/training_state.pt`; the directory holds the three files."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        write_checkpoint(checkpoint, Path(path).parent)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        return read_checkpoint(Path(path).parent)

    def remove_checkpoint(self, path) -> None:
        import shutil

        shutil.rmtree(Path(path).parent, ignore_errors=True)


class SafeFSDPStrategy(FSDPStrategy):
    """FSDP with full (rank-0 gathered) checkpoints read through `SafeCheckpointIO` too.

    Lightning's FSDP loader reads full checkpoints with its own lazy pickle loader rather than
    the CheckpointIO; this routes that one call to ours."""

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        from lightning.pytorch.strategies import fsdp as module

        original = module._lazy_load
        module._lazy_load = lambda path, *args, **kwargs: read_checkpoint(Path(path).parent)
        try:
            return super().load_checkpoint(checkpoint_path, weights_only)
        finally:
            module._lazy_load = original


class StepCheckpoint(Callback):
    """Save every `every` optimiser updates and at the end of training; carries the RNG states
    in the checkpoint (restored when training resumes).

    At an update followed by a validation (every `val_every`, and the last) the checkpoint is
    written after that validation, so it holds the validation's point of the learning curve: a
    run resumed from it does not validate that step again, and would otherwise lose the point.
    """

    def __init__(self, directory: str | Path, every: int | None, val_every: int | None = None):
        self.directory, self.every, self.val_every = Path(directory), every, val_every
        self._last: int | None = None
        self._rng: dict[str, Any] | None = None
        self._after_validation = False

    def _save(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        if step == self._last or step == 0:
            return
        self._last = step
        for logger in trainer.loggers:  # the logged curve up to this checkpoint is on disk
            logger.save()
        trainer.save_checkpoint(step_directory(self.directory, step) / STATE)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every and step % self.every == 0 and step != self._last:
            if step % (self.val_every or trainer.max_steps) == 0 or step == trainer.max_steps:
                self._after_validation = True  # see the class docstring
            else:
                self._save(trainer)

    def on_validation_end(self, trainer, module) -> None:
        if self._after_validation and not trainer.sanity_checking and trainer.state.fn == "fit":
            self._after_validation = False
            self._save(trainer)

    def on_train_end(self, trainer, module) -> None:
        if self.every != 0:
            self._save(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": capture_rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rng = state_dict.get("rng")

    def on_train_start(self, trainer, module) -> None:
        self._last = trainer.global_step
        if self._rng is not None:
            restore_rng_states(self._rng)
            self._rng = None


class StepSeed(Callback):
    """Reseed torch before every micro-batch from (seed, step, micro-batch, rank)."""

    def __init__(self, seed: int):
        self.seed = seed

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        micro = batch_idx % trainer.accumulate_grad_batches
        torch.manual_seed(
            derive_seed("step", self.seed, trainer.global_step, micro, trainer.global_rank)
        )


class StepReporter(Callback):
    """Calls `report(step)` after every optimiser update on rank 0 (for progress bars)."""

    def __init__(self, report: Callable[[int], None]):
        self.report = report
        self._last = -1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero and trainer.global_step != self._last:
            self._last = trainer.global_step
            self.report(trainer.global_step)


class _InterruptWatch(Callback):
    """Lightning turns Ctrl-C into `sys.exit(1)`; remember it so `fit` can re-raise it."""

    interrupted = False

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):
            self.interrupted = True


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv when it starts; a resumed run keeps
    the rows written before its interruption and appends to them."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = sorted(next(csv.reader(handle), []))


class ResumedCSVLogger(CSVLogger):
    """`CSVLogger` for a run resumed from a checkpoint: appends to its metrics.csv."""

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


def quiet_lightning() -> None:
    """Silence Lightning's start-up banners and advice that does not apply to these runs."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for pattern in (
        ".*does not have many workers.*",
        ".*GPU available but not used.*",
        ".*torch.use_deterministic_algorithms.*",
        ".*LeafSpec.*",
        ".*isinstance.*treespec.*",
        ".*Experiment logs directory.*exists and is not empty.*",
        ".*The number of training batches.*",
        ".*that ended before the epoch ended.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def _strategy(config: TrainConfig, io: SafeCheckpointIO) -> Any:
    if config.strategy == "fsdp":
        from ..nn.layer import TransformerLayer

        # Wrap each Transformer layer: shards parameters layer by layer (large models).
        return SafeFSDPStrategy(
            state_dict_type="full", auto_wrap_policy={TransformerLayer}, checkpoint_io=io
        )
    return config.strategy


def build_trainer(
    config: TrainConfig,
    run_dir: str | Path,
    callbacks: list[Callback] | None = None,
    resumed: bool = False,
) -> L.Trainer:
    """A step-based Trainer writing logs and checkpoints under `run_dir` (`resumed`: append to
    the logs of the interrupted run instead of starting them over)."""
    run_dir = Path(run_dir)
    csv_logger = ResumedCSVLogger if resumed else CSVLogger
    loggers: list[Any] = [csv_logger(run_dir, name="logs", version="")]
    if config.tensorboard:
        loggers.append(TensorBoardLogger(run_dir, name="logs", version="", default_hp_metric=False))
    io = SafeCheckpointIO()
    callbacks = [
        StepSeed(config.seed),
        StepCheckpoint(run_dir / "checkpoints", config.checkpoint_every, config.val_every),
        *(callbacks or []),
    ]
    strategy = _strategy(config, io)
    accumulate = config.accumulate_grad_batches
    kwargs: dict[str, Any] = dict(
        max_steps=config.max_steps,
        accelerator=config.accelerator,
        devices=config.devices,
        num_nodes=config.num_nodes,
        strategy=strategy,
        precision=normalize_precision(config.precision),
        accumulate_grad_batches=accumulate,
        gradient_clip_val=config.gradient_clip_val,
        gradient_clip_algorithm="norm",
        deterministic=config.deterministic,
        logger=loggers,
        callbacks=callbacks,
        log_every_n_steps=config.log_every,
        # An endless training stream has no epochs: validate every `val_every` updates
        # (Lightning counts micro-batches here).
        val_check_interval=(config.val_every or config.max_steps) * accumulate,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        # The data module shards the held-out set itself (no padded DistributedSampler).
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=str(run_dir),
    )
    if not isinstance(strategy, str):
        kwargs["plugins"] = None
    else:
        kwargs["plugins"] = [io]
    kwargs.update(config.extra)
    return L.Trainer(**kwargs)


def fit(
    objective: L.LightningModule,
    data: L.LightningDataModule,
    config: TrainConfig,
    run_dir: str | Path,
    resume: bool = True,
    on_step: Callable[[int], None] | None = None,
    on_resume_error: Callable[[CheckpointError], None] | None = None,
) -> dict[str, float]:
    """Train `objective` on `data`; return the final held-out metrics ({"val/acc": ...}).

    resume: continue from the newest checkpoint under `run_dir/checkpoints` (if any). A
    checkpoint that cannot be loaded safely is reported to `on_resume_error` (default: raise)
    and training starts from step 0. KeyboardInterrupt propagates (the checkpoints stay).
    """
    run_dir = Path(run_dir)
    checkpoint = latest_checkpoint(run_dir / "checkpoints") if resume else None
    if checkpoint is not None:
        try:
            read_checkpoint(checkpoint)  # fail here, with its path, not inside Lightning
        except CheckpointError as error:
            if on_resume_error is None:
                raise
            on_resume_error(error)
            checkpoint = None
    watch = _InterruptWatch()
    callbacks: list[Callback] = [watch]
    if on_step is not None:
        callbacks.append(StepReporter(on_step))
    trainer = build_trainer(config, run_dir, callbacks, resumed=checkpoint is not None)
    try:
        ckpt_path = None if checkpoint is None else str(checkpoint / STATE)
        trainer.fit(objective, datamodule=data, ckpt_path=ckpt_path)
        # A fresh evaluation of the final weights on the held-out set (never trained on).
        metrics = trainer.validate(objective, datamodule=data, verbose=False)[0]
    except SystemExit:
        if watch.interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt from None
        raise
    return {name: float(value) for name, value in metrics.items()}
