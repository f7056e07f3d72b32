"""Which positions of a sequence each process holds, and moving a tensor to and from that split.

A sequence of L positions is cut into equal chunks. With N processes:

- "contiguous": N chunks; rank r holds chunk r, positions [r L/N, (r+1) L/N).
- "zigzag": 2N chunks of L/(2N); rank r holds chunks r and 2N-1-r, side by side. Under causal
  masking a query sees the keys before it, so the contiguous split leaves the first rank almost
  idle and the last one doing most of the work; zigzag gives every rank one early and one late
  chunk, the same work each.

A rank's shard is its chunks concatenated, in that order (L/N positions). `shard` cuts a global
tensor into this rank's shard, `unshard` gathers the shards of every rank back into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """One chunk a rank holds: positions [start, start + length) of the sequence, rows [local,
    local + length) of the rank's shard."""

    start: int
    local: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.local, self.local + self.length)


@dataclass(frozen=True)
class ShardLayout:
    """The split of one sequence across `size` processes (module docstring)."""

    name: str
    size: int

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.name!r}")
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"a context-parallel group has at least 1 process, got {self.size}")

    @property
    def chunks(self) -> int:
        """How many equal chunks the sequence is cut into."""
        return self.size if self.name == "contiguous" else 2 * self.size

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks rank holds, in its shard's order."""
        if self.name == "contiguous":
            return (rank,)
        return (rank, 2 * self.size - 1 - rank)

    def segments(self, rank: int, shard_length: int) -> tuple[Segment, ...]:
        """The chunks of rank's shard of `shard_length` positions (`check_shard` first)."""
        chunks = self.chunks_of(rank)
        per = shard_length // len(chunks)
        return tuple(Segment(c * per, n * per, per) for n, c in enumerate(chunks))

    def positions(self, rank: int, shard_length: int, device=None) -> Tensor:
        """(L/N,) int64: the global position of each row of rank's shard."""
        parts = [
            torch.arange(s.start, s.start + s.length, device=device)
            for s in self.segments(rank, shard_length)
        ]
        return torch.cat(parts)

    def check_length(self, length: int) -> None:
        """ValueError unless a global length splits into this layout's equal chunks."""
        if length % self.chunks:
            raise ValueError(
                f"a sequence of {length} positions does not split into the {self.chunks} equal "
                f"chunks of layout {self.name!r} over {self.size} processes: pad it to a "
                f"multiple of {self.chunks} (and mask the padding with key_padding_mask)"
            )

    def check_shard(self, shard_length: int) -> None:
        """ValueError unless a shard of this length holds whole chunks."""
        if shard_length < 1:
            raise ValueError("every process of a context-parallel group needs at least 1 position")
        parts = len(self.chunks_of(0))
        if shard_length % parts:
            raise ValueError(
                f"layout {self.name!r} holds {parts} chunks per process, so a shard's length "
                f"must be a multiple of {parts}, got {shard_length}: pad the sequence to a "
                f"multiple of {self.chunks}"
            )


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in `group` (None: the default group) and the group's size."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context parallelism runs on torch.distributed: call "
            "torch.distributed.init_process_group first (gloo on CPUs, nccl on GPUs), or "
            "start the processes with torchrun"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def shard(
    x: Tensor, *, layout: str = "zigzag", group: dist.ProcessGroup | None = None, dim: int = -2
) -> Tensor:
    """This rank's shard of a global tensor: its chunks of dim `dim` (the sequence), side by side.

    x (..., L, ...) -> (..., L/N, ...). L must split into the layout's chunks (N or 2N).
    """
    rank, size = group_rank_and_size(group)
    split = ShardLayout(layout, size)
    length = x.shape[dim]
    split.check_length(length)
    per = length // split.chunks
    return torch.cat([x.narrow(dim, c * per, per) for c in split.chunks_of(rank)], dim)


def unshard(
    x: Tensor, *, layout: str = "zigzag", group: dist.ProcessGroup | None = None, dim: int = -2
) -> Tensor:
    """The global tensor from every rank's shard (a collective: every rank calls it, each with a
    shard of the same shape). x (..., L/N, ...) -> (..., L, ...). Not differentiable."""
    rank, size = group_rank_and_size(group)
    split = ShardLayout(layout, size)
    split.check_shard(x.shape[dim])
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x.contiguous(), group=group)
    chunks: dict[int, Tensor] = {}
    for owner, part in enumerate(shards):
        for segment in split.segments(owner, x.shape[dim]):
            chunks[segment.start] = part.narrow(dim, segment.local, segment.length)
    return torch.cat([chunks[start] for start in sorted(chunks)], dim)
