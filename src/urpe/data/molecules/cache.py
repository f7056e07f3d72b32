"""Where derived molecule data lives, and how an entry is written and trusted.

The cache root is `urpe.files.cache_root` (the `cache_dir` argument, `$URPE_CACHE_DIR`,
`$XDG_CACHE_HOME/urpe`, `~/.cache/urpe`); molecule entries live under `<root>/molecules/`.

An entry is a directory `<name>-<key>`, the key a hash of everything that changes its contents
(source files, split, target, featurisation, transform, format version). It is written in a
temporary sibling directory and renamed into place (`urpe.files.atomic_directory`), so a reader
never sees half an entry. Its
`manifest.json` is written last and records the SHA-256 of the data file. An entry whose manifest
is missing or unreadable, whose file does not match its hash, or which `torch.load` refuses is
rebuilt. The data file holds only tensors, strings and numbers, and is read with
`torch.load(weights_only=True)`, which never runs code from the file (PyTorch Geometric's own
loader falls back to full unpickling when the safe load fails, so it is not used for the cache).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ... import files
from ...files import atomic_directory
from ...files import file_sha256 as _sha256

SUBDIR = "molecules"
DATA_FILE = "data.pt"
MANIFEST = "manifest.json"
# Bump when the layout or meaning of an entry changes: old entries are then ignored.
FORMAT_VERSION = 1


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The molecule cache directory: `<root>/molecules` under `urpe.files.cache_root`."""
    return files.cache_root(cache_dir) / SUBDIR


def cache_key(inputs: dict[str, Any]) -> str:
    """A short hash of a JSON-serialisable description of a molecule entry's inputs."""
    return files.cache_key(inputs, FORMAT_VERSION)


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

    def fill(staging: Path) -> None:
        torch.save(payload, staging / DATA_FILE)
        manifest = {"format": FORMAT_VERSION, "sha256": _sha256(staging / DATA_FILE), "info": info}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))

    atomic_directory(entry, fill)
