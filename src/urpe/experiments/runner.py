"""The sweep runner every `urpe reproduce ...` command shares.

An experiment is a list of runs plus one function:

    specs = [RunSpec(name="pi-urpe-V10-seed0", config={...}, steps=800), ...]
    outcome = sweep(run_one, specs, out=Path("runs/synthetic"), execution=..., resume=True)

    def run_one(config: dict, context: RunContext) -> RunResult: ...

- **Identity.** `config` is the run's full resolved configuration (model, data, optimiser,
  steps, precision, seed: everything that changes the result), JSON-ready. The run's id is its
  name plus a digest of that config; its record (`OUT/records/<id>.json`) stores the config
  whole. `resume=True` skips a run only when a valid record with that exact config exists, so
  changing any setting trains again instead of reusing a different run's result. Settings that
  change how a run executes but not what it computes (jobs, threads, devices, accumulation)
  are not part of the identity; they are stored in the record's "execution".
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
- **Interrupts.** Ctrl-C stops the sweep (`SweepInterrupted`); records and checkpoints written so
  far stay, and the same command with `--resume` continues where it stopped.

`run_one` must be a module-level function (spawned workers import it by name). It returns a
`RunResult`: `record`, a JSON-ready dict of what the run measured, and optional `tensors` (e.g.
learned matrices) saved beside the record.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..files import (
    CorruptFileError,
    atomic_write,
    atomic_write_json,
    read_json,
    remove_stale_temporaries,
)

RECORD_FORMAT = "urpe-record/2"


def canonical_json(config: Any) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_digest(config: dict) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


@dataclass(frozen=True)
class RunSpec:
    """One run: a readable `name`, its full resolved `config` (its identity) and its number of
    optimiser `steps` (for the progress bar)."""

    name: str
    config: dict
    steps: int = 1

    @property
    def id(self) -> str:
        return f"{self.name}-{config_digest(self.config)[:10]}"


@dataclass
class Execution:
    """How runs execute; none of it is part of a run's identity."""

    jobs: int = 1
    threads: int = 1
    accelerator: str = "cpu"
    devices: int | str | list[int] = 1
    num_nodes: int = 1
    strategy: str = "auto"
    accumulate_grad_batches: int = 1
    checkpoint_every: int | None = None
    progress: bool = True
    gpus: list[int] = field(default_factory=list)  # one worker per id when jobs > 1

    @property
    def distributed(self) -> bool:
        """Several processes per run (every one runs the whole sweep)."""
        return world_size_from_environment() > 1 or self.num_nodes > 1 or (
            isinstance(self.devices, int) and self.devices > 1
        ) or isinstance(self.devices, list) and len(self.devices) > 1  # fmt: skip


@dataclass
class RunContext:
    """What `run_one` gets besides its config."""

    run_dir: Path
    execution: Execution
    resume: bool
    on_step: Callable[[int], None]
    warn: Callable[[str], None]


@dataclass
class RunResult:
    record: dict
    tensors: dict[str, Any] | None = None


@dataclass
class SweepOutcome:
    records: list[dict]  # this sweep's records, finished now or skipped under resume
    trained: int = 0
    skipped: int = 0
    failed: list[tuple[RunSpec, str]] = field(default_factory=list)


class SweepInterrupted(Exception):
    """Ctrl-C during a sweep; finished records and checkpoints are kept."""


# ---------------------------------------------------------------------------------------------
# Records


def world_size_from_environment() -> int:
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 1


def global_rank() -> int:
    """This process's rank in a distributed launch (0 when not distributed)."""
    try:
        from lightning.pytorch.utilities import rank_zero_only

        rank = getattr(rank_zero_only, "rank", None)
        if rank is not None:
            return int(rank)
    except ImportError:
        pass
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 0


