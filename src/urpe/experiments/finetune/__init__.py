"""`urpe finetune`: fine-tune a local Hugging Face causal-LM folder on text with and without URPE
gates (urpe.hf), on the shared runner: seeds, resume, validation loss, curves, extrapolation."""

from .presets import PRESETS, VARIANTS, Preset, Variant

__all__ = ["PRESETS", "VARIANTS", "Preset", "Variant"]
