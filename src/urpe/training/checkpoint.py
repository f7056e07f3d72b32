"""Checkpoints without pickled code: weights as safetensors, configuration as JSON, and the
training state (optimiser, scheduler, loop counters, RNG states) beside them, loaded with
`torch.load(weights_only=True)`.

A checkpoint is one directory, written whole and renamed into place (see `files.py`), so a
directory named `step-NNNNNNNN` is always complete:

    checkpoints/step-00000400/
        model.safetensors     every tensor of the training module's state_dict (the wrapped
                              model's under the prefix named in config.json)
        config.json           {"format", "step", "model": {"class", "config"}, "objective",
                              "run", "inputs", "state_dict_prefix"}: enough to rebuild the
                              model, and how raw data becomes its input (`inputs.py`)
        training_state.pt     Lightning's checkpoint dict minus the weights: optimiser and
                              scheduler states, loop progress, callback states (RNG states)
        tokenizer.json        a text model's tokenizer, when "inputs" names it

Lightning reads and writes checkpoints through `SafeCheckpointIO`, so `Trainer.fit(ckpt_path=)`
resumes from these directories, and nothing urpe writes or reads is an arbitrary pickle:
`torch.load(..., weights_only=True)` only rebuilds tensors and plain containers, and refuses
anything else with an error (it never runs the file's code). `load_module(path)` rebuilds a
trained model from config.json + model.safetensors alone; `urpe.training.bundles.load_model`
adds its input encoding.

A model can be saved when urpe can describe how to build it: either it has a `config`
attribute that is a `TransformerConfig` and is constructed as `cls(config)`
(`TransformerEncoder`, `TransformerDecoder`), or it defines `model_config() -> dict` (JSON-ready)
and a classmethod `from_model_config(dict)`. Only classes inside the `urpe` package are rebuilt
(a config.json cannot make urpe import arbitrary code).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import random
import re
import shutil
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..files import current_umask
from .files import CorruptFileError, atomic_directory, read_json
from .inputs import InputEncoding, encoding_to_save
from .sweeps import best_run

FORMAT = "urpe-checkpoint/1"
WEIGHTS, CONFIG, STATE = "model.safetensors", "config.json", "training_state.pt"
STEP_DIRECTORY = re.compile(r"^step-(\d{8,})$")


class CheckpointError(CorruptFileError):
    """A checkpoint (or a file where one is expected) that cannot be loaded safely."""


# ---------------------------------------------------------------------------------------------
# Weights: safetensors, with tied parameters stored once


def save_weights(state_dict: dict[str, Tensor], path: str | Path) -> None:
    """Write a state dict as safetensors. Tensors that are the same tensor (tied embeddings) are
    stored once and recorded as aliases in the file's metadata; views that merely overlap are
    copied, since safetensors stores each tensor in its own bytes."""
    from safetensors.torch import save_file  # here: finding a checkpoint needs no safetensors

    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, value in state_dict.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"state_dict entry {name!r} is a {type(value).__name__}, not a tensor")
        value = value.detach()
        storage = value.untyped_storage().data_ptr()
        identity = (
            storage,
            value.storage_offset(),
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
            value.device,
        )
        if value.numel() and identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name
        copy = value.cpu()
        if storage in storages:
            copy = copy.clone()  # never hand safetensors two names on one storage
        storages.add(storage)
        tensors[name] = copy.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt", "aliases": json.dumps(aliases)})
    os.chmod(path, 0o666 & ~current_umask())  # safetensors makes it private (0600): as open would


def load_weights(path: str | Path, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Read `save_weights`' file back into a state dict (aliases restored)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path), device=str(device))
        with open(path, "rb") as handle:  # the metadata sits in the JSON header
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(path, f"not a safetensors file ({error})") from None
    aliases = json.loads(header.get("__metadata__", {}).get("aliases", "{}"))
    for alias, name in aliases.items():
        tensors[alias] = tensors[name]
    return tensors


def load_training_state(path: str | Path) -> dict[str, Any]:
    """`torch.load(path, weights_only=True)`: tensors and plain containers only. A file that
    would need any other object (a crafted pickle, an old full-pickle checkpoint) is refused
    with `CheckpointError`; none of its code runs."""
    path = Path(path)
    try:
        with warnings.catch_warnings():  # its protocol notice would precede our error line
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()
        detail = next((line for line in first if "Unsupported" in line or "global" in line), "")
        raise CheckpointError(
            path,
            "refused to load: it needs objects other than tensors and plain containers"
            + (f" ({detail.strip()})" if detail else ""),
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as error:
        raise CheckpointError(path, f"not a training state file ({error})") from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"expected a dict, found {type(state).__name__}")
    return state


# ---------------------------------------------------------------------------------------------
# Describing and rebuilding a model


def model_spec(model: nn.Module) -> dict[str, Any]:
    """{"class": "module:QualName", "config": {...}}: how `build_model` makes `model` again."""
    cls = type(model)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if hasattr(model, "model_config") and hasattr(cls, "from_model_config"):
        return {"class": name, "config": model.model_config()}
    # Imported here: a Graphormer is saved and loaded without urpe.models (language models,
    # context parallelism), a tenth of `urpe predict`'s start-up besides torch.
    from ..models import TransformerConfig

    config = getattr(model, "config", None)
    if isinstance(config, TransformerConfig):
        return {"class": name, "transformer_config": config.to_dict()}
    raise TypeError(
        f"cannot describe {cls.__qualname__} for a checkpoint: give it model_config() and "
        "from_model_config(), or a TransformerConfig `config` attribute"
    )


def build_model(spec: dict[str, Any]) -> nn.Module:
    """Instantiate the class a `model_spec` names, with fresh weights."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class"), str):
        raise ValueError(f"a model spec needs a 'class' entry, got {spec!r}")
    module_name, _, qualname = spec["class"].partition(":")
    if not (module_name == "urpe" or module_name.startswith("urpe.")) or not qualname:
        raise ValueError(f"refusing to build {spec['class']!r}: only classes in urpe are built")
    cls: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{spec['class']} is not an nn.Module")
    if "transformer_config" in spec:
        from ..models import TransformerConfig

        return cls(TransformerConfig.from_dict(spec["transformer_config"]))
    return cls.from_model_config(spec["config"])


