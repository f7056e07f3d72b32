"""What keeps a gated model gated after `add_urpe`: its own `set_attn_implementation` and
`save_pretrained`, installed on the model object (the class is untouched).

- `set_attn_implementation("eager" | "sdpa")` switches the base under the gates ("urpe_eager",
  "urpe_sdpa"), so the gates stay in force; any other implementation (flash, flex) is refused in
  one line: transformers' own method would route attention around the gates, silently.
- `save_pretrained` also writes a README.md (unless the folder has one) saying that the folder
  needs `urpe.hf.from_pretrained`: transformers' `from_pretrained` alone drops the gates (it lists
  them as unexpected keys).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from torch import nn

from .attention import base_of, implementation_name
from .options import BASE_IMPLEMENTATIONS

CARD_MARK = "<!-- written by urpe.hf -->"


def load_note(model: nn.Module) -> str:
    """One sentence on how to load the folder a gated model is saved to."""
    cls = type(model).__name__
    return (
        f"URPE gates (the urpe_gate and urpe_forget tensors) are part of this model: load it with "
        f"urpe.hf.from_pretrained(folder, transformers.{cls}) (pip install 'urpe[hf]'); "
        f"{cls}.from_pretrained alone gives the model without them (transformers lists them as "
        "unexpected keys)"
    )


def model_card(model: nn.Module) -> str:
    cls = type(model).__name__
    return f"""---
library_name: transformers
tags:
- urpe
---
{CARD_MARK}
# {cls} with URPE gates

This folder holds a transformers `{cls}` whose self-attention modules carry URPE gates C
(parameters named `*.urpe_gate.*`, and `*.urpe_forget.*` for FoX decays; their layout is the
`urpe` entry of config.json). Load it with urpe, which rebuilds the gates and reads their values:

```python
import transformers
import urpe.hf  # pip install 'urpe[hf]'

model = urpe.hf.from_pretrained(folder, transformers.{cls})
```

`{cls}.from_pretrained(folder)` (or any `AutoModel*` class) alone loads the model **without** its
gates: transformers lists the `urpe_gate` tensors as unexpected keys and the attention runs as if
C = 1.
"""


def bypass_error(model_class: str, request, remedy: str) -> ValueError:
    return ValueError(
        f"{model_class} has URPE gates, which run on 'eager' or 'sdpa' attention only; "
        f"{request!r} would bypass them: {remedy}"
    )


def _translated(model: nn.Module, request):
    """`request` with "eager"/"sdpa" replaced by their urpe_ names (dicts: every value)."""
    if isinstance(request, dict):
        return {key: _translated(model, value) for key, value in request.items()}
    if request in BASE_IMPLEMENTATIONS:
        return implementation_name(request)
    if base_of(request) in BASE_IMPLEMENTATIONS:
        return request
    raise bypass_error(
        type(model).__name__, request, "call set_attn_implementation('sdpa') or ('eager')"
    )


def route_through_urpe(model: nn.Module) -> None:
    """Every config a module reads gets the urpe_ name of its own base: transformers < 5.20
    leaves copied sub-configs (T5's encoder and decoder stacks) on their own implementation."""
    for module in model.modules():
        config = getattr(module, "config", None)
        own = getattr(config, "_attn_implementation", None)
        if own in BASE_IMPLEMENTATIONS:
            config._attn_implementation = implementation_name(own)


def _set_attn_implementation(model: nn.Module, attn_implementation, *args, **kwargs):
    request = _translated(model, attn_implementation)
    type(model).set_attn_implementation(model, request, *args, **kwargs)
    route_through_urpe(model)
    base = base_of(model.config._attn_implementation)
    if base in BASE_IMPLEMENTATIONS and isinstance(getattr(model.config, "urpe", None), dict):
        model.config.urpe = {**model.config.urpe, "attn_implementation": base}


def _save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *args, **kwargs):
    if kwargs.get("is_main_process", True):
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        card = folder / "README.md"
        if not card.exists() or CARD_MARK in card.read_text(errors="replace"):
            card.write_text(model_card(model))
    return type(model).save_pretrained(model, save_directory, *args, **kwargs)


def install(model: nn.Module) -> None:
    """Give the model (and the transformers models inside it) the two methods above."""
    for module in model.modules():
        if callable(getattr(type(module), "set_attn_implementation", None)):
            module.set_attn_implementation = functools.partial(_set_attn_implementation, module)
        if callable(getattr(type(module), "save_pretrained", None)):
            module.save_pretrained = functools.partial(_save_pretrained, module)
