"""Context parallelism: URPE attention over sequences split across processes.

    q, k, v = (urpe.distributed.shard(x, layout="zigzag") for x in (q, k, v))
    out = urpe.distributed.context_parallel_attention(q, k, v, bias=Toeplitz(table),
                                                      gate=Toeplitz(gate_table), is_causal=True)

Where one sequence's activations outgrow one device, each of N processes holds L/N of its
positions (`layout`: "contiguous" or "zigzag") and the keys go around a ring
(`attention`): memory per rank O(L/N), the communication overlapped with the tile loops. It
runs on torch.distributed (gloo on CPUs, NCCL on GPUs), with relative position terms (Toeplitz
tables over global offsets, FoX's decay over global cumulative sums), URPE's gate, documents,
padding, grouped queries, every normalisation and seeded dropout, and equals one process.

Gradients: q, k, v and log_forget get this rank's shard of the one-process gradient; a table
(bias or gate) gets this rank's part, and the sum over the group is the one-process gradient.
In training every parameter's gradient is such a part (the other ranks' queries reach this
rank's keys through the ring), so the usual data-parallel reduction over the context-parallel
ranks (DDP or FSDP over the flattened dp x cp mesh: a mean over ranks whose losses are each
rank's mean over its tokens) gives exactly the one-process gradient of the mean loss. See the
guide, docs/guides/context-parallel.md.
"""

from .attention import context_parallel_attention
from .group import ContextParallel, ContextParallelMesh, context_parallel_mesh
from .layout import LAYOUTS, Segment, ShardLayout, shard, unshard

__all__ = [
    "LAYOUTS",
    "ContextParallel",
    "ContextParallelMesh",
    "Segment",
    "ShardLayout",
    "context_parallel_attention",
    "context_parallel_mesh",
    "shard",
    "unshard",
]
