"""Batches of a token stream for language modelling: contiguous segments (Transformer-XL) and
sliding windows.

A stream of N tokens gives N - 1 (input, target) pairs: target j is token j + 1, input j is token
j. Both iterators yield `Segment`s with `inputs` and `targets` of shape (B, L); a target equal to
`IGNORE_INDEX` (-100, `torch.nn.functional.cross_entropy`'s default) is not scored.

`ContiguousBatches` (Dai et al. 2019, Transformer-XL's ordered iterator): the pairs are cut into B
contiguous rows, row b holding pairs [b R, (b + 1) R), and each row into segments of L, so row b
of segment t + 1 continues exactly where row b of segment t stopped (the last target of one is the
first input of the next) and a model can carry row b's hidden states as memory. Training drops
the tail that does not fill a whole segment in every row; `cover_all=True` (evaluation) pads it
instead, so every pair is scored exactly once. Segment `position` p of an endless iteration is
segment p mod len of epoch p // len: `iterate(start=p)` resumes a run exactly at p.

`SlidingWindows` (evaluation at a chosen context length C, e.g. 1x-8x the training length):
windows of C inputs, each scoring only the targets that no earlier window scored, at most `stride`
new ones, so every scored target sees at least C - stride earlier tokens (the first window scores
all of its C targets, with whatever context they have). Every pair is scored exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass  # not frozen: Lightning's move_data_to_device rebuilds dataclasses field by field
class Segment:
    """One batch: `inputs` (B, L) and `targets` (B, L) int64 token ids.

    `targets[b, i]` is the token after `inputs[b, i]` in the stream, or `IGNORE_INDEX` where that
    position is padding or scored elsewhere. `offsets` (B,) is where `inputs[:, 0]` sits in the
    stream (input i of row b is stream token offsets[b] + i). `position` is the segment's index
    in its iteration. `reset_memory` is True where the rows do not continue the previous
    segment's rows (the first segment of an epoch, every sliding window), so a model must not
    attend to memory carried over from before.
    """

    inputs: Tensor
    targets: Tensor
    offsets: Tensor
    position: int
    reset_memory: bool

    @property
    def num_scored(self) -> int:
        """How many targets this segment scores."""
        return int((self.targets != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> Segment:
        """A copy with inputs and targets on `device` (offsets stay on the CPU)."""
        return replace(self, inputs=self.inputs.to(device), targets=self.targets.to(device))


def _check_stream(tokens: Tensor) -> Tensor:
    if not isinstance(tokens, Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise ValueError("tokens must be a 1-D integer tensor (the token stream)")
    if tokens.dtype == torch.bool or tokens.is_complex():
        raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
    if tokens.numel() < 2:
        raise ValueError(f"a stream needs at least 2 tokens (1 input, 1 target), got {len(tokens)}")
    return tokens


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _gather(tokens: Tensor, index: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Inputs tokens[index] and targets tokens[index + 1], padded (0 / IGNORE_INDEX) where not
    valid. index, valid: (B, L)."""
    index = torch.where(valid, index, torch.zeros_like(index))
    inputs = tokens[index].long().masked_fill(~valid, 0)
    targets = tokens[index + 1].long().masked_fill(~valid, IGNORE_INDEX)
    return inputs, targets


