"""The config every Transformer in urpe is built from."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from ..encodings import (
    ABSOLUTE_REGISTRY,
    GATE_REGISTRY,
    POSITION_REGISTRY,
    EncodingSpec,
    RegisteredNames,
    SpecLike,
    resolve,
)
from ..kernels import BACKENDS, NORMALIZATIONS
from ..kernels.backends import current_backend_name
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

# The three encoding fields: (field, registry, the names it accepts).
SPEC_FIELDS = (
    ("position", POSITION_REGISTRY, POSITIONS),
    ("absolute", ABSOLUTE_REGISTRY, ABSOLUTES),
    ("gate", GATE_REGISTRY, GATES),
)
# Deprecated flat fields (configs before encoding specs) -> the spec fields whose option they
# set, and that option's name. Files that hold them load silently; keyword arguments warn.
LEGACY_OPTIONS = {
    "gate_init": (("gate",), "init"),
    "gate_activation": (("gate",), "activation"),
    "num_buckets": (("position", "gate"), "num_buckets"),
    "bucket_max_distance": (("position", "gate"), "bucket_max_distance"),
}
LEGACY = (*LEGACY_OPTIONS, "encoding_options")


@dataclass
class TransformerConfig:
    """A Transformer encoder or causal decoder.

    position, absolute, gate: encoding specs (`urpe.encodings.EncodingSpec`): a registered name,
        or a dict {"name": ..., <option>: ...} with the options declared beside its class
        (normalised to an `EncodingSpec`).
    position: the relative encoding inside attention (a name in POSITIONS; "rpe" is the paper's
        per-offset Toeplitz bias in "unique" mode, clipped beyond max_len; "t5" takes
        num_buckets and bucket_max_distance; "relation" a bias indexed by `Positions.relation`;
        "fox" the Forgetting Transformer's decay from forget gates of each layer's input, option
        init_bias).
    absolute: an absolute encoding added to the embeddings (None, "learned", "sinusoidal").
    gate: URPE's post-normalisation gate C: None (plain RPE), "toeplitz" (per offset, the
        paper's URPE), "t5" (T5 buckets, "urpe-t5") or "relation" (indexed by
        `Positions.relation`, URPE on graphs); each takes init ("ones" or "normal") and
        activation (None or a name in `urpe.encodings.gate.ACTIVATIONS`).
    num_relations: R, the range of the relation index the inputs carry (indices 0..R-1), read
        by the relation-indexed bias and gate.
    normalization: a name in `urpe.kernels.NORMALIZATIONS` ("softmax", "exp", "l2", "relu2",
        or one registered with `register_normalization`).
    share_position: one B and one C for all layers (the paper's default) or one per layer.
    markers: learned [CLS] prepended and [SEP] appended (encoder; a decoder only prepends), part
        of the model, not the data: outputs are returned for the real tokens only.
    mixers: {layer index: a name in `urpe.nn.MIXER_REGISTRY`, "bilinear" | "conv"} to replace
        attention in those layers (Yun et al.).
    attention_backend: "auto" or a name in `urpe.kernels.BACKENDS`.
    gate_init, gate_activation, num_buckets, bucket_max_distance, encoding_options: deprecated
        aliases of the specs' options (old configs load; `to_dict` writes the specs).
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
    position: SpecLike = "none"
    absolute: SpecLike | None = None
    gate: SpecLike | None = None
    gate_init: str | None = field(default=None, repr=False)
    gate_activation: str | None = field(default=None, repr=False)
    normalization: str = "softmax"
    share_position: bool = True
    num_buckets: int | None = field(default=None, repr=False)
    bucket_max_distance: int | None = field(default=None, repr=False)
    num_relations: int = 32
    encoding_options: dict[str, Any] | None = field(default=None, repr=False)
    markers: bool = False
    mixers: dict[int, str] = field(default_factory=dict)
    conv_kernel_size: int = 3
    attention_backend: str = "auto"
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        given = {name: getattr(self, name) for name in LEGACY if getattr(self, name)}
        if given:
            warnings.warn(
                f"TransformerConfig fields {', '.join(given)} are deprecated: give the options "
                "in the specs, e.g. gate={'name': 'toeplitz', 'init': 'normal'}",
                DeprecationWarning,
                stacklevel=3,
            )
        for name, value in fold_legacy_fields(self.__dict__).items():
            setattr(self, name, value)
        self.attention_backend = current_backend_name(self.attention_backend)  # "fused": old
        for name, value, allowed in (
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
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.dim

    def specs(self) -> dict[str, EncodingSpec]:
        """The chosen encodings by field ("position", and "absolute", "gate" when set)."""
        return {
            name: EncodingSpec.of(getattr(self, name))
            for name, _, _ in SPEC_FIELDS
            if getattr(self, name) is not None
        }

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def to_dict(self) -> dict:
        """Every field, JSON-ready: specs as a name or {"name": ..., options}, `mixers` keys
        (layer indices) as strings, as JSON object keys must be; no deprecated field.
        `from_dict(json.loads(json.dumps(c.to_dict()))) == c`."""
        data = {
            f.name: copy.deepcopy(getattr(self, f.name))
            for f in fields(self)
            if f.name not in LEGACY
        }
        for name, spec in self.specs().items():
            data[name] = spec.to_json()
        data["mixers"] = {str(layer): kind for layer, kind in sorted(self.mixers.items())}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
        """The inverse of `to_dict` (also accepts int mixer keys, and the deprecated flat fields
        of older configs, without a warning); unknown keys are an error, so a config written by
        a newer urpe is not silently half-read."""
        if not isinstance(data, dict):
            raise ValueError(f"a TransformerConfig needs a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {', '.join(map(str, unknown))}")
        values = fold_legacy_fields(data)
        mixers = values.get("mixers") or {}
        try:
            values["mixers"] = {int(layer): kind for layer, kind in mixers.items()}
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"mixers must map layer indices to kinds, got {mixers!r}") from None
        return cls(**values)


def fold_legacy_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Config values with the spec fields parsed and checked against their registries, and the
    deprecated flat fields folded into the specs' options (then cleared; an option the spec
    sets itself wins). A flat value is kept where the chosen encoding declares that option and
    the value is not its default (old configs name every option, mostly at its default);
    each of encoding_options must be declared by a chosen encoding, as before."""
    out = dict(values)
    chosen = {}
    for name, registry, allowed in SPEC_FIELDS:
        value = out.get(name, "none" if name == "position" else None)
        if value is not None:
            chosen[name] = resolve(registry, value, name, allowed)
    options = {name: dict(spec.options) for name, (spec, _) in chosen.items()}
    for legacy, (targets, option) in LEGACY_OPTIONS.items():
        value = out.get(legacy)
        for target in (t for t in targets if t in chosen and value is not None):
            declared = chosen[target][1].options
            if option in declared and value != declared[option]:
                options[target].setdefault(option, value)
    extra = out.get("encoding_options") or {}
    unknown = sorted(o for o in extra if not any(o in e.options for _, e in chosen.values()))
    if unknown:
        names = ", ".join(f"{t}={s.name!r}" for t, (s, _) in chosen.items())
        declared = sorted({o for _, e in chosen.values() for o in e.options})
        raise ValueError(
            f"encoding_options {unknown} are not declared by {names} (they "
            f"declare {declared or 'none'})"
        )
    for option, value in extra.items():
        for target in (t for t, (_, e) in chosen.items() if option in e.options):
            options[target].setdefault(option, value)
    for name, (spec, _) in chosen.items():
        out[name] = EncodingSpec(spec.name, options[name])
    out.update(dict.fromkeys(LEGACY))
    return out
