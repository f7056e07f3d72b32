"""What `add_urpe` attached to a model, stored in `model.config.urpe` so a saved model rebuilds it.

The entry is a plain dict (it travels in config.json):

    {"max_distance": 63, "num_buckets": null, "bucket_max_distance": 128, "shared": false,
     "layers": null, "attn_implementation": "sdpa", "version": 1,
     "load": "URPE gates (the urpe_gate tensors) are part of this model: load it with ..."}

`layers` lists indices into `self_attention_modules(model)` (None: every one), so the entry is the
same for `LlamaForCausalLM` and the `LlamaModel` inside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Offsets farther than this share the edge entries of the gate's table (clipping). 1024 keeps a
# per-layer table small beside the model ((H, 2049) per layer) while covering every offset of
# models with up to 1025 positions (GPT-2, BERT, the tiny test models) exactly.
MAX_DEFAULT_DISTANCE = 1024
# Models without a context length (T5: relative buckets only) fall back to T5's own reach: its
# bias gives one entry to every offset farther than relative_attention_max_distance (128).
NO_CONTEXT_DISTANCE = 128
BASE_IMPLEMENTATIONS = ("eager", "sdpa")
VERSION = 1
# Entries of config.urpe that describe rather than configure: its format and how to load it.
NOTES = ("version", "load")


def context_length(config: Any) -> int | None:
    """The model's context length from its config (max_position_embeddings, n_positions, n_ctx),
    or None when it has none (T5)."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def default_max_distance(config: Any) -> int:
    """K for the gate's per-offset table: min(context length - 1, 1024); for models without a
    context length, T5's relative_attention_max_distance (default 128)."""
    context = context_length(config)
    if context is None:
        return int(getattr(config, "relative_attention_max_distance", None) or NO_CONTEXT_DISTANCE)
    return max(1, min(context - 1, MAX_DEFAULT_DISTANCE))


@dataclass(frozen=True)
class UrpeOptions:
    """The gates' layout. Exactly one of max_distance (an entry per offset -K..K, farther offsets
    clipped) and num_buckets (T5-style log buckets up to bucket_max_distance) is set."""

    attn_implementation: str
    max_distance: int | None = None
    num_buckets: int | None = None
    bucket_max_distance: int = 128
    shared: bool = False
    layers: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"] = None if self.layers is None else list(self.layers)
        out["version"] = VERSION
        return out

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> UrpeOptions:
        if not isinstance(entry, dict):
            raise TypeError(f"config.urpe must be a dict, got {type(entry).__name__}")
        version = entry.get("version", VERSION)
        if version != VERSION:
            raise ValueError(f"config.urpe has version {version}; this urpe reads {VERSION}")
        known = {k: v for k, v in entry.items() if k not in NOTES}
        unknown = set(known) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"config.urpe has unknown entries {sorted(unknown)}")
        if known.get("layers") is not None:
            known["layers"] = tuple(known["layers"])
        return cls(**known)