# ---------------------------------------------------------------------------------------------
# Finding and reading checkpoint directories


def checkpoint_step(directory: Path) -> int | None:
    match = STEP_DIRECTORY.match(directory.name)
    return int(match.group(1)) if match else None


def step_directory(checkpoints: str | Path, step: int) -> Path:
    return Path(checkpoints) / f"step-{step:08d}"


def latest_checkpoint(checkpoints: str | Path) -> Path | None:
    """The complete checkpoint directory with the highest step under `checkpoints`, if any."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return None
    found = [
        (checkpoint_step(d), d)
        for d in checkpoints.iterdir()
        if d.is_dir() and checkpoint_step(d) is not None
    ]
    return max(found)[1] if found else None


def resolve_checkpoint(
    path: str | Path,
    experiment: str | None = None,
    say: Callable[[str, int], None] | None = None,
) -> Path:
    """A checkpoint directory from any of: the directory itself, a file in it, the
    `checkpoints/` folder (its latest), a run folder holding `checkpoints/`, or a sweep folder:
    its best run (of `experiment`, if given; see `urpe.training.sweeps`), which is named by
    calling `say(line, number of runs it was chosen from)`."""
    path = Path(path)
    if (path / "records").is_dir() and not (path / CONFIG).exists():  # a sweep's OUT
        path, note, runs = best_run(path, experiment)
        if say is not None:
            say(note, runs)
    if path.is_file() and path.name in (WEIGHTS, CONFIG, STATE):
        path = path.parent
    if (path / CONFIG).exists() or (path / WEIGHTS).exists():
        return path
    for candidate in (path, path / "checkpoints"):
        latest = latest_checkpoint(candidate)
        if latest is not None:
            return latest
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    raise CheckpointError(path, "no checkpoint here (no config.json + model.safetensors)")


def read_checkpoint_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint, checked for the format."""
    directory = resolve_checkpoint(path)
    try:
        config = read_json(directory / CONFIG)
    except FileNotFoundError:
        raise CheckpointError(directory, f"missing {CONFIG}") from None
    except CorruptFileError as error:
        raise CheckpointError(error.path, error.reason) from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise CheckpointError(directory / CONFIG, f"not a {FORMAT} config")
    return config


def load_module(
    path: str | Path, device: str | torch.device = "cpu", *, config: dict[str, Any] | None = None
) -> nn.Module:
    """The checkpoint's model as a bare `nn.Module` in eval mode (no tokenizer or featuriser
    attached; `urpe.training.bundles.load_model` attaches them). `config`: its config.json as
    `read_checkpoint_config` returned it, where the caller has read it already."""
    directory = resolve_checkpoint(path)
    config = read_checkpoint_config(directory) if config is None else config
    model = build_model(config["model"])
    prefix = config.get("state_dict_prefix", "")
    weights = load_weights(directory / WEIGHTS, device)
    state = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        message = str(error).splitlines()[0]
        raise CheckpointError(
            directory / WEIGHTS, f"weights do not fit the model ({message})"
        ) from None
    return model.to(device).eval()


