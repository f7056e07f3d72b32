"""`from_pretrained`: load a model saved after `add_urpe`, gates included.

`model.save_pretrained(out)` already writes the gates beside the weights (they are ordinary
parameters) and the options in config.json (`config.urpe`). Loading goes through the model class's
own `from_pretrained` (dtype, device_map, ... as usual) with the gate keys marked as expected
extras, then rebuilds the gates from `config.urpe` and reads their values from the safetensors
files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from .discovery import select_layers
from .guards import bypass_error
from .options import BASE_IMPLEMENTATIONS, UrpeOptions
from .patch import attach

# Parameters add_urpe adds: gates C and decays (FoX forget gates).
GATE_KEYS = r"urpe_(gate|forget)\."


def _concrete_class(model_class: type, config) -> type:
    """The class an Auto* class would instantiate for this config (or model_class itself)."""
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        return model_class
    try:
        return mapping[type(config)]
    except KeyError:
        name = type(config).__name__
        raise ValueError(f"{model_class.__name__} has no model for {name}") from None


@contextmanager
def _gate_keys_expected(cls: type):
    # transformers would report the gate tensors as unexpected keys (the fresh model has no gates
    # yet); they are loaded right after, so tell it to expect them for this one call.
    saved = cls.__dict__.get("_keys_to_ignore_on_load_unexpected", None)
    had = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    cls._keys_to_ignore_on_load_unexpected = list(cls._keys_to_ignore_on_load_unexpected or []) + [
        GATE_KEYS
    ]
    try:
        yield
    finally:
        if had:
            cls._keys_to_ignore_on_load_unexpected = saved
        else:
            del cls._keys_to_ignore_on_load_unexpected


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path} has no model.safetensors (or index): urpe.hf reads the gates from safetensors "
        "files, which save_pretrained writes by default"
    )


def _saved_key_renaming(model: nn.Module) -> Callable[[str], str]:
    """How transformers renames a saved key into one of the model's own names when it loads.

    Some families are saved under their original checkpoint's names: EXAONE runs as a Llama
    (model.layers.N.self_attn) but `save_pretrained` writes transformer.h.N.attn.attention,
    its gates included. The renamings are the model's conversion mapping; where this
    transformers has none, keys are taken as they are."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # (transformers before its conversion mappings)
        return lambda key: key
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]

    def renamed(key: str) -> str:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        return key

    return renamed


def load_gates(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy the gate and decay tensors saved under `path` into the model's (every one must be
    found).

    Keys are matched as saved or as transformers renames them on loading (a family saved under
    its original checkpoint's names), exactly or across the base-model prefix (a
    `LlamaForCausalLM` checkpoint into a `LlamaModel` and back)."""
    wanted = {n: p for n, p in model.state_dict().items() if re.search(GATE_KEYS, n)}
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamed = _saved_key_renaming(model)
    found = {}
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if not re.search(GATE_KEYS, key):
                    continue
                for saved in dict.fromkeys((key, renamed(key))):
                    names = (saved, saved.removeprefix(prefix + "."), f"{prefix}.{saved}")
                    name = next((n for n in names if n in wanted), None)
                    if name is not None:
                        found[name] = handle.get_tensor(key)
                        break
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(
            f"{path} holds no saved values for {len(missing)} URPE gate(s), e.g. {missing[0]}: "
            "was it saved after add_urpe with the same options?"
        )
    with torch.no_grad():
        for name, tensor in found.items():
            wanted[name].copy_(tensor)


def from_pretrained(path: str | os.PathLike, model_class: type, **kwargs) -> nn.Module:
    """Load `path` (a folder written by `save_pretrained` after `add_urpe`) with `model_class`
    (e.g. `AutoModelForCausalLM`), rebuild its URPE gates and load their values.

    Keyword arguments go to `model_class.from_pretrained`; `attn_implementation` defaults to the
    one the gates were added on and must be "sdpa" or "eager". A folder without `config.urpe`
    raises ValueError (use `add_urpe` on a plain model).
    """
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    entry = getattr(config, "urpe", None)
    if entry is None:
        raise ValueError(
            f"{path}: config.json has no 'urpe' entry, so it was not saved after "
            "urpe.hf.add_urpe; load it normally and call add_urpe"
        )
    options = UrpeOptions.from_dict(entry)
    requested = kwargs.setdefault("attn_implementation", options.attn_implementation)
    cls = _concrete_class(model_class, config)
    if requested not in BASE_IMPLEMENTATIONS:
        raise bypass_error(
            cls.__name__, requested, "load it with attn_implementation='sdpa' or 'eager'"
        )
    with _gate_keys_expected(cls):
        model = cls.from_pretrained(path, config=config, **kwargs)
    base = model.config._attn_implementation
    options = UrpeOptions(**{**options.__dict__, "attn_implementation": base})
    chosen, _ = select_layers(model, options.layers)
    attach(model, options, chosen)
    load_gates(model, path)
    return model
