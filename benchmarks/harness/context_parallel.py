"""Context parallelism on CPU processes (issue 40): memory per rank and step time of one
training step of a causal Transformer whose sequence is split across N gloo processes
(`urpe.distributed`), against the same model on one process.

Each N runs in N freshly spawned processes (N = 1: one process, the model without a group),
each on `threads` threads, and measures on its first step at the full length (after one on 16
tokens per rank, which loads the libraries and kernels), before anything else has grown the
process:

- saved_mib: the activations autograd keeps for backward, distinct storages of the tensors
  `saved_tensors_hooks` sees, parameters excluded. What a Function keeps as a plain attribute
  (the ring's cumulative decay and its O(L/N) key-side numbers) is not seen; it is a number or
  two per position, small beside the (L/N, E) activations.
- rss_rise_mib: how far the step raised the process's peak resident memory (`ru_maxrss`), so
  transient buffers (the keys in flight, the kernels' tiles) and the allocator's behaviour
  count too; an upper view, noisier than saved_mib.

Then step_ms: the median of `repeats` further steps, every rank starting each together (a
barrier), the slowest rank's time. N processes share the machine's cores: on a machine with
fewer free cores than N x threads the step time measures contention as much as the method.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

MIB = 2**20


@dataclass(frozen=True)
class ContextParallelSettings:
    length: int = 8192  # tokens of the one sequence
    batch: int = 1
    layers: int = 2
    dim: int = 64
    heads: int = 4
    vocab: int = 256
    repeats: int = 3
    threads: int = 1  # per process
    layout: str = "zigzag"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def saved_bytes(step, exclude: set[int]) -> tuple[object, int]:
    """(step()'s result, bytes of the distinct storages autograd saved for backward during it,
    those whose data pointers are in `exclude` left out)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = step()
    return result, sum(seen.values())


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB  # Linux: KiB


def measure_rank(settings: ContextParallelSettings, cp) -> dict:
    """This rank's memory and step times (`cp` None: one process, the whole sequence)."""
    from urpe.models import TransformerConfig, TransformerDecoder

    s = settings
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=s.vocab, max_len=s.length, num_layers=s.layers, dim=s.dim,
        num_heads=s.heads, position="rpe", gate="toeplitz",
    )  # fmt: skip
    model = TransformerDecoder(config)
    gen = torch.Generator().manual_seed(1)

    def rows(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) of this rank: its shard of `length` tokens."""
        both = torch.randint(0, s.vocab, (2, s.batch, length), generator=gen)
        return (both[0], both[1]) if cp is None else (cp.shard(both[0]), cp.shard(both[1]))

    given = {} if cp is None else {"context_parallel": cp}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(tokens, **given)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # a step on 16 tokens per rank first: libraries and kernels load before the measurement
    step(*rows(16 * (1 if cp is None else cp.size))).backward()
    tokens, targets = rows(s.length)
    before = _peak_rss_mib()
    loss, saved = saved_bytes(lambda: step(tokens, targets), params)
    loss.backward()
    rise = _peak_rss_mib() - before
    times = []
    for _ in range(s.repeats):
        model.zero_grad(set_to_none=True)
        if cp is not None:
            dist.barrier()
        start = time.perf_counter()
        step(tokens, targets).backward()
        times.append(time.perf_counter() - start)
    return {
        "saved_mib": saved / MIB,
        "rss_rise_mib": rise,
        "step_ms": 1e3 * statistics.median(times),
        "shard_tokens": int(tokens.shape[-1]),
    }


def worker(rank: int, size: int, port: int, settings: dict, out: str) -> None:
    """One rank of an N-process measurement: its record to rank<rank>.json in `out`."""
    from urpe.distributed import ContextParallel

    s = ContextParallelSettings(**settings)
    os.environ["OMP_NUM_THREADS"] = str(s.threads)
    torch.set_num_threads(s.threads)
    cp = None
    if size > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
        cp = ContextParallel(layout=s.layout)
    try:
        record = measure_rank(s, cp)
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        if size > 1:
            dist.destroy_process_group()


def run_sizes(settings: ContextParallelSettings, sizes, folder: Path, progress=print) -> list:
    """Per N of `sizes`: {processes, the largest saved_mib and rss_rise_mib of a rank, the
    slowest rank's step_ms, ranks: every rank's record}."""
    rows = []
    for size in sizes:
        out = folder / f"n{size}"
        out.mkdir(parents=True, exist_ok=True)
        progress(f"{size} process(es), {settings.length // size} tokens each ...")
        mp.spawn(worker, args=(size, _free_port(), asdict(settings), str(out)), nprocs=size)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(size)]
        rows.append(
            {
                "processes": size,
                "saved_mib": max(r["saved_mib"] for r in ranks),
                "rss_rise_mib": max(r["rss_rise_mib"] for r in ranks),
                "step_ms": max(r["step_ms"] for r in ranks),
                "ranks": ranks,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    """The Markdown table: per N, memory per rank (and its ratio to N = 1) and step time."""
    first = rows[0]
    lines = [
        "| processes N | tokens per rank | saved activations per rank (MiB) | vs N=1 "
        "| peak RSS rise per rank (MiB) | step (ms, slowest rank) | vs N=1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['processes']} | {row['ranks'][0]['shard_tokens']} "
            f"| {row['saved_mib']:.1f} | {row['saved_mib'] / first['saved_mib']:.2f} "
            f"| {row['rss_rise_mib']:.1f} | {row['step_ms']:.0f} "
            f"| {row['step_ms'] / first['step_ms']:.2f} |"
        )
    return "\n".join(lines)
