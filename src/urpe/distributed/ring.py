"""Passing tensors around a ring of processes, overlapped with the computation in between.

    transfer = ring.pass_on([k, v])    # starts sending to the next rank, receiving from the one
    ...compute on k, v...              # before it (torch.distributed point-to-point, async)
    k, v = transfer.wait()             # the previous rank's k, v

Built on `torch.distributed.batch_isend_irecv` (gloo on CPUs, NCCL on GPUs). Each stream of
transfers (keys forward, their gradients backward) gets its own tags, so two transfers in flight
between the same ranks never take each other's messages (gloo matches by tag; NCCL in order).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

TAGS_PER_STREAM = 64  # tensors one transfer may carry


class Transfer:
    """A transfer in flight: `wait()` returns the received tensors."""

    def __init__(self, requests: list, received: list[Tensor]) -> None:
        self._requests, self._received = requests, received

    def wait(self) -> list[Tensor]:
        for request in self._requests:
            request.wait()
        return self._received


class Ring:
    """Rank r of a group sends to r + 1 and receives from r - 1 (mod the group's size)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group or dist.group.WORLD, (rank + 1) % size)
        self.previous = dist.get_global_rank(group or dist.group.WORLD, (rank - 1) % size)

    def pass_on(self, tensors: list[Tensor], stream: int = 0) -> Transfer:
        """Send `tensors` to the next rank, receive tensors of the same shapes from the previous
        one; `stream` keeps concurrent transfers apart (module docstring)."""
        if self.size == 1:
            return Transfer([], list(tensors))
        if len(tensors) > TAGS_PER_STREAM:
            raise ValueError(f"a transfer carries at most {TAGS_PER_STREAM} tensors")
        sent = [t.contiguous() for t in tensors]
        received = [t.new_empty(t.shape) for t in sent]
        base = stream * TAGS_PER_STREAM
        ops = [
            dist.P2POp(dist.isend, t, self.next, self.group, base + n) for n, t in enumerate(sent)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.previous, self.group, base + n)
            for n, t in enumerate(received)
        ]
        # (the sent tensors stay referenced by the requests' owner until wait())
        return Transfer([*dist.batch_isend_irecv(ops), _Keep(sent)], received)


class _Keep:
    """Holds the sent tensors alive until the transfer is waited for."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors

    def wait(self) -> None:
        self.tensors = []
