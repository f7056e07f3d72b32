"""The flags every `urpe reproduce ...` command shares, and their checks.

Options several experiments declare (`STEPS`, `SEEDS`, `LR`, `WARMUP`, `BATCH_SIZE`, and the
model's `LAYERS`, `DIM`, `HEADS`, `FFN_DIM`) are defined here once; an experiment lists them
beside its own in its presets module.

`add_sweep_arguments(parser)` adds --out, --resume, --report-only, --jobs, --threads,
--accelerator, --devices, --num-nodes, --strategy, --precision, --accumulate-grad-batches,
--checkpoint-every and --no-progress. `resolve_execution(args, runs, batch_size)` checks them
against the machine and each other and returns an `Execution` (or raises `UsageError` naming
the flag). Importing this module needs no torch (the checks import it), so that `--help`
starts at once.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..cli_types import (
    UsageError,
    non_negative_int,
    positive_float,
    positive_int,
    seed_list,
)
from ..training.precision import PRECISIONS, STRATEGIES, normalize_precision
from .execution import Execution, world_size_from_environment
from .settings import Option

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")

SEEDS = Option(("--seeds",), "seeds", "seeds, comma-separated ({presets})", seed_list)
STEPS = Option(("--steps",), "steps", "optimiser updates ({presets})", positive_int)
LR = Option(("--lr",), "lr", "peak learning rate ({presets})", positive_float)
WARMUP = Option(
    ("--warmup",),
    "warmup",
    "warm-up updates ({presets}; scaled with --steps when not given)",
    non_negative_int,
)
BATCH_SIZE = Option(
    ("--batch-size",),
    "batch_size",
    "sequences per update, over all devices ({presets})",
    positive_int,
)
LAYERS = Option(("--layers",), "num_layers", "layers ({presets})", positive_int)
DIM = Option(("--dim",), "dim", "model width ({presets})", positive_int)
HEADS = Option(("--heads",), "num_heads", "attention heads ({presets})", positive_int)
FFN_DIM = Option(("--ffn-dim",), "ffn_dim", "feed-forward width ({presets})", positive_int)
# the size flags every Transformer preset takes (recipes.sized_transformer reads them)
MODEL_SIZE = (LAYERS, DIM, HEADS, FFN_DIM)


def add_sweep_arguments(
    parser: argparse.ArgumentParser, out: str, precision_help: str, splits_sequences: bool = False
) -> None:
    """Output, resume and execution flags (scale-out flags go straight to Lightning);
    `splits_sequences`: also --context-parallel (experiments whose model takes it)."""
    files = parser.add_argument_group("output and resume")
    files.add_argument(
        "--out",
        default=Path(out),
        type=Path,
        help="output folder: records/, runs/ (checkpoints, logs), results.* (default: %(default)s)",
    )
    files.add_argument(
        "--resume",
        action="store_true",
        help="skip runs whose record with exactly the same settings is in --out; "
        "continue unfinished runs from their last checkpoint",
    )
    files.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing; rebuild the report from --out's records",
    )
    files.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=500,
        metavar="N",
        help="save a checkpoint every N updates, and at the end "
        "(0: only at the end; default: %(default)s)",
    )
    files.add_argument("--no-progress", action="store_true", help="no progress bar")
    run = parser.add_argument_group("execution (none of these changes a run's result)")
    run.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        help="runs at once, each in its own process (default: one per CPU core "
        "with one thread each, or one per GPU)",
    )
    run.add_argument(
        "--threads",
        type=non_negative_int,
        default=0,
        help="torch CPU threads per run (default 0: the cores divided between the jobs)",
    )
    run.add_argument(
        "--accelerator",
        default="auto",
        choices=ACCELERATORS,
        help="Lightning accelerator (default: %(default)s: a GPU if there is one)",
    )
    run.add_argument(
        "--devices",
        default="auto",
        help="devices per run: a count, or GPU ids like 0,1 (default: auto = one "
        "per run; more than one trains each run with DDP/FSDP)",
    )
    run.add_argument(
        "--num-nodes",
        type=positive_int,
        default=1,
        help="machines per run (launch with torchrun or srun; default: 1)",
    )
    run.add_argument(
        "--strategy",
        default="auto",
        choices=STRATEGIES,
        help="Lightning strategy: ddp (data parallel), fsdp (sharded, for large "
        "models on GPUs; default: %(default)s)",
    )
    run.add_argument(
        "--precision",
        default=None,
        help=f"Lightning precision, one of {', '.join(PRECISIONS)} "
        f"({precision_help}). Part of a run's identity",
    )
    run.add_argument(
        "--accumulate-grad-batches",
        type=positive_int,
        default=1,
        metavar="K",
        help="split each update's batch into K micro-batches (same result, less "
        "memory; default: 1)",
    )
    if splits_sequences:
        run.add_argument(
            "--context-parallel",
            type=positive_int,
            default=1,
            metavar="N",
            help="split each sequence across N processes (context parallelism: ring "
            "attention, memory per process ~1/N, the same result): runs N local processes "
            "(gloo on CPUs, NCCL on GPUs; --devices a multiple of N adds data parallelism), "
            "or takes them from torchrun (default: 1)",
        )


TRAIN_MODULES = ("lightning", "torchmetrics", "safetensors", "tqdm", "matplotlib")


def require_training_extra() -> None:
    """Import the `train` extra's modules now, so a missing one is reported (by `urpe.cli`, as
    the pip command that installs it) before anything is created or trained."""
    import importlib

    for name in TRAIN_MODULES:
        importlib.import_module(name)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_precision(value: str | None, default: str, accelerator: str) -> str:
    """The precision a run uses (its long Lightning name). A preset's half-precision default
    falls back to 32-true on CPU; an explicit half-precision request on CPU is an error."""
    if value is None:
        chosen = default
        if accelerator == "cpu" and chosen.startswith("16"):
            return "32-true"
    else:
        try:
            chosen = normalize_precision(value)
        except ValueError as error:
            raise UsageError("--precision", str(error)) from None
    if accelerator == "cpu" and chosen.startswith("16"):
        raise UsageError("--precision", f"{chosen} needs a GPU; on CPU use bf16-mixed or 32-true")
    return chosen


def _accelerator(name: str) -> str:
    import torch  # here, not at the top: `--help` needs no torch

    if name == "auto":
        if torch.cuda.is_available():
            return "gpu"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if name in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise UsageError(
                "--accelerator",
                f"{name} requested, but torch sees no CUDA GPU (try --accelerator cpu)",
            )
        return "gpu"
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--accelerator", "mps requested, but torch sees no Apple GPU")
    return name


def _devices(text: str, accelerator: str) -> int | str | list[int]:
    import torch

    if text == "auto":
        return "auto"
    try:
        if "," in text:
            ids = [int(v) for v in text.split(",") if v.strip()]
            if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
                raise ValueError
            if accelerator != "gpu":
                raise UsageError("--devices", "device ids need --accelerator gpu")
            if max(ids) >= torch.cuda.device_count():
                raise UsageError(
                    "--devices", f"no GPU {max(ids)}: torch sees {torch.cuda.device_count()}"
                )
            return ids
        count = int(text)
    except ValueError:
        raise UsageError(
            "--devices",
            f"expected auto, a positive count or distinct GPU ids like 0,1; got {text!r}",
        ) from None
    if count < 1:
        raise UsageError("--devices", f"must be positive, got {count}")
    if accelerator == "gpu" and count > torch.cuda.device_count():
        raise UsageError(
            "--devices", f"{count} GPUs requested, torch sees {torch.cuda.device_count()}"
        )
    return count


def resolve_execution(args: argparse.Namespace, runs: int, batch_size: int) -> Execution:
    """Check the execution flags; pick jobs and threads for this machine."""
    import torch

    accelerator = _accelerator(args.accelerator)
    devices = _devices(str(args.devices), accelerator)
    if args.strategy == "fsdp" and accelerator != "gpu":
        raise UsageError("--strategy", "fsdp needs GPUs (--accelerator gpu); use ddp on CPU")
    per_run = len(devices) if isinstance(devices, list) else devices
    launched = world_size_from_environment()
    context_parallel = getattr(args, "context_parallel", 1)
    if context_parallel > 1 and per_run == "auto" and launched <= 1:
        per_run = devices = context_parallel  # one group of N local processes
    if launched > 1:
        world = launched
    elif per_run == "auto":
        world = args.num_nodes
    else:
        world = per_run * args.num_nodes
    strategy = args.strategy
    if context_parallel > 1:
        if world % context_parallel:
            raise UsageError(
                "--context-parallel",
                f"{context_parallel} processes per sequence do not divide the {world} "
                "processes of a run: give --devices a multiple of it",
            )
        if strategy == "fsdp":
            raise UsageError("--context-parallel", "runs with --strategy ddp (or auto)")
        strategy = "ddp"
    data_parallel = world // context_parallel  # processes that read different rows
    parts = data_parallel * args.accumulate_grad_batches
    if batch_size % parts:
        raise UsageError(
            "--batch-size",
            f"{batch_size} sequences per update do not split into "
            f"{data_parallel} processes x {args.accumulate_grad_batches} "
            f"accumulated micro-batches",
        )
    distributed = world > 1
    gpus: list[int] = []
    if distributed:
        if args.jobs not in (None, 1):
            raise UsageError(
                "--jobs",
                "a run on several devices or nodes uses all of them; "
                "runs then go one at a time (drop --jobs)",
            )
        jobs = 1
    elif accelerator == "gpu":
        available = torch.cuda.device_count()
        jobs = min(args.jobs or available, available, max(1, runs))
        if args.jobs and args.jobs > available:
            raise UsageError("--jobs", f"{args.jobs} jobs but {available} GPUs: one run per GPU")
        gpus = list(range(jobs)) if jobs > 1 else []
    else:
        jobs = args.jobs or min(usable_cores(), max(1, runs))
    threads = args.threads or max(1, usable_cores() // jobs)
    if per_run == "auto" and launched > 1:
        # torchrun / srun started the processes: this node's share of them is the devices.
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
        devices = int(local) if local and local.isdigit() else max(1, launched // args.num_nodes)
    elif per_run == "auto":
        # One device per run; with several GPUs, several runs at once (one per GPU).
        devices = 1
    taken = {f: getattr(args, f) for f in ("num_nodes", "accumulate_grad_batches")}
    more = dict(checkpoint_every=args.checkpoint_every or None, progress=not args.no_progress)
    return Execution(
        jobs,
        threads,
        accelerator,
        devices,
        strategy=strategy,
        context_parallel=context_parallel,
        **taken,
        **more,
        gpus=gpus,
    )
