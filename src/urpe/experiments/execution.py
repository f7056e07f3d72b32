"""How one run executes: `Execution` (devices, jobs, threads: never part of a run's identity),
the `RunContext` that `run_one` receives, and `execute_run`, which trains one run and books its
record or its failure. Shared by the sequential sweep (`runner.py`) and the workers
(`workers.py`)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import remove_stale_temporaries
from .records import RecordStore, RunResult, RunSpec

if TYPE_CHECKING:
    from ..training.trainer import TrainConfig


def world_size_from_environment() -> int:
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 1


def global_rank() -> int:
    """This process's rank in a distributed launch (0 when not distributed)."""
    try:
        from lightning.pytorch.utilities import rank_zero_only

        rank = getattr(rank_zero_only, "rank", None)
        if rank is not None:
            return int(rank)
    except ImportError:
        pass
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 0


@dataclass
class Execution:
    """How runs execute; none of it is part of a run's identity."""

    jobs: int = 1
    threads: int = 1
    accelerator: str = "cpu"
    devices: int | str | list[int] = 1
    num_nodes: int = 1
    strategy: str = "auto"
    accumulate_grad_batches: int = 1
    context_parallel: int = 1  # processes per sequence (`urpe.distributed`), of the devices
    checkpoint_every: int | None = None
    progress: bool = True
    gpus: list[int] = field(default_factory=list)  # one worker per id when jobs > 1

    @property
    def distributed(self) -> bool:
        """Several processes per run (every one runs the whole sweep)."""
        return (
            world_size_from_environment() > 1
            or self.num_nodes > 1
            or (isinstance(self.devices, int) and self.devices > 1)
            or isinstance(self.devices, list)
            and len(self.devices) > 1
        )

    def train_config(self, **run: Any) -> TrainConfig:
        """One run's `urpe.training.TrainConfig`: `run` holds its own settings (max_steps,
        precision, seed, val_every, ...: what its config decides), this execution the devices,
        strategy, accumulation and checkpoint schedule (which change no result)."""
        from ..training.trainer import TrainConfig

        return TrainConfig(
            checkpoint_every=self.checkpoint_every,
            accelerator=self.accelerator,
            devices=self.devices,
            num_nodes=self.num_nodes,
            strategy=self.strategy,
            accumulate_grad_batches=self.accumulate_grad_batches,
            **run,
        )

    def record(self) -> dict:
        """What the record keeps of it (beside the torch version and thread count it ran with)."""
        import torch

        return {
            **{k: v for k, v in asdict(self).items() if k not in ("progress", "gpus")},
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }


@dataclass
class RunContext:
    """What `run_one` gets besides its config."""

    run_dir: Path
    execution: Execution
    resume: bool
    on_step: Callable[[int], None]
    warn: Callable[[str], None]

    def start(self, seed: int) -> None:
        """Quiet Lightning's banners and seed every generator from the run's seed: the first
        thing `run_one` does, before it builds its model."""
        import lightning as L

        from ..training import quiet_lightning

        quiet_lightning()
        L.seed_everything(seed, verbose=False)

    def fit(self, objective: Any, data: Any, **run: Any) -> dict[str, float]:
        """`urpe.training.fit` for this run: in its folder, continued from its newest checkpoint
        under --resume (a damaged one is named and the run starts again), progress reported to
        the sweep; `run` as in `Execution.train_config`. Returns the final held-out metrics."""
        from ..training import fit

        return fit(
            objective,
            data,
            self.execution.train_config(**run),
            self.run_dir,
            resume=self.resume,
            on_step=self.on_step,
            on_resume_error=lambda error: self.warn(f"{error}; starting the run again"),
        )


@dataclass
class SweepOutcome:
    records: list[dict]  # this sweep's records, finished now or skipped under resume
    trained: int = 0
    skipped: int = 0
    failed: list[tuple[RunSpec, str]] = field(default_factory=list)


RunOne = Callable[[dict, RunContext], RunResult]


def execute_run(
    run_one: RunOne, spec: RunSpec, store: RecordStore, context: RunContext
) -> dict | None:
    """Train one run in `context.run_dir` (the store's folder of the run, cleared first unless
    resuming) and write its record (global rank 0 only); return the record (or None)."""
    run_dir = context.run_dir
    if not context.resume and run_dir.exists() and global_rank() == 0:
        shutil.rmtree(run_dir)  # a fresh start: no stale checkpoint to continue from
    remove_stale_temporaries(run_dir / "checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = run_one(spec.config, context)
    if global_rank() != 0:
        return None
    return store.write(spec, result, context.execution.record(), time.perf_counter() - start)


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def record_failure(store, spec, error, trace, progress, index, outcome) -> None:
    """A failed run: its traceback in `runs/<id>/error.txt`, one line on the progress bar."""
    message = error if isinstance(error, str) else one_line(error)
    log = store.run_dir(spec) / "error.txt"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(trace)
    except OSError:
        pass
    outcome.failed.append((spec, message))
    progress.finish(index, f"{spec.name}: FAILED: {message} (details: {log})")
