"""`urpe reproduce lm` and `urpe generate`: language modelling with every position encoding,
Transformer-XL memory and the URPE gate, on real text."""

from .presets import PRESETS, Preset
from .variants import BASES, DEFAULT_VARIANTS, Variant, parse_variant

__all__ = ["BASES", "DEFAULT_VARIANTS", "PRESETS", "Preset", "Variant", "parse_variant"]
