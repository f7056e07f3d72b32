"""What `add_urpe` attached to a model, stored in `model.config.urpe` so a saved model rebuilds it.

The entry is a plain dict (it travels in config.json):

    {"gate": "toeplitz", "decay": null, "max_distance": 63, "shared": false, "layers": null,
     "attn_implementation": "sdpa", "version": 2,
     "load": "URPE gates (the urpe_gate tensors) are part of this model: load it with ..."}

`gate` is the gate's spec (a name in `urpe.encodings.GATE_REGISTRY`, or {"name": ..., options},
with the options this door chose written in, such as a bucketed gate's bucket_max_distance), or
None (no gate: a decay only). `decay` is None or the spec of a decay computed from the layer's
input ("fox", with its init_bias written in); entries without it (before decays) load as None.
`max_distance` is K, the reach of per-offset tables: the gates are built for sequences of up to
K + 1 tokens, farther offsets share the edge entries. `layers` lists indices into
`self_attention_modules(model)` (None: every one), so the entry is the same for
`LlamaForCausalLM` and the `LlamaModel` inside it. Entries of version 1 (max_distance,
num_buckets, bucket_max_distance instead of gate) still load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..encodings import EncodingSpec

# Offsets farther than this share the edge entries of the gate's table (clipping). 1024 keeps a
# per-layer table small beside the model ((H, 2049) per layer) while covering every offset of
# models with up to 1025 positions (GPT-2, BERT, the tiny test models) exactly.
MAX_DEFAULT_DISTANCE = 1024
# Models without a context length (T5: relative buckets only) fall back to T5's own reach: its
# bias gives one entry to every offset farther than relative_attention_max_distance (128).
NO_CONTEXT_DISTANCE = 128
BASE_IMPLEMENTATIONS = ("eager", "sdpa")
VERSION = 2
# Entries of config.urpe that describe rather than configure: its format and how to load it.
NOTES = ("version", "load")
VERSION_1 = (
    "attn_implementation",
    "max_distance",
    "num_buckets",
    "bucket_max_distance",
    "shared",
    "layers",
)


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


def bucket_reach(config: Any) -> int:
    """The default bucket_max_distance of a bucketed gate: the context length; for models
    without one, T5's relative_attention_max_distance (default 128)."""
    return context_length(config) or int(
        getattr(config, "relative_attention_max_distance", None) or NO_CONTEXT_DISTANCE
    )


@dataclass(frozen=True)
class UrpeOptions:
    """The gates' layout: the gate spec (None: no gate), the decay spec (None: no decay), K
    (max_distance, None: the model's default), one gate for all layers or one per module (decays
    are always one per module), which modules, and the attention underneath."""

    attn_implementation: str
    gate: EncodingSpec | None = field(default_factory=lambda: EncodingSpec("toeplitz"))
    decay: EncodingSpec | None = None
    max_distance: int | None = None
    shared: bool = False
    layers: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gate": None if self.gate is None else self.gate.to_json(),
            "decay": None if self.decay is None else self.decay.to_json(),
            "max_distance": self.max_distance,
            "shared": self.shared,
            "layers": None if self.layers is None else list(self.layers),
            "attn_implementation": self.attn_implementation,
            "version": VERSION,
        }

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> UrpeOptions:
        if not isinstance(entry, dict):
            raise TypeError(f"config.urpe must be a dict, got {type(entry).__name__}")
        version = entry.get("version", 1)
        if version not in (1, VERSION):
            raise ValueError(f"config.urpe has version {version}; this urpe reads 1 and {VERSION}")
        known = {k: v for k, v in entry.items() if k not in NOTES}
        fields = VERSION_1 if version == 1 else cls.__dataclass_fields__
        unknown = set(known) - set(fields)
        if unknown:
            raise ValueError(f"config.urpe has unknown entries {sorted(unknown)}")
        if version == 1:
            known = _from_version_1(known)
        if known.get("layers") is not None:
            known["layers"] = tuple(known["layers"])
        for name in ("gate", "decay"):
            if known.get(name) is not None:
                known[name] = EncodingSpec.of(known[name])
        return cls(**known)


def _from_version_1(entry: dict[str, Any]) -> dict[str, Any]:
    """A version-1 entry (a Toeplitz gate, or T5 buckets when num_buckets is set) as fields."""
    out = dict(entry)
    buckets = out.pop("num_buckets", None)
    reach = out.pop("bucket_max_distance", 128)
    if buckets is not None:
        out["gate"] = {"name": "t5", "num_buckets": buckets, "bucket_max_distance": reach}
    return out