def save_model(
    model: Any,
    path: str | Path,
    *,
    tokenizer: Any = None,
    inputs: InputEncoding | dict[str, Any] | None = None,
    run: dict[str, Any] | None = None,
) -> Path:
    """Write `model` as a checkpoint directory that `load_model`, `urpe generate`, `urpe
    predict` and `urpe evaluate` read: model.safetensors + config.json (+ tokenizer.json).

    Args:
        model: a model urpe can describe (see the module docstring), or a bundle from
            `load_model` (its input encoding is saved with it).
        path: the directory to write (replaced whole, atomically).
        tokenizer: a `urpe.data.text` tokenizer: the model reads text; saved as tokenizer.json.
        inputs: how raw inputs become the model's (`urpe.training.inputs`): an encoding
            (`MoleculeInputs(MoleculeFeaturizer("zinc"), "gap", "eV")`), or its record as JSON
            ({"kind": "molecules", "featurizer": {"features": "zinc"}, "target": NAME, "unit":
            TEXT}; the older {"kind": "molecules", "features": "zinc", ...} reads the same);
            with a tokenizer, {"metric": "bpc" or "perplexity"} (default: by token kind).
        run: any JSON about how the model was made (kept in config.json).
    """
    current = None
    if not isinstance(model, nn.Module):  # a bundle: its module, and what the module reads
        model, current = model.model, model.inputs
    encoding = encoding_to_save(current, tokenizer, inputs)
    files = encoding.files()
    config = {
        "format": FORMAT,
        "step": 0,
        "model": model_spec(model),
        "state_dict_prefix": "",
        "objective": None,
        "run": dict(run or {}),
        "inputs": encoding.record(),
    }
    text = json.dumps(config, indent=1, allow_nan=False) + "\n"

    def fill(temporary: Path) -> None:
        save_weights(model.state_dict(), temporary / WEIGHTS)
        (temporary / CONFIG).write_text(text)
        write_files(temporary, files)

    return atomic_directory(Path(path), fill)


def write_files(directory: Path, files: dict[str, str]) -> None:
    """The files of an input encoding (tokenizer.json), beside the weights."""
    for name, text in files.items():
        if Path(name).name != name or name in (WEIGHTS, CONFIG, STATE):
            raise ValueError(f"an input encoding cannot write {name!r} into a checkpoint")
        (directory / name).write_text(text)


# ---------------------------------------------------------------------------------------------
# RNG states


def capture_rng_states() -> dict[str, Any]:
    """torch (CPU and every CUDA device), Python's `random` and NumPy's global states, as
    tensors and plain containers (loadable with weights_only=True)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, position, has_gauss, gauss = np.random.get_state()
        states["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), position, has_gauss, gauss)
    except ImportError:
        pass
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        try:
            import numpy as np

            kind, keys, position, has_gauss, gauss = states["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), position, has_gauss, gauss))
        except ImportError:
            pass


# ---------------------------------------------------------------------------------------------
# Writing: one function for Lightning's checkpoint dict


def write_checkpoint(checkpoint: dict[str, Any], directory: str | Path, keep: int = 1) -> Path:
    """Write Lightning's checkpoint dict as a urpe checkpoint directory, atomically, then delete
    all but the newest `keep` step directories beside it.

    `checkpoint["urpe"]` (added by the objective's `on_save_checkpoint`) becomes config.json,
    its "files" (the input encoding's, a tokenizer.json) files beside it;
    `checkpoint["state_dict"]` becomes model.safetensors; the rest becomes training_state.pt.
    """
    directory = Path(directory)
    checkpoint = dict(checkpoint)
    weights = checkpoint.pop("state_dict")
    described = dict(checkpoint.pop("urpe", None) or {})
    files = described.pop("files", None) or {}
    step = int(checkpoint.get("global_step", 0))
    config = {"format": FORMAT, "step": step, **described}

    def fill(temporary: Path) -> None:
        save_weights(weights, temporary / WEIGHTS)
        (temporary / CONFIG).write_text(json.dumps(config, indent=1, allow_nan=False) + "\n")
        write_files(temporary, files)
        torch.save(checkpoint, temporary / STATE)

    atomic_directory(directory, fill)
    if keep > 0:
        parent = directory.parent
        steps = sorted(
            (checkpoint_step(d), d)
            for d in parent.iterdir()
            if d.is_dir() and checkpoint_step(d) is not None
        )
        for _, old in steps[:-keep]:
            if old != directory:
                shutil.rmtree(old, ignore_errors=True)
    return directory


def read_checkpoint(directory: str | Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The inverse of `write_checkpoint`: Lightning's checkpoint dict (weights_only loads)."""
    directory = Path(directory)
    for name in (WEIGHTS, CONFIG, STATE):
        if not (directory / name).is_file():
            raise CheckpointError(directory, f"incomplete checkpoint: {name} missing")
    read_checkpoint_config(directory)
    checkpoint = load_training_state(directory / STATE)
    checkpoint["state_dict"] = load_weights(directory / WEIGHTS, device)
    return checkpoint
