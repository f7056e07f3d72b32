"""Finding a trained model from what a user points at, for `urpe generate`, `predict` and
`evaluate`: a checkpoint directory (or a file in it), a run folder (`OUT/runs/<id>`, its newest
checkpoint), or a whole sweep folder (`OUT`, holding records/ and runs/): then the finished run
with the best validation result (lowest MAE or loss, highest accuracy), named in one line; the
same run `urpe.load_model` takes (`urpe.training.sweeps`). Only runs of the same data compete: a
folder with runs on different data (an edited file trained again under --resume, several target
columns) lists them and asks for one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cli_types import UsageError
from ..extras import require
from ..progress import on_terminal
from ..startup import loading

# Modules a trained model needs: to load its weights, and by what it reads (molecules: RDKit,
# and SciPy, which searches the shortest paths of molecules over 64 atoms; text needs the
# `tokenizers` package only for BPE or word tokens, which the tokenizer itself asks for).
LOADING_NEEDS = ("safetensors",)
READING_NEEDS = {"molecules": ("rdkit", "scipy")}


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
    def reads(self) -> str:
        """What the model reads, as its checkpoint records it: "text", "molecules", or
        "tensors" (`urpe.training.inputs`)."""
        from ..training.inputs import input_record

        return input_record(self.config)["kind"]


def find_trained(
    path: Path, experiment: str | None = None, say=None, argument: str = "RUN"
) -> Trained:
    """The trained model `path` points at (see the module docstring); UsageError if none."""
    path = Path(path)
    if not path.exists():
        raise UsageError(argument, f"{path}: no such file or folder")
    say = say or (lambda line: print(line, file=sys.stderr))
    # Importing PyTorch takes seconds: on a terminal, say so at once instead of leaving it
    # blank. Not in a log or a pipe, where the output stays as it was.
    if on_terminal():
        say(f"loading {path} (importing PyTorch)")
    with loading():  # torch, urpe and the model: no garbage collections (`urpe.startup`)
        from ..training.checkpoint import (
            CheckpointError,
            read_checkpoint_config,
            resolve_checkpoint,
        )
        from ..training.inputs import input_record

        try:
            directory = resolve_checkpoint(path, experiment, lambda note, runs: say(note))
            config = read_checkpoint_config(directory)
            # Every module the model needs, named in one line when some are missing.
            require(*LOADING_NEEDS, *READING_NEEDS.get(input_record(config)["kind"], ()))
            from ..training.bundles import load_model

            model = load_model(directory, config=config)  # read once, passed down
        except (FileNotFoundError, CheckpointError, ValueError, TypeError) as error:
            raise UsageError(argument, str(error).splitlines()[0]) from None
    return Trained(directory, config, model)


def best_run(out: Path, experiment: str | None = None, argument: str = "RUN") -> tuple[Path, str]:
    """`urpe.training.sweeps.best_run` for a command: (run folder, the line naming it), or a
    UsageError naming `argument` (no finished run; runs on different data, listed)."""
    from ..training.sweeps import best_run as choose

    try:
        run_dir, note, _ = choose(out, experiment)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(argument, str(error)) from None
    return run_dir, note
