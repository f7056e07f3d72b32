"""The config every Transformer in urpe is built from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..encodings import (
    ABSOLUTE_REGISTRY,
    GATE_REGISTRY,
    POSITION_REGISTRY,
    RegisteredNames,
)
from ..kernels import BACKENDS, NORMALIZATIONS
from ..nn import MIXER_REGISTRY

# Live views of the registries: each name is declared beside its class (urpe.encodings.registry,
# urpe.kernels.register_normalization / register_backend, urpe.nn.register_mixer), so a name
# registered after import is accepted here with no other edit.
POSITIONS = RegisteredNames(POSITION_REGISTRY)
ABSOLUTES = RegisteredNames(ABSOLUTE_REGISTRY, leading=(None,))
GATES = RegisteredNames(GATE_REGISTRY, leading=(None,))
NORMALIZATION_NAMES = RegisteredNames(NORMALIZATIONS)
BACKEND_NAMES = RegisteredNames(BACKENDS, leading=("auto",))
MIXERS = RegisteredNames(MIXER_REGISTRY, leading=("attention",))


@dataclass
class TransformerConfig:
    """A Transformer encoder or causal decoder.

    position: the relative encoding inside attention (a name in POSITIONS, the registry of
        `urpe.encodings`; "rpe" is the paper's per-offset Toeplitz bias in "unique" mode, clipped
        beyond max_len; "relation" a bias indexed by `Positions.relation`).
    absolute: an absolute encoding added to the embeddings (None, "learned", "sinusoidal").
    gate: URPE's post-normalisation gate C: None (plain RPE), "toeplitz" (per offset, the
        paper's URPE), "t5" (T5 buckets, "urpe-t5") or "relation" (indexed by
        `Positions.relation`, URPE on graphs).
    num_relations: R for the relation-indexed bias and gate (indices 0..R-1).
    encoding_options: values of the options the chosen position, gate and absolute encoding
        declare beside themselves (`register_position(..., options={...})`).
    normalization: a name in `urpe.kernels.NORMALIZATIONS` ("softmax", "exp", "l2", "relu2",
        or one registered with `register_normalization`).
    share_position: one B and one C for all layers (the paper's default) or one per layer.
    markers: learned [CLS] prepended and [SEP] appended (encoder; a decoder only prepends), part
        of the model, not the data: outputs are returned for the real tokens only.
    mixers: {layer index: a name in `urpe.nn.MIXER_REGISTRY`, "bilinear" | "conv"} to replace
        attention in those layers (Yun et al.).
    attention_backend: "auto" or a name in `urpe.kernels.BACKENDS`.
    """

    vocab_size: int
    max_len: int = 512
    num_layers: int = 3
    dim: int = 128
    num_heads: int = 8
    ffn_dim: int | None = None  # default 4 * dim
    dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_first: bool = False
    activation: str = "gelu"
    embedding_norm: bool = True
    position: str = "none"
    absolute: str | None = None
    gate: str | None = None
    gate_init: str = "ones"
    gate_activation: str | None = None
    normalization: str = "softmax"
    share_position: bool = True
    num_buckets: int = 32
    bucket_max_distance: int = 128
    num_relations: int = 32
    encoding_options: dict[str, Any] = field(default_factory=dict)
    markers: bool = False
    mixers: dict[int, str] = field(default_factory=dict)
    conv_kernel_size: int = 3
    attention_backend: str = "auto"
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("position", self.position, POSITIONS),
            ("absolute", self.absolute, ABSOLUTES),
            ("gate", self.gate, GATES),
            ("normalization", self.normalization, NORMALIZATION_NAMES),
            ("attention_backend", self.attention_backend, BACKEND_NAMES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("vocab_size", "max_len", "num_layers", "dim", "num_heads", "num_relations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} must be divisible by num_heads={self.num_heads}")
        for layer, kind in self.mixers.items():
            if kind not in MIXERS:
                raise ValueError(f"mixers[{layer}] must be one of {MIXERS}, got {kind!r}")
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"mixers names layer {layer}, but there are {self.num_layers}")
        declared = self.declared_options()
        unknown = sorted(set(self.encoding_options) - set(declared))
        if unknown:
            raise ValueError(
                f"encoding_options {unknown} are not declared by position={self.position!r}, "
                f"gate={self.gate!r} or absolute={self.absolute!r} (they declare "
                f"{sorted(declared) or 'none'})"
            )
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.dim

    def declared_options(self) -> dict[str, Any]:
        """The options (and defaults) that the chosen encodings declare beside themselves."""
        out: dict[str, Any] = {}
        chosen = ((POSITION_REGISTRY, self.position), (GATE_REGISTRY, self.gate),
                  (ABSOLUTE_REGISTRY, self.absolute))  # fmt: skip
        for registry, name in chosen:
            if name is not None:
                out.update(registry[name].options)
        return out

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def to_dict(self) -> dict:
        """Every field, JSON-ready: `mixers` keys (layer indices) become strings, as JSON object
        keys must be. `from_dict(json.loads(json.dumps(c.to_dict()))) == c`."""
        data = asdict(self)
        data["mixers"] = {str(layer): kind for layer, kind in sorted(self.mixers.items())}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
        """The inverse of `to_dict` (also accepts int mixer keys); unknown keys are an error, so
        a config written by a newer urpe is not silently half-read."""
        if not isinstance(data, dict):
            raise ValueError(f"a TransformerConfig needs a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {', '.join(map(str, unknown))}")
        values = dict(data)
        mixers = values.get("mixers") or {}
        try:
            values["mixers"] = {int(layer): kind for layer, kind in mixers.items()}
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"mixers must map layer indices to kinds, got {mixers!r}") from None
        return cls(**values)
