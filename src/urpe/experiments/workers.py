"""Parallel runs: `execution.jobs` spawned worker processes (CUDA and thread pools start clean),
one GPU each when there are GPUs, fed from a queue; the parent follows their events (start,
step, warn, done, failed) and books every run exactly once, also when a worker dies.

On the CPU the parent loads the C++ attention kernel before it starts the workers, compiling it
if the cache lacks it: its "compiling" line (or why the kernel is unavailable) is said once,
above the progress bar, instead of once per worker, and no worker's first step waits on
another's build. Workers send any line of their own builds to the parent as "warn" events."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from .execution import Execution, RunContext, RunOne, execute_run, one_line, record_failure
from .records import RecordStore
from .stopping import die_with_parent


def _worker(
    slot: int,
    tasks: Any,
    events: Any,
    threads: int,
    gpu: int | None,
    run_one: RunOne,
    out: str,
    execution: Execution,
    resume: bool,
    parent: int | None = None,
    cpu_kernel: str | None = None,
) -> None:
    # Ctrl-C reaches the whole process group; the parent decides and stops workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:  # SIGKILL of the parent cannot be handled: the worker ends itself
        die_with_parent(parent)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import torch

    from ..kernels.cpp.build import adopt, report_to

    torch.set_num_threads(threads)
    adopt(cpu_kernel)  # unavailable, as the parent found and said: no warning per worker
    with report_to(lambda message: events.put(("warn", -1, message))):
        _take_runs(slot, tasks, events, run_one, RecordStore(out), execution, resume)


def _reporter(events, kind: str, index: int) -> Callable:
    """What a run reports (a step, a warning) as an event of run `index` for the parent."""
    return lambda value: events.put((kind, index, value))


def _take_runs(slot, tasks, events, run_one, store, execution, resume) -> None:
    while True:
        item = tasks.get()
        if item is None:
            return
        index, spec = item
        events.put(("start", index, slot))
        try:
            step, warn = (_reporter(events, kind, index) for kind in ("step", "warn"))
            context = RunContext(store.run_dir(spec), execution, resume, step, warn)
            record = execute_run(run_one, spec, store, context)
            events.put(("done", index, record))
        except Exception as error:  # reported by the parent, which goes on with the others
            events.put(("failed", index, one_line(error), traceback.format_exc()))


def prepare_cpu_kernel(execution: Execution, say: Callable[[str], None]) -> str | None:
    """Load (or build) the C++ CPU kernel here, its lines and its warning through `say`, where
    the runs train on the CPU; why it is unavailable (None: loaded, or not needed)."""
    if execution.gpus or execution.accelerator not in ("cpu", "auto"):
        return None
    from ..kernels.cpp.build import load, report_to

    with report_to(say), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reason = load()
    for warning in caught:
        say(str(warning.message))
    return reason


def run_parallel(run_one, todo, store, execution, resume, progress, describe, outcome) -> None:
    cpu_kernel = prepare_cpu_kernel(execution, progress.line)
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
            args=(
                slot,
                tasks,
                events,
                execution.threads,
                gpu,
                run_one,
                str(store.out),
                execution,
                resume,
                os.getpid(),
                cpu_kernel,
            ),
            daemon=True,
        )
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
                        record_failure(
                            store,
                            todo[index],
                            f"worker died (exit code {worker.exitcode})",
                            "",
                            progress,
                            index,
                            outcome,
                        )
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
                record_failure(store, todo[index], event[2], event[3], progress, index, outcome)
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
