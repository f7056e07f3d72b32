"""A sweep folder, and the run a loader takes from it.

`urpe reproduce ... --out OUT` writes one record per finished run (`OUT/records/<id>.json`:
{"id", "config", "result", ...}) and its checkpoints (`OUT/runs/<id>/checkpoints/`). Given OUT
where a model is expected, `urpe.load_model`, `urpe predict`, `evaluate` and `generate` all take
the same run, chosen here: among the finished runs with a checkpoint (of the command's
experiment, when it names one), the best by validation result: the lowest MAE (graph) or loss
(lm), the highest accuracy (synthetic).

Standard library only (and `urpe.files`): the commands resolve a folder before loading torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..files import CorruptFileError, read_json

# experiment -> (result key, True when higher is better)
BEST_BY = {"graph": ("val_mae", False), "lm": ("val_loss", False), "synthetic": ("accuracy", True)}


def _records(out: Path) -> Iterator[dict[str, Any]]:
    """The sweep's readable records; a damaged one is skipped here (`--resume` names it)."""
    for path in sorted((out / "records").glob("*.json")):
        try:
            record = read_json(path)
        except (CorruptFileError, OSError):
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("id"), str)
            and all(isinstance(record.get(key), dict) for key in ("config", "result"))
        ):
            yield record


def best_run(out: str | Path, experiment: str | None = None) -> tuple[Path, str, int]:
    """(run folder, a line naming it, how many runs it was chosen from) for the best finished
    run of the sweep folder `out`; FileNotFoundError when it holds none with a checkpoint."""
    out = Path(out)
    candidates = []
    for record in _records(out):
        kind = record["config"].get("experiment")
        if experiment is not None and kind != experiment:
            continue
        key, higher = BEST_BY.get(kind, (None, False))
        value = record["result"].get(key) if key else None
        run_dir = out / "runs" / record["id"]
        if isinstance(value, int | float) and (run_dir / "checkpoints").is_dir():
            candidates.append((-value if higher else value, record["id"], run_dir, key, value))
    if not candidates:
        what = f"{experiment} " if experiment else ""
        raise FileNotFoundError(f"{out}: no finished {what}run with a checkpoint under runs/")
    _, run_id, run_dir, key, value = min(candidates)
    note = f"using run {run_id} ({key} {value:.4g}, the best of {len(candidates)})"
    return run_dir, note, len(candidates)
