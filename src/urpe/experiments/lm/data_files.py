"""The user's text files in `urpe reproduce lm`: one canonical spec, and identity by content.

The command calls two hooks:

- `canonical_dataset(spec)` turns "PATH" and "name:PATH" into "name:ABSOLUTE_PATH" (a bare path
  is `text:`), so run names never carry a path and every run writes inside --out;
- `locate_data(specs)` puts each file-backed run's data into its identity as SHA-256 digests
  (`config["data_sha256"]`), shows it as "text:sha256-<first 12 hex digits>" in
  `config["dataset"]` (a file name would make a renamed file another run), and keeps the
  absolute spec under `config["locations"]` (stored, not part of the identity). An edited file
  then trains again under --resume; a moved one is recognised.

`dataset_spec(config)` is what a run loads: the located spec, else `config["dataset"]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..records import LOCATIONS, RunSpec


def canonical_dataset(spec: str) -> str:
    """ "name", "name:PATH" or "PATH" -> the same with an absolute path (DatasetError if bad)."""
    from ...data.text import CORPORA, parse_spec

    name, path = parse_spec(spec)
    if path is None or not CORPORA[name].needs_path:
        return spec
    return f"{name}:{Path(path).expanduser().resolve()}"


def locate_data(specs: list[RunSpec]) -> list[RunSpec]:
    """The specs with their data files identified by content (see the module docstring)."""
    from ...data.text import CORPORA, parse_spec
    from ...files import file_sha256

    digests: dict[str, list[str]] = {}
    out = []
    for spec in specs:
        name, path = parse_spec(spec.config["dataset"])
        if path is None or not CORPORA[name].needs_path:
            out.append(spec)
            continue
        key = spec.config["dataset"]
        if key not in digests:
            digests[key] = [file_sha256(f) for f in CORPORA[name].locate(path)]
        # Shown by content, not by name: a renamed file is the same run.
        config = {
            **spec.config,
            "dataset": f"{name}:sha256-{digests[key][0][:12]}",
            "data_sha256": digests[key],
            LOCATIONS: {"dataset": key},
        }
        out.append(RunSpec(spec.name, config, spec.steps))
    return out


def dataset_spec(config: dict[str, Any]) -> str:
    return config.get(LOCATIONS, {}).get("dataset", config["dataset"])
