"""urpe: Transformers with universal relative positional encodings (Luo et al., NeurIPS 2022)."""

from .kernels import Relation, Toeplitz, attention, reference_attention

__all__ = ["Relation", "Toeplitz", "attention", "reference_attention"]
__version__ = "0.1.0"
