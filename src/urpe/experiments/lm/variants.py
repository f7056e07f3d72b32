"""Variant names of the LM experiment: `BASE[+urpe][+mem]`.

BASE is an encoding of the family (`BASES`); `+urpe` adds URPE's Toeplitz gate C (initialised
to ones, so the model starts equal to its base) on top of it; `+mem` adds Transformer-XL segment
recurrence (the preset's memory length M). `txl` is Transformer-XL itself: its relative
attention *and* its memory, so `txl` and `txl+urpe` carry memory without `+mem`. `urpe` is the
paper's URPE, short for `rpe+urpe`. Examples: `rope+urpe`, `alibi+urpe+mem`, `t5+urpe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...models import TransformerConfig


@dataclass(frozen=True)
class Base:
    description: str
    changes: dict[str, Any] = field(default_factory=dict)
    memory: bool = False  # recurrence whatever the suffix (Transformer-XL)


BASES: dict[str, Base] = {
    "nope": Base("no position information (causal masking only)"),
    "ape": Base("learned absolute embeddings", {"absolute": "learned"}),
    "sinusoidal": Base("sinusoidal absolute embeddings", {"absolute": "sinusoidal"}),
    "rope": Base("rotary embeddings", {"position": "rope"}),
    "alibi": Base("ALiBi linear bias", {"position": "alibi"}),
    "t5": Base("T5 bucketed bias", {"position": "t5"}),
    "rpe": Base("per-offset Toeplitz bias B (the paper's RPE)", {"position": "rpe"}),
    "kerple": Base("KERPLE log kernel bias", {"position": "kerple-log"}),
    "fire": Base("FIRE functional bias", {"position": "fire"}),
    "shaw": Base("Shaw et al. relative keys and values", {"position": "shaw"}),
    "fox": Base("Forgetting Transformer forget-gate decay", {"position": "fox"}),
    "txl": Base("Transformer-XL relative attention + segment memory", {"position": "txl"}, True),
}
ALIASES = {"urpe": "rpe+urpe"}
DEFAULT_VARIANTS = ("nope", "ape", "rope", "alibi", "t5", "rpe", "urpe", "txl", "txl+urpe")
GATE = {"gate": "toeplitz"}


@dataclass(frozen=True)
class Variant:
    name: str
    base: str
    gate: bool
    memory: bool

    @property
    def description(self) -> str:
        text = BASES[self.base].description
        if self.gate:
            text += " + URPE gate C"
        if self.memory and not BASES[self.base].memory:
            text += " + segment memory"
        return text

    @property
    def base_variant(self) -> str | None:
        """The variant this one adds the gate to (the speed comparison), or None."""
        if not self.gate:
            return None
        return self.base + ("+mem" if self.memory and not BASES[self.base].memory else "")

    def config(self, base: TransformerConfig) -> TransformerConfig:
        """`base` (no position information) with this variant's fields set."""
        changes = dict(BASES[self.base].changes)
        if self.gate:
            changes.update(GATE)
        return replace(base, **changes)


def parse_variant(name: str) -> Variant:
    """'rope+urpe' -> Variant; ValueError naming the choices for anything else."""
    full = ALIASES.get(name, name)
    base, *suffixes = full.split("+")
    if (
        base not in BASES
        or any(s not in ("urpe", "mem") for s in suffixes)
        or len(set(suffixes)) != len(suffixes)
    ):
        raise ValueError(
            f"unknown variant {name!r}: expected BASE[+urpe][+mem] with BASE one of "
            f"{', '.join(BASES)} (or 'urpe' = rpe+urpe)"
        )
    memory = BASES[base].memory or "mem" in suffixes
    return Variant(name, base, "urpe" in suffixes, memory)
