"""Libraries checked before they are loaded: a record of the built file's size and SHA-256.

A build killed while linking, a full disk or a copy cut short leaves a truncated library, and
`dlopen` of a truncated library maps pages past its end: the first touch kills the process with
SIGBUS. So a build writes a record (JSON, atomically) once its library is complete, and a
library is loaded only when it matches its record byte for byte. Hashing the ~0.5 MB file takes
about a millisecond.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...files import atomic_write_json, file_sha256


def describe(library: Path) -> dict[str, Any]:
    return {
        "library": library.name,
        "bytes": library.stat().st_size,
        "sha256": file_sha256(library),
    }


def write_record(record: Path, library: Path, **facts: Any) -> dict[str, Any]:
    """Record `library` as complete (its name, size and hash, and `facts`); returns the record."""
    content = {**describe(library), **facts}
    atomic_write_json(record, content)
    return content


def read_record(record: Path) -> dict[str, Any] | None:
    """The record, or None where there is none or it is not one (an older urpe wrote only the
    library's name: such a build is checked again by building)."""
    try:
        content = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(content, dict) or not {"library", "bytes", "sha256"} <= content.keys():
        return None
    return content


def mismatch(record: dict[str, Any], library: Path) -> str | None:
    """Why `library` is not the file its record describes (None: it is)."""
    try:
        size = library.stat().st_size
    except OSError:
        return f"{library} is missing"
    if library.name != record["library"]:
        return f"{library.name} is not the recorded library {record['library']}"
    if size != record["bytes"]:
        return f"{library} has {size} bytes, its build wrote {record['bytes']} (damaged)"
    if file_sha256(library) != record["sha256"]:
        return f"{library} differs from the library its build wrote (damaged)"
    return None
