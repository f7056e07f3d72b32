"""A run's identity and its record: `RunSpec` (name + full config), `RecordStore` (one atomic
JSON per run, tensors beside it, a folder for its checkpoints). See `runner.py` for the contract.

A user's data file enters a run's config as a content digest; where it lies goes under
`config[LOCATIONS]`, which is stored with the record but is not part of the identity (a moved
file is the same data, an edited one is not).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..files import CorruptFileError, atomic_write, atomic_write_json, read_json
from ..training.sweeps import FILE_KINDS, LOCATIONS, dataset_labels  # noqa: F401 (re-exported)

RECORD_FORMAT = "urpe-record/2"


def canonical_json(config: Any) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)


def identity(config: dict) -> dict:
    """The part of a run config that decides its result: all of it but `LOCATIONS`."""
    return {k: v for k, v in config.items() if k != LOCATIONS}


def config_digest(config: dict) -> str:
    return hashlib.sha256(canonical_json(identity(config)).encode()).hexdigest()


def safe_name(name: str) -> str:
    """A run name usable as one file name: no folders, nothing a shell would mind."""
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "_", name).strip("._") or "run"


@dataclass(frozen=True)
class RunSpec:
    """One run: a readable `name`, its full resolved `config` (its identity) and its number of
    optimiser `steps` (for the progress bar)."""

    name: str
    config: dict
    steps: int = 1

    @property
    def id(self) -> str:
        return f"{safe_name(self.name)}-{config_digest(self.config)[:10]}"


@dataclass
class RunResult:
    """What `run_one` returns: `record`, a JSON-ready dict of what the run measured, and optional
    `tensors` (e.g. learned matrices) saved beside the record."""

    record: dict
    tensors: dict[str, Any] | None = None


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
        if canonical_json(identity(record["config"])) != canonical_json(identity(spec.config)):
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

            tensors = {
                k: v.detach().cpu().contiguous() for k, v in result.tensors.items() if v is not None
            }
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
