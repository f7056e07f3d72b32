"""Running the compiler safely: one builder at a time, never forever, and nothing left behind.

- **The lock.** torch's own build lock is a file created with O_EXCL (`FileBaton`): a build
  killed mid-way (SIGKILL, out of memory, a stopped container) leaves it behind, and every later
  process then waits on it forever. urpe holds its own lock around torch's build instead: an OS
  lock (`flock`; `msvcrt.locking` on Windows) on `<key>.lock`, which the kernel releases when its
  holder dies however it dies. The holder writes its pid, host and start time into the file,
  for the message of a process that waits. A process waits for another's build at most
  `timeout` seconds (a holder that is stopped, not dead, keeps its lock), then gives up.
  torch's lock file found by a process holding urpe's lock is stale: the build that made it
  was killed.
- **The compiler** runs in a child process (`torch.utils.cpp_extension.load`, which also loads
  the result there: a library that crashes on loading crashes the child), in its own process
  group, so that after `timeout` seconds the child, ninja and the compilers are all stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TORCH_LOCK = "lock"  # torch.utils.file_baton.FileBaton in the build directory
POLL_SECONDS = 0.2


class BuildTimeout(RuntimeError):
    """A build ran, or another process's build was waited for, longer than the time allowed."""


class BuildError(RuntimeError):
    """The compiler failed; `details` holds its output."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def _try_lock(handle) -> bool:
    try:
        if sys.platform == "win32":
            import msvcrt

            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _owner(path: Path) -> str:
    """Who holds the lock, as its holder wrote it ("" if unknown)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(1)  # byte 0 is the one locked on Windows
            owner = json.loads(handle.read().decode() or "{}")
    except (OSError, ValueError):
        return ""
    if not isinstance(owner, dict) or "pid" not in owner:
        return ""
    since = time.time() - float(owner.get("since", time.time()))
    return f"pid {owner['pid']} on {owner.get('host', '?')}, building for {since:.0f} s"


@contextmanager
def build_lock(path: Path, timeout: float, waiting: Callable[[str], None]) -> Iterator[None]:
    """Hold the build lock at `path` for the body. Calls `waiting(who)` once if another process
    holds it; raises BuildTimeout after `timeout` seconds of waiting."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        deadline = time.monotonic() + timeout
        said = False
        while not _try_lock(handle):
            if not said:
                waiting(_owner(path))
                said = True
            if time.monotonic() >= deadline:
                who = _owner(path)
                raise BuildTimeout(
                    f"another process has held the build lock {path} for over "
                    f"{timeout:.0f} s{f' ({who})' if who else ''}"
                )
            time.sleep(POLL_SECONDS)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        handle.seek(1)
        handle.truncate()
        handle.write(json.dumps(owner).encode())
        handle.flush()
        yield  # closing the file releases the lock


def clear_stale_torch_lock(directory: Path) -> bool:
    """Remove torch's lock file from a build directory (call it holding urpe's lock)."""
    try:
        (directory / TORCH_LOCK).unlink()
        return True
    except FileNotFoundError:
        return False


# The child: torch alone, no urpe import (a second of start-up, not four).
_CHILD = """
import json, sys
from torch.utils import cpp_extension
cpp_extension.load(**json.loads(sys.argv[1]))
"""


def compile_library(
    name: str,
    sources: list[str],
    flags: list[str],
    include: list[str],
    directory: Path,
    timeout: float,
    verbose: bool,
) -> None:
    """`torch.utils.cpp_extension.load` in a child process: compile and link
    `directory/<name>.so` and load it once. Raises BuildError (with the compiler's output) or
    BuildTimeout; either way nothing keeps running."""
    import torch

    arguments = dict(
        name=name,
        sources=sources,
        extra_cflags=flags,
        extra_ldflags=[flag for flag in flags if "openmp" in flag],
        extra_include_paths=include,
        build_directory=str(directory),
        is_python_module=False,
        verbose=verbose,
    )
    # The torch this process runs, also where it was put on sys.path by hand.
    site = str(Path(torch.__file__).resolve().parents[1])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    )
    output = None if verbose else subprocess.PIPE
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(arguments)],
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT if output else None,
        env=env,
        start_new_session=sys.platform != "win32",
    )
    try:
        text, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(child)
        raise BuildTimeout(f"the build took over {timeout:.0f} s and was stopped") from None
    except BaseException:  # Ctrl-C, SIGTERM: the compilers stop with this process
        _stop(child)
        raise
    if child.returncode != 0:
        details = (text or b"").decode(errors="replace")
        lines = [line for line in details.splitlines() if line.strip()]
        last = next(
            (line for line in reversed(lines) if "error" in line.lower()),
            lines[-1] if lines else f"exit status {child.returncode}",
        )
        raise BuildError(f"the compiler failed: {last.strip()[:240]}", details)


def _stop(child: subprocess.Popen) -> None:
    if sys.platform == "win32":
        child.kill()
    else:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the child, ninja and every compiler
        except ProcessLookupError:
            pass
    child.wait()