class ContiguousBatches:
    """Transformer-XL batching of a stream: segment t + 1's row b continues segment t's row b.

    Args:
        tokens: (N,) integer token stream.
        batch_size: B, the number of parallel rows (global, over all ranks).
        segment_length: L, the tokens per row per segment.
        cover_all: pad the last segment instead of dropping the remainder, so that every one of
            the N - 1 targets is scored exactly once (evaluation with memory).
        rank, world_size: this process takes rows [rank B / W, (rank + 1) B / W) of each segment
            (B must be divisible by W), so W ranks together see exactly the global batch.
    """

    def __init__(
        self,
        tokens: Tensor,
        batch_size: int,
        segment_length: int,
        *,
        cover_all: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.tokens = _check_stream(tokens)
        self.batch_size = _positive("batch_size", batch_size)
        self.segment_length = _positive("segment_length", segment_length)
        _positive("world_size", world_size)
        if batch_size % world_size:
            raise ValueError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
        self.cover_all = cover_all
        pairs = len(tokens) - 1
        if cover_all:
            self.row_length = -(-pairs // batch_size)  # ceil: the last rows may be padded
            self.num_segments = -(-self.row_length // segment_length)
        else:
            self.row_length = pairs // batch_size
            self.num_segments = self.row_length // segment_length
            if self.num_segments == 0:
                raise ValueError(
                    f"{len(tokens)} tokens do not fill one segment of {batch_size} rows x "
                    f"{segment_length} tokens; use a smaller batch or segment length"
                )
        self.pairs = pairs
        local = batch_size // world_size
        rows = torch.arange(rank * local, (rank + 1) * local)
        self._row_starts = rows * self.row_length  # (B_local,) stream offset of each row

    def __len__(self) -> int:
        """Segments per epoch."""
        return self.num_segments

    @property
    def tokens_per_epoch(self) -> int:
        """Targets scored per epoch over all ranks (all N - 1 with cover_all)."""
        if self.cover_all:
            return self.pairs
        return self.batch_size * self.num_segments * self.segment_length

    def __getitem__(self, position: int) -> Segment:
        """Segment `position` of an endless iteration (epoch position // len)."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise IndexError(f"position must be an integer >= 0, got {position!r}")
        index = position % self.num_segments
        columns = index * self.segment_length + torch.arange(self.segment_length)  # (L,)
        stream = self._row_starts[:, None] + columns[None, :]  # (B_local, L)
        valid = (columns[None, :] < self.row_length) & (stream < self.pairs)
        inputs, targets = _gather(self.tokens, stream, valid)
        return Segment(inputs, targets, stream[:, 0].clone(), position, reset_memory=index == 0)

    def __iter__(self) -> Iterator[Segment]:
        """One epoch."""
        return self.iterate(0, self.num_segments)

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator[Segment]:
        """Segments at positions start, start + 1, ... (endless unless `stop`, exclusive), across
        epochs; a run restarted with `iterate(start=p)` sees exactly the segments it would have
        seen from p on."""
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an integer >= 0, got {start!r}")
        position = start
        while stop is None or position < stop:
            yield self[position]
            position += 1


class SlidingWindows:
    """Evaluation windows of `context_length` inputs, scoring each target exactly once.

    Window 0 holds inputs [0, C) and scores all its targets; every later window ends `stride`
    pairs further on (the last one at the end of the stream), starts C before its end, and scores
    only the pairs past the previous window's end. With N - 1 <= C there is a single, shorter
    window. Windows are batched `batch_size` at a time (the last batch may have fewer rows).

    Args:
        tokens: (N,) integer token stream.
        context_length: C, inputs per window.
        stride: new targets per window (1 <= stride <= C); default C // 2, so every target
            after the first window sees at least C - C // 2 earlier tokens.
        batch_size: windows per batch.
    """

    def __init__(
        self,
        tokens: Tensor,
        context_length: int,
        stride: int | None = None,
        batch_size: int = 1,
    ):
        self.tokens = _check_stream(tokens)
        self.context_length = _positive("context_length", context_length)
        self.stride = max(1, context_length // 2) if stride is None else stride
        _positive("stride", self.stride)
        if self.stride > context_length:
            raise ValueError(f"stride {self.stride} exceeds context_length {context_length}")
        self.batch_size = _positive("batch_size", batch_size)
        self.pairs = pairs = len(tokens) - 1
        self.window_length = min(context_length, pairs)
        # Window w ends at min(C + w * stride, pairs).
        extra = max(0, pairs - context_length)
        self.num_windows = 1 + -(-extra // self.stride)

    def _window(self, windows: Tensor) -> tuple[Tensor, Tensor]:
        """Window indices (W,) -> (start of inputs, first scored column), each (W,)."""
        ends = torch.clamp(self.context_length + windows * self.stride, max=self.pairs)
        previous = torch.clamp(self.context_length + (windows - 1) * self.stride, max=self.pairs)
        starts = ends - self.window_length
        first_scored = torch.where(windows == 0, torch.zeros_like(ends), previous - starts)
        return starts, first_scored

    def __len__(self) -> int:
        return -(-self.num_windows // self.batch_size)

    def __getitem__(self, batch: int) -> Segment:
        if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < len(self):
            raise IndexError(f"batch index must lie in [0, {len(self)}), got {batch!r}")
        windows = torch.arange(
            batch * self.batch_size, min((batch + 1) * self.batch_size, self.num_windows)
        )
        starts, first_scored = self._window(windows)
        columns = torch.arange(self.window_length)  # (C,)
        stream = starts[:, None] + columns[None, :]  # (W, C)
        inputs, targets = _gather(self.tokens, stream, torch.ones_like(stream, dtype=torch.bool))
        targets = targets.masked_fill(columns[None, :] < first_scored[:, None], IGNORE_INDEX)
        return Segment(inputs, targets, starts, batch, reset_memory=True)

    def __iter__(self) -> Iterator[Segment]:
        for batch in range(len(self)):
            yield self[batch]
