"""Where derived molecule data lives, and how an entry is written and trusted.

The cache root is, in order: the `cache_dir` argument, the environment variable `URPE_CACHE_DIR`,
`$XDG_CACHE_HOME/urpe`, `~/.cache/urpe`; molecule entries live under `<root>/molecules/`.

An entry is a directory `<name>-<key>`, the key a hash of everything that changes its contents
(source files, split, target, featurisation, transform, format version). It is written in a
temporary sibling directory and renamed into place, so a reader never sees half an entry. Its
`manifest.json` is written last and records the SHA-256 of the data file. An entry whose manifest
is missing or unreadable, whose file does not match its hash, or which `torch.load` refuses is
rebuilt. The data file holds only tensors, strings and numbers, and is read with
`torch.load(weights_only=True)`, which never runs code from the file (PyTorch Geometric's own
loader falls back to full unpickling when the safe load fails, so it is not used for the cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

ENV_VAR = "URPE_CACHE_DIR"
SUBDIR = "molecules"
DATA_FILE = "data.pt"
MANIFEST = "manifest.json"
# Bump when the layout or meaning of an entry changes: old entries are then ignored.
FORMAT_VERSION = 1


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The molecule cache directory: `<root>/molecules`, root from the argument, else
    $URPE_CACHE_DIR, else $XDG_CACHE_HOME/urpe, else ~/.cache/urpe."""
    if cache_dir is not None:
        root = Path(cache_dir).expanduser()
    elif os.environ.get(ENV_VAR):
        root = Path(os.environ[ENV_VAR]).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "urpe"
    return root / SUBDIR


def cache_key(inputs: dict[str, Any]) -> str:
    """A short hash of a JSON-serialisable description of an entry's inputs."""
    text = json.dumps({"format": FORMAT_VERSION, **inputs}, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def load_entry(entry: Path) -> dict[str, Any] | None:
    """The payload of a complete, intact entry, or None (missing, corrupt or unsafe: rebuild)."""
    manifest_path, data_path = entry / MANIFEST, entry / DATA_FILE
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT_VERSION:
            return None
        if not data_path.is_file() or _sha256(data_path) != manifest["sha256"]:
            warnings.warn(
                f"cache entry {entry} does not match its manifest; rebuilding", stacklevel=3
            )
            return None
        return torch.load(data_path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable entry is rebuilt, never trusted
        warnings.warn(f"cache entry {entry} is unreadable ({error}); rebuilding", stacklevel=3)
        return None


def save_entry(entry: Path, payload: dict[str, Any], info: dict[str, Any]) -> None:
    """Write `payload` (tensors, strings, numbers in dicts and lists) as a cache entry."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        torch.save(payload, staging / DATA_FILE)
        manifest = {
            "format": FORMAT_VERSION,
            "sha256": _sha256(staging / DATA_FILE),
            "info": info,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(staging, entry)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
