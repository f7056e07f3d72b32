"""Where derived text data lives, and how an entry is written and trusted.

The cache root is `urpe.files.cache_root` (the `cache_dir` argument, `$URPE_CACHE_DIR`,
`$XDG_CACHE_HOME/urpe`, `~/.cache/urpe`). Text entries live under `<root>/text/`.

An entry is a directory named `<name>-<key>`, where the key is a hash of everything that changes
its contents (the source's bytes, the tokenizer's settings, the format version). It is built in a
temporary sibling directory and renamed into place (`urpe.files.atomic_directory`), so a reader
never sees half an entry. Its
`manifest.json` is written last and records the SHA-256 of every other file; an entry whose
manifest is missing, unreadable or does not match its files is rebuilt. Nothing in an entry is a
pickle: token ids are safetensors, tokenizers and manifests are JSON.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...files import atomic_directory, cache_root, file_sha256
from ...files import cache_key as _cache_key

__all__ = ["cache_key", "cache_root", "cached_entry", "file_sha256", "read_manifest"]

MANIFEST = "manifest.json"
# Bump when the layout or the meaning of an entry changes: old entries are then ignored.
FORMAT_VERSION = 1


def cache_key(inputs: dict[str, Any]) -> str:
    """A short hash of a JSON-serialisable description of a text entry's inputs."""
    return _cache_key(inputs, FORMAT_VERSION)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def read_manifest(entry: Path) -> dict[str, Any] | None:
    """The manifest of a complete, intact entry, or None (missing, corrupt, or files changed)."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        recorded = manifest["files"]
        present = {str(p.relative_to(entry)): p for p in _files(entry)}
        if set(recorded) != set(present):
            return None
        for name, digest in recorded.items():
            if file_sha256(present[name]) != digest:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return manifest


def cached_entry(
    root: Path,
    name: str,
    inputs: dict[str, Any],
    build: Callable[[Path], dict[str, Any]],
    on_rebuild: Callable[[str], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The entry `<root>/<name>-<key>`, built by `build(directory) -> info` when missing or
    corrupt. `info` (JSON-serialisable) is stored in the manifest and returned with its path."""
    entry = root / f"{name}-{cache_key(inputs)}"
    manifest = read_manifest(entry)
    if manifest is not None:
        return entry, manifest
    if entry.exists():
        if on_rebuild is not None:
            on_rebuild(f"cache entry {entry} is incomplete or corrupt; rebuilding it")
        shutil.rmtree(entry, ignore_errors=True)

    def fill(staging: Path) -> None:
        nonlocal manifest
        info = build(staging)
        manifest = {
            "name": name,
            "inputs": inputs,
            "format": FORMAT_VERSION,
            "info": info,
            "files": {str(p.relative_to(staging)): file_sha256(p) for p in _files(staging)},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))

    atomic_directory(entry, fill)
    return entry, manifest
