"""Conditions a measurement runs under: how many torch threads, and whether another process
keeps one core busy (issue 21: users run urpe beside other work, not on an idle machine).

The busy process is a child spinning in a Python loop, pinned to one core where the OS allows
it; it starts before a measurement block and is stopped after it, so idle and busy blocks of
one run differ only in that process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

SPIN = "while True:\n    pass\n"


def busy_core_index() -> int | None:
    """The core the busy process is pinned to: the last this process may run on (None where
    the OS has no affinity call)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return max(os.sched_getaffinity(0))


@contextmanager
def busy_core(core: int | None = None, settle_s: float = 0.2) -> Iterator[int]:
    """A child process spinning on `core` (None: wherever the OS puts it) for the duration of
    the block; yields its pid. `settle_s`: time for it to start and reach its loop."""
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL)
    try:
        if core is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(child.pid, {core})
        time.sleep(settle_s)
        yield child.pid
    finally:
        child.kill()
        child.wait()


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` for the block (0: leave it)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Condition:
    """Threads and load of one measurement block; `fields` go into its records."""

    threads: int
    busy: bool

    @property
    def fields(self) -> dict:
        return dict(threads=self.threads, busy=self.busy)

    @property
    def label(self) -> str:
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}, " + (
            "one core busy" if self.busy else "idle"
        )

    @contextmanager
    def applied(self) -> Iterator[None]:
        with torch_threads(self.threads):
            if not self.busy:
                yield
                return
            with busy_core(busy_core_index()):
                yield


def conditions(thread_counts: list[int]) -> list[Condition]:
    """Idle and busy at every thread count, idle first."""
    return [Condition(n, busy) for n in thread_counts for busy in (False, True)]
