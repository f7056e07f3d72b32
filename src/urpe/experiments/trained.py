"""Finding a trained model from what a user points at, for `urpe generate`, `predict` and
`evaluate`: a checkpoint directory (or a file in it), a run folder (`OUT/runs/<id>`, its newest
checkpoint), or a whole sweep folder (`OUT`, holding records/ and runs/): then the finished run
with the best validation result (lowest MAE or loss, highest accuracy), named in one line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cli_types import UsageError

# experiment -> (result key, True when higher is better)
BEST_BY = {"graph": ("val_mae", False), "lm": ("val_loss", False), "synthetic": ("accuracy", True)}


@dataclass
class Trained:
    checkpoint: Path  # the checkpoint directory
    config: dict[str, Any]  # its config.json
    model: Any  # what load_model returned (a bundle or a module)

    @property
    def run(self) -> dict[str, Any]:
        """The training run's config ({} for a model saved with `save_model` without one)."""
        return self.config.get("run") or {}

    @property
    def experiment(self) -> str | None:
        return self.run.get("experiment") or {"text": "lm", "molecules": "graph"}.get(
            (self.config.get("inputs") or {}).get("kind")
        )


def best_run(out: Path, experiment: str | None = None, argument: str = "RUN") -> tuple[Path, str]:
    """The run folder of the best finished run of a sweep folder, and a line saying which."""
    from .records import RecordStore

    problems: list[str] = []
    records = RecordStore(out).load_all(problems.append)
    candidates = []
    for record in records:
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
        raise UsageError(argument, f"{out}: no finished {what}run with a checkpoint under runs/")
    _, run_id, run_dir, key, value = min(candidates)
    note = f"using run {run_id} ({key} {value:.4g}, the best of {len(candidates)})"
    return run_dir, note


def find_trained(
    path: Path, experiment: str | None = None, say=None, argument: str = "RUN"
) -> Trained:
    """The trained model `path` points at (see the module docstring); UsageError if none."""
    from ..training.checkpoint import (
        CONFIG,
        CheckpointError,
        load_model,
        read_checkpoint_config,
        resolve_checkpoint,
    )

    path = Path(path)
    if not path.exists():
        raise UsageError(argument, f"{path}: no such file or folder")
    if (path / "records").is_dir() and not (path / CONFIG).exists():
        path, note = best_run(path, experiment, argument)
        (say or (lambda line: print(line, file=sys.stderr)))(note)
    try:
        directory = resolve_checkpoint(path)
        config = read_checkpoint_config(directory)
        model = load_model(directory)
    except (FileNotFoundError, CheckpointError, ValueError, TypeError) as error:
        raise UsageError(argument, str(error).splitlines()[0]) from None
    return Trained(directory, config, model)
