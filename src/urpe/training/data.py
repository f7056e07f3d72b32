"""Training data as a function of (seed, step): exact resume and exact data parallelism.

The global batch of optimiser step t (`batch_size` examples, the paper's "sequences per
update") depends on (seed, t) alone. Each step's global batch is cut into
`world_size * accumulate_grad_batches` equal parts; micro-batch m of rank r gets part
`m * world_size + r`. Hence:

- a resumed run continues at exactly the data an uninterrupted run would see next (the data
  position is the step counter; nothing else needs saving);
- N processes with DDP see, between them, exactly the batch one process would, so they end
  with the same weights as a single-process run of the same global batch (up to float
  rounding: the gradient is the mean of the parts' means, the global mean for equal parts);
- gradient accumulation changes memory, not the optimisation.

Two streams implement `StepStream.batch(step, part, parts)`:
- `GeneratedStream(sample, batch_size, seed)`: draws the global batch from
  `sample(batch_size, generator)` with a generator seeded by (seed, step) (the synthetic tasks);
- `IndexedStream(size, batch_size, seed, collate)`: a dataset of `size` items, shuffled anew each
  epoch (permutation seeded by (seed, epoch)); step t takes items [t*B, (t+1)*B) of the
  concatenated epochs, and `collate(indices)` builds the part (graph and text datasets).

Held-out evaluation data is a fixed map-style dataset; rank r evaluates items r, r + W, ...,
so the accuracy covers every item exactly once (no sampler padding).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

Sampler = Callable[[int, torch.Generator], Any]

# Keeps the held-out set's generator apart from the training stream.
HELD_OUT_OFFSET = 1_000_003


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any tuple (seed, step, rank, ...), stable across processes and runs
    (unlike Python's `hash`)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def slice_batch(batch: Any, part: int, parts: int) -> Any:
    """Part `part` of `parts` equal slices along dim 0 of every tensor in `batch` (a tensor, or a
    tuple/list/dict of them)."""
    if isinstance(batch, Tensor):
        size = batch.shape[0]
        if size % parts:
            raise ValueError(f"a batch of {size} cannot be cut into {parts} equal parts")
        width = size // parts
        return batch[part * width : (part + 1) * width]
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(b, part, parts) for b in batch)
    if isinstance(batch, dict):
        return {k: slice_batch(v, part, parts) for k, v in batch.items()}
    raise TypeError(f"cannot slice a {type(batch).__name__}; return tensors from the sampler")


class StepStream(Protocol):
    """What a training stream provides: part `part` of `parts` of step `step`'s global batch."""

    batch_size: int

    def batch(self, step: int, part: int, parts: int) -> Any: ...


class GeneratedStream:
    """Global batch of step t = `sample(batch_size, Generator(seed=derive_seed(seed, t)))`."""

    def __init__(self, sample: Sampler, batch_size: int, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sample, self.batch_size, self.seed = sample, batch_size, seed
        self._cached: tuple[int, Any] | None = None

    def global_batch(self, step: int) -> Any:
        if self._cached is None or self._cached[0] != step:
            generator = torch.Generator().manual_seed(derive_seed("data", self.seed, step))
            self._cached = (step, self.sample(self.batch_size, generator))
        return self._cached[1]

    def batch(self, step: int, part: int, parts: int) -> Any:
        return slice_batch(self.global_batch(step), part, parts)


class IndexedStream:
    """Epoch-shuffled items of a dataset; `collate(indices: Tensor) -> batch` builds a part."""

    def __init__(self, size: int, batch_size: int, seed: int, collate: Callable[[Tensor], Any]):
        if size < 1 or batch_size < 1:
            raise ValueError(f"need size >= 1 and batch_size >= 1, got {size}, {batch_size}")
        self.size, self.batch_size, self.seed, self.collate = size, batch_size, seed, collate
        self._permutation: tuple[int, Tensor] | None = None

    def _epoch(self, epoch: int) -> Tensor:
        if self._permutation is None or self._permutation[0] != epoch:
            generator = torch.Generator().manual_seed(derive_seed("epoch", self.seed, epoch))
            self._permutation = (epoch, torch.randperm(self.size, generator=generator))
        return self._permutation[1]

    def indices(self, step: int) -> Tensor:
        """The global batch's item indices, (batch_size,)."""
        positions = torch.arange(step * self.batch_size, (step + 1) * self.batch_size)
        out = torch.empty(self.batch_size, dtype=torch.long)
        for epoch in positions.div(self.size, rounding_mode="floor").unique().tolist():
            chosen = positions.div(self.size, rounding_mode="floor") == epoch
            out[chosen] = self._epoch(epoch)[positions[chosen] % self.size]
        return out

    def batch(self, step: int, part: int, parts: int) -> Any:
        return self.collate(slice_batch(self.indices(step), part, parts))


class StepBatches(IterableDataset):
    """One rank's micro-batches from optimiser step `start` on (endless): for each step, its
    `accumulate` micro-batches, in order."""

    def __init__(
        self,
        stream: StepStream,
        start: int = 0,
        rank: int = 0,
        world_size: int = 1,
        accumulate: int = 1,
    ):
        super().__init__()
        if not 0 <= rank < world_size or accumulate < 1 or start < 0:
            raise ValueError(
                f"bad layout: rank {rank}, world {world_size}, accumulate "
                f"{accumulate}, start {start}"
            )
        parts = world_size * accumulate
        if stream.batch_size % parts:
            raise ValueError(
                f"the global batch of {stream.batch_size} cannot be split into {world_size} "
                f"devices x {accumulate} accumulated micro-batches"
            )
        self.stream, self.start, self.rank = stream, start, rank
        self.world_size, self.accumulate = world_size, accumulate

    def __iter__(self) -> Iterator[Any]:
        step = self.start
        parts = self.world_size * self.accumulate
        while True:
            for micro in range(self.accumulate):
                yield self.stream.batch(step, micro * self.world_size + self.rank, parts)
            step += 1


class StepDataModule(L.LightningDataModule):
    """Training: `StepBatches` from the trainer's current step (so resuming needs no data
    state). Validation: `held_out`, rank r taking items r, r + W, ...

    train: the stream; held_out: a map-style dataset (e.g. a `TensorDataset`);
    eval_batch_size: per device; collate: for the held-out items (None: default collation).
    """

    def __init__(
        self,
        train: StepStream,
        held_out: Dataset,
        eval_batch_size: int = 256,
        collate: Callable[[list], Any] | None = None,
    ):
        super().__init__()
        self.train, self.held_out = train, held_out
        self.eval_batch_size, self.collate = eval_batch_size, collate

    def _layout(self) -> tuple[int, int, int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 0, 1, 1
        rank, world = trainer.global_rank, trainer.world_size
        # processes that share rows (context parallelism) read the same data: the objective
        # says which (`CausalLM.data_parallel`)
        split = getattr(trainer.lightning_module, "data_parallel", None)
        if split is not None:
            rank, world = split(rank, world)
        return trainer.global_step, rank, world, trainer.accumulate_grad_batches

    def train_dataloader(self) -> DataLoader:
        start, rank, world, accumulate = self._layout()
        return DataLoader(StepBatches(self.train, start, rank, world, accumulate), batch_size=None)

    def val_dataloader(self) -> DataLoader:
        _, rank, world, _ = self._layout()
        indices: Sequence[int] = range(rank, len(self.held_out), world)  # type: ignore[arg-type]
        return DataLoader(
            Subset(self.held_out, indices),
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=self.collate,
        )
