"""Files that are either complete or absent: atomic writes, reads that name a bad file, and the
cache's root and keys. The bottom of the house: data caches, checkpoints, the sweep runner and
the reports all write through here.

A kill (SIGKILL, power loss, preemption) can stop a process at any instruction. Every file the
runner and the checkpoints write is first written to a temporary name in the same directory,
flushed to disk, then renamed over its final name with `os.replace`, which is atomic on POSIX:
a reader sees the old file or the new one, never half of one. The temporary names are made
private (mode 0600, 0700); before the rename a file gets the mode a plain `open` would have
given it (0666 less the umask; an existing file's own mode), a directory 0777 less the umask.

Derived data (tokenised corpora, featurised molecules) is cached under one root: the
`cache_dir` argument, else `$URPE_CACHE_DIR`, else `$XDG_CACHE_HOME/urpe`, else `~/.cache/urpe`;
an entry's key is a hash of everything that changes its contents.

This module needs the standard library only, so every layer may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


class CorruptFileError(ValueError):
    """A file that exists but cannot be read as what it should be; the message names its path."""

    def __init__(self, path: str | Path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


def _fsync_directory(directory: Path) -> None:
    # The rename itself lives in the directory entry: sync it too (best effort; some
    # filesystems refuse to open directories).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux's
    /proc/self/status); elsewhere set and restored at once, under a lock."""
    try:
        found = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        found = None
    if found:
        return int(found.group(1), 8)
    with _umask_lock:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def _file_mode(path: Path) -> int:
    """The mode `open(path, "w")` would leave: an existing file's own, else 0666 less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return 0o666 & ~current_umask()


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(temporary_path)`, then rename the result onto `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    temporary = Path(name)
    try:
        write(temporary)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(temporary, _file_mode(path))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, data: Any) -> Path:
    """`data` as indented JSON; refuses NaN/inf (not JSON) instead of writing a file that strict
    readers reject."""
    return atomic_write_text(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def atomic_directory(path: str | Path, fill: Callable[[Path], None]) -> Path:
    """Fill a fresh temporary directory with `fill(directory)`, then rename it to `path`.

    An existing `path` is replaced: it is first renamed aside, then removed, so at no moment is
    a half-written directory visible under `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        fill(temporary)
        for child in temporary.rglob("*"):
            if child.is_dir():
                _fsync_directory(child)
            else:
                with open(child, "rb+") as handle:
                    os.fsync(handle.fileno())
        _fsync_directory(temporary)
        os.chmod(temporary, 0o777 & ~current_umask())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(temporary, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _fsync_directory(path.parent)
    return path


def read_json(path: str | Path) -> Any:
    """Parse a JSON file; anything unreadable raises `CorruptFileError` naming the path."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptFileError(path, "not UTF-8 text (not a JSON file)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        reason = "empty file" if not text.strip() else f"invalid JSON ({error.msg}, line "
        if text.strip():
            reason += f"{error.lineno})"
        raise CorruptFileError(path, reason) from None


def remove_stale_temporaries(directory: str | Path) -> None:
    """Delete leftovers of writes that a kill interrupted (`.name.*.tmp`, `.name.old-*`)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for child in directory.iterdir():
        if child.name.startswith(".") and (child.name.endswith(".tmp") or ".old-" in child.name):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The cache

CACHE_ENV_VAR = "URPE_CACHE_DIR"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: the argument, else $URPE_CACHE_DIR, else $XDG_CACHE_HOME/urpe, else
    ~/.cache/urpe."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "urpe"


def cache_key(inputs: dict[str, Any], format_version: int) -> str:
    """A short hash of a JSON-serialisable description of an entry's inputs and of the format
    version of its kind of entry (bumping it retires every old entry)."""
    text = json.dumps({"format": format_version, **inputs}, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
