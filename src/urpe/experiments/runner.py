"""The sweep runner every `urpe reproduce ...` command shares.

An experiment is a list of runs plus one function:

    specs = [RunSpec(name="pi-urpe-V10-seed0", config={...}, steps=800), ...]
    outcome = sweep(run_one, specs, out=Path("runs/synthetic"), execution=..., resume=True)

    def run_one(config: dict, context: RunContext) -> RunResult: ...

- **Identity.** `config` is the run's full resolved configuration (model, data, optimiser,
  steps, precision, seed: everything that changes the result), JSON-ready. The run's id is its
  name (made safe as a file name) plus a digest of that config; its record
  (`OUT/records/<id>.json`) stores the config whole. A user's data file enters the config as a
  content digest; where it lies goes under `config["locations"]`, stored but not part of the
  identity (a moved file is the same data, an edited one is not). `resume=True` skips a run
  only when a valid record with that exact config exists, so changing any setting trains again
  instead of reusing a different run's result. Settings that change how a run executes but not
  what it computes (jobs, threads, devices, accumulation) are not part of the identity; they are
  stored in the record's "execution".
- **Atomic records.** A record (and its tensors, `OUT/records/<id>.safetensors`) is written to a
  temporary file and renamed into place. A record that does not parse is named by its path and,
  under `resume`, the run is trained again.
- **Checkpoints.** Each run gets `OUT/runs/<id>/` (`context.run_dir`) for its checkpoints and
  logs; with `resume`, `run_one` continues from the newest checkpoint there (`urpe.training.fit`
  does this). Without `resume`, the folder is cleared and the run starts over.
- **Parallel runs.** `execution.jobs` runs at once, each in its own process (spawned, so CUDA
  and thread pools start clean) with `execution.threads` torch threads; with GPUs, one run per
  GPU. Every run is seeded by its config alone, so a parallel sweep gives the same records as a
  sequential one. One progress bar counts updates across all runs (runs done, time left); each
  finished run prints one line.
- **Multi-device runs** (devices > 1, several nodes, or launched by torchrun/SLURM) run one at a
  time in this process; every rank walks the same plan and only global rank 0 writes records.
- **Interrupts.** Ctrl-C or SIGTERM stops the sweep (`SweepInterrupted`) and its workers;
  records and checkpoints written so far stay, and the same command with `--resume` continues
  where it stopped. A worker also dies with the main process when that is killed outright
  (SIGKILL): on Linux through the parent-death signal, elsewhere by watching its parent
  (`stopping.py`).

`run_one` must be a module-level function (spawned workers import it by name). It returns a
`RunResult`: `record`, a JSON-ready dict of what the run measured, and optional `tensors` (e.g.
learned matrices) saved beside the record. `context.fit(objective, data, max_steps=..., ...)`
trains it with `urpe.training.fit` in its folder, on the sweep's devices.

The pieces, one job each: `records.py` (identity, the record store), `execution.py` (how one
run executes: `Execution`, `RunContext`, `execute_run`), `workers.py` (parallel runs in spawned
processes), `progress.py` (the bar); this module walks the sweep.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from ..files import CorruptFileError, remove_stale_temporaries
from .execution import (
    Execution,
    RunContext,
    RunOne,
    SweepOutcome,
    execute_run,
    global_rank,
    record_failure,
    world_size_from_environment,
)
from .progress import Progress
from .records import RECORD_FORMAT, RecordStore, RunResult, RunSpec, canonical_json, config_digest
from .stopping import Terminated, raise_terminated
from .workers import run_parallel

__all__ = [
    "RECORD_FORMAT",
    "Execution",
    "RecordStore",
    "RunContext",
    "RunResult",
    "RunSpec",
    "SweepInterrupted",
    "SweepOutcome",
    "canonical_json",
    "config_digest",
    "execute_run",
    "global_rank",
    "sweep",
    "sweep_command",
    "world_size_from_environment",
]


class SweepInterrupted(Exception):
    """Ctrl-C or SIGTERM during a sweep; finished records and checkpoints are kept. `args[0]`:
    the exit status (130 for Ctrl-C, 143 for SIGTERM)."""


def sweep(
    run_one: RunOne,
    specs: Sequence[RunSpec],
    out: str | Path,
    execution: Execution,
    resume: bool,
    describe: Callable[[dict], str] = lambda record: "done",
    warn: Callable[[str], None] | None = None,
) -> SweepOutcome:
    """Run every spec (see the module docstring); `describe(record)` is the finished-run line.

    Raises SweepInterrupted on Ctrl-C or SIGTERM. Runs that raise are reported and listed in
    the outcome; the others go on.
    """
    store = RecordStore(out)
    rank0 = global_rank() == 0
    say = warn or (lambda message: print(message, file=sys.stderr, flush=True))
    ids = [s.id for s in specs]
    duplicates = sorted({s.name for s in specs if ids.count(s.id) > 1})
    if duplicates:
        raise ValueError(f"the sweep lists a run twice: {', '.join(duplicates)}")
    if rank0:
        store.records.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(store.records)
    outcome = SweepOutcome(records=[])
    todo: list[RunSpec] = []
    for spec in specs:
        if resume:
            try:
                record = store.load(spec)
            except CorruptFileError as error:
                if rank0:
                    say(f"{error}; training {spec.name} again")
                record = None
            if record is not None:
                outcome.records.append(record)
                outcome.skipped += 1
                continue
        todo.append(spec)
    if not todo:
        return outcome
    progress = Progress(todo, execution.progress and rank0)
    previous_term = None
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        if execution.jobs > 1 and not execution.distributed and len(todo) > 1:
            run_parallel(run_one, todo, store, execution, resume, progress, describe, outcome)
        else:
            _sequential(run_one, todo, store, execution, resume, progress, describe, outcome)
    except KeyboardInterrupt as error:
        raise SweepInterrupted(143 if isinstance(error, Terminated) else 130) from None
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        progress.close()
    return outcome


def sweep_command(
    prog: str,
    run_one: RunOne,
    specs: Sequence[RunSpec],
    out: Path,
    execution: Execution,
    resume: bool,
    describe: Callable[[dict], str],
    warn: Callable[[str], None],
) -> SweepOutcome | int:
    """`sweep` as a `urpe reproduce ...` command runs it: Ctrl-C becomes one line and exit
    code 130, skipped and failed runs are summed up in a line each. Returns the exit code when
    this process is done (interrupted: 130; a rank other than 0: 0), else the outcome, for the
    command to write its report from."""
    try:
        outcome = sweep(run_one, specs, out, execution, resume, describe, warn)
    except SweepInterrupted as stop:
        print(
            f"{prog}: interrupted; finished runs and checkpoints are kept in {out}: run "
            "the same command with --resume to continue",
            file=sys.stderr,
        )
        return stop.args[0] if stop.args else 130
    if global_rank() != 0:
        return 0
    if outcome.skipped:
        warn(f"{outcome.skipped} of {len(specs)} runs already recorded in {out} (--resume)")
    if outcome.failed:
        warn(
            f"{len(outcome.failed)} of {len(specs)} runs failed: "
            + ", ".join(spec.name for spec, _ in outcome.failed)
        )
    return outcome


def _sequential(run_one, todo, store, execution, resume, progress, describe, outcome) -> None:
    import torch

    threads = torch.get_num_threads()
    if execution.threads:
        torch.set_num_threads(execution.threads)
    from ..kernels.cpp.build import report_to

    try:
        with report_to(progress.line):  # "compiling the C++ kernel" above the bar, not in it
            _run_in_turn(run_one, todo, store, execution, resume, progress, describe, outcome)
    finally:  # the caller's own setting, also after Ctrl-C (this may run inside a notebook)
        torch.set_num_threads(threads)


def _run_in_turn(run_one, todo, store, execution, resume, progress, describe, outcome) -> None:
    for index, spec in enumerate(todo):
        try:
            on_step = functools.partial(progress.step, index)
            context = RunContext(store.run_dir(spec), execution, resume, on_step, progress.line)
            record = execute_run(run_one, spec, store, context)
        except (KeyboardInterrupt, SweepInterrupted):
            raise
        except Exception as error:
            record_failure(store, spec, error, traceback.format_exc(), progress, index, outcome)
            continue
        outcome.trained += 1
        if record is not None:
            outcome.records.append(record)
            progress.finish(index, f"{spec.name}: {describe(record)}")
