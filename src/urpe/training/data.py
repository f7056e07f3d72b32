"""Batches generated on the fly, for Lightning.

A sampler is any `sample(batch_size, generator) -> (inputs, targets)`; the synthetic tasks of
`urpe.tasks` fit after binding length and vocabulary. Training draws an endless stream seeded by
(seed, rank, worker), so every process sees different data and a run is reproducible. Evaluation
uses a fixed held-out set drawn from a separate seed, map-style so Lightning shards it across
devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

Sampler = Callable[[int, torch.Generator], tuple[Tensor, Tensor]]

# Keeps the held-out stream apart from any training stream (seed, rank, worker) of a sane size.
HELD_OUT_OFFSET = 1_000_003


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class GeneratedBatches(IterableDataset):
    """An endless (or `num_batches`-long) stream of whole batches from `sample`."""

    def __init__(self, sample: Sampler, batch_size: int, seed: int, num_batches: int | None = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sample, self.batch_size, self.seed, self.num_batches = (
            sample, batch_size, seed, num_batches,
        )  # fmt: skip

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        worker = get_worker_info()
        workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        stream = (_rank() * workers + worker_id) * 7919
        generator = torch.Generator().manual_seed(self.seed * 1_000_000 + stream)
        count = 0
        while self.num_batches is None or count < self.num_batches:
            yield self.sample(self.batch_size, generator)
            count += 1


class GeneratedDataModule(L.LightningDataModule):
    """Training: an endless seeded stream. Validation: `eval_batches` fixed held-out batches."""

    def __init__(
        self,
        sample: Sampler,
        batch_size: int,
        seed: int = 0,
        eval_batches: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ):
        super().__init__()
        self.sample, self.batch_size, self.seed = sample, batch_size, seed
        self.eval_batches = eval_batches
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self._held_out: TensorDataset | None = None

    def held_out(self) -> TensorDataset:
        if self._held_out is None:
            generator = torch.Generator().manual_seed(self.seed + HELD_OUT_OFFSET)
            inputs, targets = self.sample(self.eval_batches * self.eval_batch_size, generator)
            self._held_out = TensorDataset(inputs, targets)
        return self._held_out

    def train_dataloader(self) -> DataLoader:
        stream = GeneratedBatches(self.sample, self.batch_size, self.seed)
        return DataLoader(stream, batch_size=None, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.held_out(), batch_size=self.eval_batch_size, shuffle=False)
