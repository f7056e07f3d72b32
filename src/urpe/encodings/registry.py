"""Config names of encodings and gates, each declared once beside the class it builds, with the
options it takes and their defaults:

    @register_gate("toeplitz", lambda s: ToeplitzGate(s.num_heads, ..., init=s.init),
                   options={"init": "ones", "activation": None}, uses_order=True)
    class ToeplitzGate(nn.Module): ...

Every front door (`TransformerConfig`, `urpe.graph.GraphormerConfig`, `urpe.hf.add_urpe`) takes
the same `EncodingSpec`, a name plus some of those options ("toeplitz", or
{"name": "toeplitz", "init": "normal"} in configs and JSON), and builds it through the registry:
the door supplies the sizes it knows (`EncodingSettings`: heads, widths, the longest sequence,
the relation count), the spec the options. A new encoding or gate needs no edit of any door, of
the builders or of the tests that enumerate the registry. A door that cannot run an entry (a
gate that reads graph relations in a model of token sequences) refuses it in one line.

`registered(...)` scopes a registration to a `with` block (tests, examples): the registry is
restored on exit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from torch import nn

from ..kernels.watched import restored


@dataclass(frozen=True)
class EncodingSpec:
    """A registered encoding or gate by name, with the options it is given (the rest take the
    defaults declared beside its class, or the front door's).

    `EncodingSpec.of` accepts a name ("toeplitz"), a dict {"name": "toeplitz", "init": "normal"}
    (configs, JSON) or a spec; `to_json` gives the name alone when no option is set.
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"an encoding name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.options, Mapping):
            raise TypeError(f"options of {self.name!r} must be a dict, got {self.options!r}")
        bad = [k for k in self.options if not isinstance(k, str) or k == "name"]
        if bad:
            raise ValueError(f"option names of {self.name!r} must be strings other than 'name'")
        object.__setattr__(self, "options", dict(self.options))

    @classmethod
    def of(cls, value: SpecLike) -> EncodingSpec:
        if isinstance(value, EncodingSpec):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping):
            if "name" not in value:
                raise ValueError(f"an encoding spec needs a 'name', got {dict(value)!r}")
            return cls(value["name"], {k: v for k, v in value.items() if k != "name"})
        raise TypeError(
            "an encoding spec is a name, a dict like {'name': 'toeplitz', 'init': 'normal'} or "
            f"an EncodingSpec, got {value!r}"
        )

    def to_json(self) -> str | dict[str, Any]:
        return self.name if not self.options else {"name": self.name, **self.options}

    def with_options(self, **changes: Any) -> EncodingSpec:
        return EncodingSpec(self.name, {**self.options, **changes})

    def __str__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{self.name}({given})" if given else self.name

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted((k, repr(v)) for k, v in self.options.items()))))


SpecLike = EncodingSpec | str | Mapping[str, Any]


@dataclass(frozen=True)
class EncodingSettings:
    """What a builder may read: the sizes its front door knows, and the encoding's options.

    max_length: the longest sequence the model is built for (markers included); per-offset
        tables get offsets -(max_length - 1) .. max_length - 1 and clip beyond (`max_distance`).
    num_relations: R, the range of the relation index the inputs carry (`Positions.relation` in
        [0, R)); None where the door has none (urpe.hf: token sequences only).
    ordered: queries and keys sit in a sequence, so offsets key - query mean something; False
        for a graph's nodes (Graphormer).
    model: the door, as refusals name it.
    options: the options of the encoding being built, read as `s.<name>`; `Registered.build`
        completes them with `option_defaults` and the declared defaults.
    option_defaults: the door's own defaults for options of these names, where an encoding
        declares them (urpe.hf: a bucketed table reaches across the model's context).
    """

    num_heads: int
    head_dim: int
    dim: int
    max_length: int
    causal: bool = False
    num_relations: int | None = None
    ordered: bool = True
    model: str = "this model"
    options: Mapping[str, Any] = field(default_factory=dict)
    option_defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def max_distance(self) -> int:
        return max(self.max_length - 1, 0)

    def __getattr__(self, name: str) -> Any:
        # Options declared beside an encoding (`register_position(..., options=...)`).
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"EncodingSettings has no field or declared option {name!r}")


# Names an option may not take: `s.<name>` would read the settings' own field instead.
_SETTINGS_NAMES = {f.name for f in fields(EncodingSettings)} | {"max_distance", "name"}


