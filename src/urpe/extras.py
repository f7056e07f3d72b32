"""Optional dependencies: which extra of `pip install 'urpe[...]'` brings each module, and a check
that names every missing one at once, so a user installs once instead of once per module.

    require("safetensors", "rdkit", "scipy")   # MissingModules: pip install 'urpe[graph,train]'

Standard library only: a command checks before importing anything heavy.
"""

from __future__ import annotations

import importlib.util

# Top-level module -> the extra that installs it.
EXTRAS = {
    "lightning": "train",
    "pytorch_lightning": "train",
    "torchmetrics": "train",
    "safetensors": "train",
    "tqdm": "train",
    "matplotlib": "train",
    "tensorboard": "train",
    "tokenizers": "lm",
    "x_transformers": "bench",
    "torch_geometric": "graph",
    "rdkit": "graph",
    "scipy": "graph",
    "transformers": "hf",
    "peft": "peft",
}


def install_line(modules: list[str]) -> str | None:
    """The pip command that installs `modules` (top-level names); None if one is no extra's."""
    extras = [EXTRAS.get(name.split(".")[0]) for name in modules]
    if not extras or None in extras:
        return None
    return f"pip install 'urpe[{','.join(sorted(set(extras)))}]'"  # type: ignore[arg-type]


def what_to_install(error: ModuleNotFoundError) -> str | None:
    """The line telling a user which missing modules a command needs and the pip command that
    installs them all; None when a module is no extra's (a real bug, not an install)."""
    modules = getattr(error, "modules", None) or [error.name or ""]  # MissingModules: several
    fix = install_line(modules)
    if fix is None:
        return None
    if len(modules) == 1:
        return f"this command needs the module {modules[0]!r}, which is not installed: {fix}"
    names = ", ".join(map(repr, modules))
    return f"this command needs the modules {names}, which are not installed: {fix}"


class MissingModules(ModuleNotFoundError):
    """Several modules a command needs are not installed; `modules` names them all."""

    def __init__(self, modules: list[str]):
        self.modules = modules
        super().__init__(f"no modules named {', '.join(map(repr, modules))}", name=modules[0])


def require(*modules: str) -> None:
    """Raise `MissingModules` naming every one of `modules` that is not installed (found
    without importing any of them)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingModules(missing)
