"""The model's building blocks as flags, with their choices read from the registries:

    --normalization  urpe.kernels.NORMALIZATIONS     (register_normalization)
    --position       urpe.models.POSITIONS           (urpe.encodings.register_position)
    --gate           urpe.models.GATES, or none      (urpe.encodings.register_gate)
    --mixer          urpe.models.MIXERS              (every layer; attention: the default)
    --backend        urpe.kernels.BACKENDS, or auto  (the attention kernel)

The choices are read when the parser is built, so a name registered before `urpe.cli.main`
runs (in a script that then calls it) is accepted with no other edit. Until a registry's module
has been imported nothing can have been registered in it, so the parser offers its built-in
names, listed here, without importing torch (`--help` starts at once); tests/test_cli_startup.py
checks that these lists are what the registries hold. Each flag, when given, sets its field of
every run's `TransformerConfig`, after the variant's own fields; left out, a run's config (its
identity) is what it was without these flags. Registrations made in a script reach spawned
workers (--jobs > 1) when they run at the script's top level: spawn re-imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .experiment import Option, Preset

if TYPE_CHECKING:
    from ..encodings import EncodingSpec
    from ..models import TransformerConfig

# What each registry holds when nothing else is registered: (the module that holds the registry,
# the names the flag offers). Encodings read from graph relations are left out: they cannot run
# on token sequences.
BUILT_IN = {
    "normalization": ("urpe.kernels.normalization", ("softmax", "exp", "l2", "relu2")),
    "position": (
        "urpe.encodings.registry",
        (
            "none",
            "rpe",
            "t5",
            "alibi",
            "kerple-log",
            "kerple-power",
            "fire",
            "fox",
            "rope",
            "shaw",
            "txl",
        ),
    ),
    "gate": ("urpe.encodings.registry", ("none", "toeplitz", "t5")),
    "mixer": ("urpe.nn.mixers", ("attention", "bilinear", "conv")),
    "backend": (
        "urpe.kernels.backends",
        ("auto", "reference", "sdpa", "blockwise", "triton", "flex", "cpp"),
    ),
}


def _registered(flag: str, read: Callable[[], list[str]]) -> Callable[[], list[str]]:
    """The flag's choices: the registry's names once its module is loaded, else the built-ins."""
    module, names = BUILT_IN[flag]
    return lambda: read() if module in sys.modules else list(names)


def _normalizations() -> list[str]:
    from ..kernels import NORMALIZATIONS

    return list(NORMALIZATIONS)


def _sequence_names(registry_names, registry) -> list[str]:
    # Encodings read from graph relations cannot run on token sequences.
    return [
        n
        for n in registry_names
        if n is not None and not getattr(registry.get(n), "uses_relation", False)
    ]


def _positions() -> list[str]:
    from ..encodings import POSITION_REGISTRY
    from ..models import POSITIONS

    return _sequence_names(POSITIONS, POSITION_REGISTRY)


def _gates() -> list[str]:
    from ..encodings import GATE_REGISTRY
    from ..models import GATES

    return ["none", *_sequence_names(GATES, GATE_REGISTRY)]


def _mixers() -> list[str]:
    from ..models import MIXERS

    return list(MIXERS)


def _backends() -> list[str]:
    from ..kernels import BACKENDS

    return ["auto", *BACKENDS]


# flag -> the registry's names as the flag offers them (read with the registry imported)
REGISTERED = {
    "normalization": _normalizations,
    "position": _positions,
    "gate": _gates,
    "mixer": _mixers,
    "backend": _backends,
}
_choices = {flag: _registered(flag, read) for flag, read in REGISTERED.items()}


def _backend(name: str) -> str:
    """A backend's name as given, or today's for a renamed one ("fused": "blockwise")."""
    from ..kernels.backends import current_backend_name

    return current_backend_name(name)


BACKEND = Option(
    ("--backend",),
    "backend",
    "attention kernel (default: auto, the fastest that applies)",
    type=_backend,
    choices=_choices["backend"],
)
MODEL_OPTIONS = (
    Option(
        ("--normalization",),
        "normalization",
        "attention normalisation of every run (default: each variant's own)",
        choices=_choices["normalization"],
    ),
    Option(
        ("--position",),
        "position",
        "relative position encoding of every run, replacing "
        "the variant's (default: each variant's own)",
        choices=_choices["position"],
    ),
    Option(
        ("--gate",),
        "gate",
        "URPE gate of every run, replacing the variant's; none: no gate "
        "(default: each variant's own)",
        choices=_choices["gate"],
    ),
    Option(
        ("--mixer",),
        "mixer",
        "token mixer of every layer (default: attention)",
        choices=_choices["mixer"],
    ),
    BACKEND,
)


@dataclass(frozen=True, kw_only=True)
class ModelChoices(Preset):
    """Preset fields the model flags set; None: the variant decides."""

    normalization: str | None = None
    position: str | None = None
    gate: str | None = None
    mixer: str | None = None
    backend: str | None = None


def _switched(spec: EncodingSpec | None, name: str | None, registry) -> EncodingSpec | None:
    """The encoding `name` with the options of `spec` that it also declares (a variant's gate
    init carries over to the gate a flag chooses, as its flat field once did)."""
    from ..encodings import EncodingSpec

    if name is None:
        return None
    declared = registry[name].options
    kept = {k: v for k, v in (spec.options if spec else {}).items() if k in declared}
    return EncodingSpec(name, kept)


def apply_model_choices(config: TransformerConfig, choices: ModelChoices) -> TransformerConfig:
    """`config` with every given choice set; unchanged when none is given."""
    from ..encodings import GATE_REGISTRY, POSITION_REGISTRY

    changes: dict = {}
    if choices.normalization is not None:
        changes["normalization"] = choices.normalization
    if choices.position is not None:
        changes["position"] = _switched(config.position, choices.position, POSITION_REGISTRY)
    if choices.gate is not None:
        chosen = None if choices.gate == "none" else choices.gate
        changes["gate"] = _switched(config.gate, chosen, GATE_REGISTRY)
    if choices.mixer is not None:
        kinds = {layer: choices.mixer for layer in range(config.num_layers)}
        changes["mixers"] = {} if choices.mixer == "attention" else kinds
    if choices.backend is not None:
        changes["attention_backend"] = choices.backend
    return replace(config, **changes) if changes else config
