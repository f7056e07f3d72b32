"""A context-parallel group as models take it: who shares each sequence, and how it is split.

    cp = ContextParallel(group, layout="zigzag")       # or context_parallel_mesh(2).cp
    logits = model(cp.shard(tokens, dim=-1), context_parallel=cp)   # this rank's (B, L/N, V)

Calling a `ContextParallel` is calling `urpe.attention` (same arguments) on the whole
sequence: the model's layers receive it as their attention function (`AttentionContext.calls`).
With data parallelism beside it, `context_parallel_mesh` lays the processes out as a 2-D
`DeviceMesh` (dp x cp): ranks r and r' share sequences when r // cp == r' // cp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from ..kernels.spec import Arguments
from .attention import context_parallel_attention
from .kernels import CHUNK_BACKENDS
from .layout import ShardLayout, group_rank_and_size, shard, unshard


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """The processes of `group` (None: the default group) share each sequence, split by
    `layout`; `backend` is the kernel of the chunks ("auto", "cpp", "blockwise"), which replaces
    a layer's own backend choice."""

    group: dist.ProcessGroup | None = None
    layout: str = "zigzag"
    backend: str = "auto"

    def __post_init__(self) -> None:
        ShardLayout(self.layout, 1)  # the name, checked
        if self.backend not in CHUNK_BACKENDS:
            raise ValueError(f"backend must be one of {CHUNK_BACKENDS}, got {self.backend!r}")

    @property
    def rank(self) -> int:
        return group_rank_and_size(self.group)[0]

    @property
    def size(self) -> int:
        return group_rank_and_size(self.group)[1]

    def shard(self, x: Tensor, dim: int = -1) -> Tensor:
        """This rank's shard of a global tensor along `dim` (default: tokens (B, L))."""
        return shard(x, layout=self.layout, group=self.group, dim=dim)

    def unshard(self, x: Tensor, dim: int = -1) -> Tensor:
        """The global tensor from every rank's shard (a collective)."""
        return unshard(x, layout=self.layout, group=self.group, dim=dim)

    def positions(self, shard_length: int, device=None) -> Tensor:
        """(L/N,) int64: the global positions of this rank's rows."""
        rank, size = group_rank_and_size(self.group)
        split = ShardLayout(self.layout, size)
        split.check_shard(shard_length)
        return split.positions(rank, shard_length, device)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        """`urpe.attention(q, k, v, *args, **kwargs)` over the whole sequence, on shards."""
        given = Arguments.of((q, k, v, *args), kwargs)._asdict()
        for name in ("q", "k", "v", "backend"):
            given.pop(name)
        return context_parallel_attention(
            q, k, v, group=self.group, layout=self.layout, backend=self.backend, **given
        )


@dataclass(frozen=True)
class ContextParallelMesh:
    """The (dp, cp) mesh of `context_parallel_mesh`: `cp` this process's context-parallel group,
    `mesh` the DeviceMesh (its "dp" dim for data parallelism, FSDP2 on the flattened one)."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    cp: ContextParallel

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.size(0)


def context_parallel_mesh(
    size: int, *, layout: str = "zigzag", backend: str = "auto", device_type: str = "cpu"
) -> ContextParallelMesh:
    """Lay the default group's processes out as a (dp, cp) DeviceMesh with `size` processes
    per sequence, and return it with this process's `ContextParallel`. A collective."""
    from torch.distributed.device_mesh import init_device_mesh

    world = group_rank_and_size(None)[1]
    if size < 1 or world % size:
        raise ValueError(
            f"a context-parallel size of {size} does not divide the {world} processes: start "
            "a multiple of it (--context-parallel N runs N per sequence)"
        )
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "cp"))
    return ContextParallelMesh(mesh, ContextParallel(mesh.get_group("cp"), layout, backend))
