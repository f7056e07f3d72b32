"""Moved to `urpe.files` (the bottom layer, shared with the data caches); these names stay
importable from here."""

from ..files import (
    CorruptFileError,
    atomic_directory,
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    read_json,
    remove_stale_temporaries,
)

__all__ = [
    "CorruptFileError",
    "atomic_directory",
    "atomic_write",
    "atomic_write_json",
    "atomic_write_text",
    "read_json",
    "remove_stale_temporaries",
]
