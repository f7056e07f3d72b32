"""Lightning's precision and strategy names, defined once for `fit` and the command line (standard
library only, so the CLI checks them without importing Lightning)."""

from __future__ import annotations

PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}
STRATEGIES = ("auto", "ddp", "fsdp")


def normalize_precision(precision: str | int) -> str:
    """Lightning's precision names in their long form ("32" -> "32-true"); ValueError if unknown."""
    text = PRECISION_ALIASES.get(str(precision), str(precision))
    if text not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    return text