class RecordStore:
    """`OUT/records/<id>.json` (+ `<id>.safetensors`) and `OUT/runs/<id>/` per run."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.records = self.out / "records"

    def record_path(self, spec: RunSpec) -> Path:
        return self.records / f"{spec.id}.json"

    def tensors_path(self, record: dict) -> Path:
        return self.records / f"{record['id']}.safetensors"

    def run_dir(self, spec: RunSpec) -> Path:
        return self.out / "runs" / spec.id

    def load(self, spec: RunSpec) -> dict | None:
        """The valid record of exactly this run, None if absent; `CorruptFileError` (naming the
        file) if it exists but is unreadable or is not this run's."""
        path = self.record_path(spec)
        if not path.exists():
            return None
        record = check_record(read_json(path), path)
        if canonical_json(record["config"]) != canonical_json(spec.config):
            raise CorruptFileError(path, "its config does not match its name")
        return record

    def write(self, spec: RunSpec, result: RunResult, execution: dict, seconds: float) -> dict:
        record = {
            "format": RECORD_FORMAT,
            "id": spec.id,
            "name": spec.name,
            "config": spec.config,
            "result": result.record,
            "execution": execution,
            "seconds": round(seconds, 2),
            "finished": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        if result.tensors:
            from safetensors.torch import save_file

            tensors = {k: v.detach().cpu().contiguous() for k, v in result.tensors.items()
                       if v is not None}  # fmt: skip
            atomic_write(self.tensors_path(record), lambda p: save_file(tensors, str(p)))
        atomic_write_json(self.record_path(spec), record)
        return record

    def load_all(self, warn: Callable[[str], None]) -> list[dict]:
        """Every valid record in the folder; each unreadable one is named through `warn`."""
        records = []
        for path in sorted(self.records.glob("*.json")):
            try:
                records.append(check_record(read_json(path), path))
            except CorruptFileError as error:
                warn(f"skipping {error}")
        return records


def check_record(record: Any, path: Path) -> dict:
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise CorruptFileError(path, f"not a {RECORD_FORMAT} record")
    for key, kind in (("id", str), ("config", dict), ("result", dict)):
        if not isinstance(record.get(key), kind):
            raise CorruptFileError(path, f"record has no valid {key!r}")
    return record


# ---------------------------------------------------------------------------------------------
# Executing one run (in this process or in a worker)


def _execution_record(execution: Execution) -> dict:
    import torch

    return {**{k: v for k, v in asdict(execution).items() if k not in ("progress", "gpus")},
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}  # fmt: skip


def execute_run(
    run_one: Callable[[dict, RunContext], RunResult],
    spec: RunSpec,
    store: RecordStore,
    execution: Execution,
    resume: bool,
    on_step: Callable[[int], None],
    warn: Callable[[str], None],
) -> dict | None:
    """Train one run and write its record (global rank 0 only); return the record."""
    run_dir = store.run_dir(spec)
    if not resume and run_dir.exists() and global_rank() == 0:
        shutil.rmtree(run_dir)  # a fresh start: no stale checkpoint to continue from
    remove_stale_temporaries(run_dir / "checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    context = RunContext(run_dir, execution, resume, on_step, warn)
    start = time.perf_counter()
    result = run_one(spec.config, context)
    if global_rank() != 0:
        return None
    return store.write(spec, result, _execution_record(execution), time.perf_counter() - start)


def _worker(slot: int, tasks: Any, events: Any, threads: int, gpu: int | None,
            run_one: Callable, out: str, execution: Execution, resume: bool) -> None:  # fmt: skip
    # Ctrl-C reaches the whole process group; the parent decides and stops workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import torch

    torch.set_num_threads(threads)
    store = RecordStore(out)
    while True:
        item = tasks.get()
        if item is None:
            return
        index, spec = item
        events.put(("start", index, slot))
        try:
            record = execute_run(
                run_one, spec, store, execution, resume,
                on_step=lambda step, index=index: events.put(("step", index, step)),
                warn=lambda message, index=index: events.put(("warn", index, message)),
            )  # fmt: skip
            events.put(("done", index, record))
        except Exception as error:  # reported by the parent, which goes on with the others
            events.put(("failed", index, _one_line(error), traceback.format_exc()))


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


# ---------------------------------------------------------------------------------------------
# The sweep


class _Progress:
    """One bar over all runs' updates: runs done / total in the description, time left from
    the update rate; one line per finished run above it."""

    def __init__(self, specs: Sequence[RunSpec], enabled: bool):
        from tqdm.auto import tqdm

        self.specs = specs
        self.done = 0
        self.steps = {i: 0 for i in range(len(specs))}
        self.bar = tqdm(total=sum(s.steps for s in specs), disable=not enabled, unit="step",
                        dynamic_ncols=True, desc=self._description(), file=sys.stderr,
                        mininterval=0.5, smoothing=0.05)  # fmt: skip

    def _description(self) -> str:
        return f"runs {self.done}/{len(self.specs)}"

    def step(self, index: int, step: int) -> None:
        step = min(step, self.specs[index].steps)
        if step > self.steps[index]:
            self.bar.update(step - self.steps[index])
            self.steps[index] = step

    def finish(self, index: int, line: str) -> None:
        self.step(index, self.specs[index].steps)
        self.done += 1
        self.bar.set_description_str(self._description(), refresh=False)
        self.line(line)

    def line(self, text: str) -> None:
        if self.bar.disable:
            print(text, file=sys.stderr, flush=True)
        else:
            self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


def sweep(run_one: Callable[[dict, RunContext], RunResult], specs: Sequence[RunSpec],
          out: str | Path, execution: Execution, resume: bool,
          describe: Callable[[dict], str] = lambda record: "done",
          warn: Callable[[str], None] | None = None) -> SweepOutcome:  # fmt: skip
    """Run every spec (see the module docstring); `describe(record)` is the finished-run line.

    Raises SweepInterrupted on Ctrl-C. Runs that raise are reported and listed in the outcome;
    the others go on.
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
    progress = _Progress(todo, execution.progress and rank0)
    try:
        if execution.jobs > 1 and not execution.distributed and len(todo) > 1:
            _parallel(run_one, todo, store, execution, resume, progress, describe, outcome)
        else:
            _sequential(run_one, todo, store, execution, resume, progress, describe, outcome)
    except KeyboardInterrupt:
        raise SweepInterrupted from None
    finally:
        progress.close()
    return outcome


def sweep_command(
    prog: str, run_one: Callable[[dict, RunContext], RunResult], specs: Sequence[RunSpec],
    out: Path, execution: Execution, resume: bool, describe: Callable[[dict], str],
    warn: Callable[[str], None],
) -> SweepOutcome | int:  # fmt: skip
    """`sweep` as a `urpe reproduce ...` command runs it: Ctrl-C becomes one line and exit
    code 130, skipped and failed runs are summed up in a line each. Returns the exit code when
    this process is done (interrupted: 130; a rank other than 0: 0), else the outcome, for the
    command to write its report from."""
    try:
        outcome = sweep(run_one, specs, out, execution, resume, describe, warn)
    except SweepInterrupted:
        print(f"{prog}: interrupted; finished runs and checkpoints are kept in {out}: run "
              "the same command with --resume to continue", file=sys.stderr)  # fmt: skip
        return 130
    if global_rank() != 0:
        return 0
    if outcome.skipped:
        warn(f"{outcome.skipped} of {len(specs)} runs already recorded in {out} (--resume)")
    if outcome.failed:
        warn(f"{len(outcome.failed)} of {len(specs)} runs failed: "
             + ", ".join(spec.name for spec, _ in outcome.failed))  # fmt: skip
    return outcome


def _sequential(run_one, todo, store, execution, resume, progress, describe, outcome) -> None:
    import torch

    threads = torch.get_num_threads()
    if execution.threads:
        torch.set_num_threads(execution.threads)
    try:
        _run_in_turn(run_one, todo, store, execution, resume, progress, describe, outcome)
    finally:  # the caller's own setting, also after Ctrl-C (this may run inside a notebook)
        torch.set_num_threads(threads)


def _run_in_turn(run_one, todo, store, execution, resume, progress, describe, outcome) -> None:
    for index, spec in enumerate(todo):
        try:
            record = execute_run(run_one, spec, store, execution, resume,
                                 on_step=lambda step, i=index: progress.step(i, step),
                                 warn=progress.line)  # fmt: skip
        except (KeyboardInterrupt, SweepInterrupted):
            raise
        except Exception as error:
            _failed(store, spec, error, traceback.format_exc(), progress, index, outcome)
            continue
        outcome.trained += 1
        if record is not None:
            outcome.records.append(record)
            progress.finish(index, f"{spec.name}: {describe(record)}")


def _failed(store, spec, error, trace, progress, index, outcome) -> None:
    message = error if isinstance(error, str) else _one_line(error)
    log = store.run_dir(spec) / "error.txt"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(trace)
    except OSError:
        pass
    outcome.failed.append((spec, message))
    progress.finish(index, f"{spec.name}: FAILED: {message} (details: {log})")


def _parallel(run_one, todo, store, execution, resume, progress, describe, outcome) -> None:
    context = mp.get_context("spawn")
    tasks, events = context.Queue(), context.Queue()
    for item in enumerate(todo):
        tasks.put(item)
    jobs = min(execution.jobs, len(todo))
    for _ in range(jobs):
        tasks.put(None)
    workers = []
    for slot in range(jobs):
        gpu = execution.gpus[slot] if slot < len(execution.gpus) else None
        worker = context.Process(
            target=_worker,
            args=(slot, tasks, events, execution.threads, gpu, run_one, str(store.out),
                  execution, resume),
            daemon=True,
        )  # fmt: skip
        worker.start()
        workers.append(worker)
    running: dict[int, int] = {}  # slot -> run index
    finished: set[int] = set()
    try:
        while len(finished) < len(todo):
            try:
                event = events.get(timeout=1.0)
            except queue.Empty:  # no news for a second: check that the workers live
                for slot, worker in enumerate(workers):
                    if not worker.is_alive() and slot in running:
                        index = running.pop(slot)
                        finished.add(index)
                        _failed(store, todo[index], f"worker died (exit code {worker.exitcode})",
                                "", progress, index, outcome)  # fmt: skip
                if not any(w.is_alive() for w in workers) and len(finished) < len(todo):
                    raise RuntimeError("all workers stopped before the sweep finished") from None
                continue
            kind, index = event[0], event[1]
            if kind == "start":
                running[event[2]] = index
            elif kind == "step":
                progress.step(index, event[2])
            elif kind == "warn":
                progress.line(event[2])
            elif kind == "done":
                finished.add(index)
                running = {s: i for s, i in running.items() if i != index}
                outcome.trained += 1
                outcome.records.append(event[2])
                progress.finish(index, f"{todo[index].name}: {describe(event[2])}")
            elif kind == "failed":
                finished.add(index)
                running = {s: i for s, i in running.items() if i != index}
                _failed(store, todo[index], event[2], event[3], progress, index, outcome)
        for worker in workers:  # each got its stop sentinel
            worker.join(timeout=30)
    finally:
        for worker in workers:
            if worker.is_alive():
                # Records and checkpoints are written atomically: killing loses at most the
                # updates since the last checkpoint.
                worker.kill()
        for worker in workers:
            worker.join()