@dataclass(frozen=True)
class Registered:
    """One config name: the class, how to build it, what it reads and the options it takes.

    uses_relation: the module reads `positions.relation` (graph relations); a door whose inputs
        carry none (urpe.hf) refuses it.
    uses_order: the module reads where queries and keys sit in a sequence (offsets, positions);
        a door without sequence order (Graphormer's nodes) refuses it.
    options: the module's own options and their defaults, read by `builder` as `s.<name>` and
        set through an `EncodingSpec`.
    """

    name: str
    cls: type
    builder: Callable[[EncodingSettings], nn.Module]
    uses_relation: bool = False
    uses_order: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "encoding"

    def refusal(self, settings: EncodingSettings) -> str | None:
        """Why the door that made `settings` cannot run this entry (one line), or None."""
        if self.uses_relation and settings.num_relations is None:
            return (
                f"{self.kind} {self.name!r} reads a relation index (Positions.relation, "
                f"e.g. graph distances), which {settings.model} does not have"
            )
        if self.uses_order and not settings.ordered:
            return (
                f"{self.kind} {self.name!r} reads sequence order (offsets key - query), "
                f"which the inputs of {settings.model} do not have"
            )
        return None

    def check_options(self, options: Mapping[str, Any]) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            declared = ", ".join(self.options) or "none"
            raise ValueError(
                f"{self.kind} {self.name!r} has no option {', '.join(map(repr, unknown))} "
                f"(it declares: {declared})"
            )

    def build(self, settings: EncodingSettings) -> nn.Module:
        """The module for `settings`; options it does not give take the door's default, else
        the declared one."""
        refusal = self.refusal(settings)
        if refusal is not None:
            raise ValueError(refusal)
        options = {**self.options, **self._door_defaults(settings), **settings.options}
        return self.builder(replace(settings, options=options))

    def with_door_defaults(self, spec: EncodingSpec, settings: EncodingSettings) -> EncodingSpec:
        """`spec` with the door's defaults written in (what a saved model records, so that it
        is rebuilt the same)."""
        return EncodingSpec(spec.name, {**self._door_defaults(settings), **spec.options})

    def _door_defaults(self, settings: EncodingSettings) -> dict[str, Any]:
        return {k: v for k, v in settings.option_defaults.items() if k in self.options}


POSITION_REGISTRY: dict[str, Registered] = {}
GATE_REGISTRY: dict[str, Registered] = {}
ABSOLUTE_REGISTRY: dict[str, Registered] = {}

T = TypeVar("T", bound=type)


def _register(registry: dict[str, Registered], kind: str):
    def register(
        name: str,
        build: Callable[[EncodingSettings], nn.Module],
        *,
        uses_relation: bool = False,
        uses_order: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> Callable[[T], T]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {kind} name must be a non-empty string, got {name!r}")
        hidden = sorted(set(options or {}) & _SETTINGS_NAMES)
        if hidden:
            raise ValueError(
                f"{kind} {name!r} declares options {hidden}, names EncodingSettings uses itself"
            )

        def decorate(cls: T) -> T:
            existing = registry.get(name)
            if existing is not None and existing.cls.__qualname__ != cls.__qualname__:
                raise ValueError(f"{kind} name {name!r} is already taken by {existing.cls}")
            registry[name] = Registered(
                name, cls, build, uses_relation, uses_order, dict(options or {}), kind
            )
            return cls

        return decorate

    register.registry = registry  # for `registered`
    return register


register_position = _register(POSITION_REGISTRY, "position encoding")
register_position.__doc__ = "Class decorator: declare a relative encoding's config name."
register_gate = _register(GATE_REGISTRY, "gate")
register_gate.__doc__ = "Class decorator: declare a gate's config name."
register_absolute = _register(ABSOLUTE_REGISTRY, "absolute encoding")
register_absolute.__doc__ = "Class decorator: declare an absolute encoding's config name."


@contextmanager
def registered(register: Callable, name: str, cls: type, build: Callable, **declaration):
    """`register(name, build, **declaration)(cls)` for the `with` block only (tests, examples):
    on exit the registry is exactly what it was (also when the block raises, and also undoing
    whatever else the block registered). Works with `register_position`, `register_gate`,
    `register_absolute` and `urpe.nn.register_mixer`; yields the registry entry.

        with registered(register_gate, "half", HalfGate, lambda s: HalfGate()):
            TransformerConfig(vocab_size=5, gate="half")
    """
    with restored(register.registry):
        register(name, build, **declaration)(cls)
        yield register.registry[name]


def resolve(
    registry: Mapping[str, Registered], value: SpecLike, what: str, allowed: Sequence | None = None
) -> tuple[EncodingSpec, Registered]:
    """The spec `value` stands for and its registry entry; ValueError in one line for an
    unregistered name (naming `what` and the `allowed` names) or an option it does not declare."""
    spec = EncodingSpec.of(value)
    entry = registry.get(spec.name)
    if entry is None:
        allowed = tuple(registry) if allowed is None else tuple(allowed)
        raise ValueError(f"{what} must be one of {allowed}, got {spec.name!r}")
    entry.check_options(spec.options)
    return spec, entry


def build_encoding(
    registry: Mapping[str, Registered], value: SpecLike, settings: EncodingSettings, what: str
) -> nn.Module:
    """The module `value` names, built with the door's `settings` and the spec's options; a
    door that cannot run it gets one line naming the entries it can run."""
    spec, entry = resolve(registry, value, what)
    check_runs(registry, entry, settings)
    return entry.build(replace(settings, options=spec.options))


def check_runs(
    registry: Mapping[str, Registered], entry: Registered, settings: EncodingSettings
) -> None:
    """ValueError (one line) when the door that made `settings` cannot run `entry`."""
    refusal = entry.refusal(settings)
    if refusal is not None:
        usable = [n for n, e in registry.items() if e.refusal(settings) is None]
        raise ValueError(f"{refusal}: choose one of {', '.join(usable) or 'none'}")


class RegisteredNames(Sequence):
    """A live, read-only view of a registry's names (plus fixed leading options such as None).

    Behaves like the tuple it replaces (`in`, iteration, indexing, `len`), and sees entries
    registered after import.
    """

    def __init__(self, registry: Mapping[str, Any], leading: tuple = ()):
        self._registry, self._leading = registry, leading

    def _names(self) -> tuple:
        return (*self._leading, *self._registry)

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._leading) + len(self._registry)

    def __iter__(self) -> Iterator:
        return iter(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._leading or (isinstance(value, str) and value in self._registry)

    def __repr__(self) -> str:
        return repr(self._names())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # a live view: its contents can change
