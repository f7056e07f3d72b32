"""`urpe reproduce synthetic`: the paper's PI and ETP tasks and Su's probe, every variant."""

from .presets import PRESETS, Preset
from .variants import VARIANTS, Variant, variant_config

__all__ = ["PRESETS", "VARIANTS", "Preset", "Variant", "variant_config"]
