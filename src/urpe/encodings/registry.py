"""Config names of encodings and gates, each declared once beside the class it builds.

    @register_position("rpe", lambda s: RelativeBias(s.num_heads, s.max_distance))
    class RelativeBias(RelativeEncoding): ...

`TransformerConfig` accepts exactly the registered names and the model builders look them up
here, so a new encoding needs no edit of the config, the builders or the tests that enumerate
the registry. An encoding's own options are declared beside it too, with their defaults:

    @register_position("window", lambda s: Window(s.num_heads, s.window), options={"window": 16})

`TransformerConfig(position="window", encoding_options={"window": 32})` then sets it, and the
builder reads it as `s.window`: one edit adds an option.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn


@dataclass(frozen=True)
class EncodingSettings:
    """What a builder may read: the model's sizes and the encoding options of its config.

    max_length: the longest sequence the model is built for (markers included); per-offset
    tables get offsets -(max_length - 1) .. max_length - 1 and clip beyond.
    """

    num_heads: int
    head_dim: int
    dim: int
    max_length: int
    causal: bool = False
    num_buckets: int = 32
    bucket_max_distance: int = 128
    num_relations: int = 32
    gate_init: str = "ones"
    gate_activation: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def max_distance(self) -> int:
        return max(self.max_length - 1, 0)

    def __getattr__(self, name: str) -> Any:
        # Options declared beside an encoding (`register_position(..., options=...)`).
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"EncodingSettings has no field or declared option {name!r}")


@dataclass(frozen=True)
class Registered:
    """One config name: the class, how to build it, and what it needs from `Positions`.

    uses_relation: the module reads `positions.relation` (graph relations); models built from
    sequence lengths alone cannot run it.
    options: the encoding's own options and their defaults, read by `build` as `s.<name>` and
    set through `TransformerConfig.encoding_options`.
    """

    name: str
    cls: type
    build: Callable[[EncodingSettings], nn.Module]
    uses_relation: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)


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
        options: Mapping[str, Any] | None = None,
    ) -> Callable[[T], T]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {kind} name must be a non-empty string, got {name!r}")

        def decorate(cls: T) -> T:
            existing = registry.get(name)
            if existing is not None and existing.cls.__qualname__ != cls.__qualname__:
                raise ValueError(f"{kind} name {name!r} is already taken by {existing.cls}")
            registry[name] = Registered(name, cls, build, uses_relation, dict(options or {}))
            return cls

        return decorate

    return register


register_position = _register(POSITION_REGISTRY, "position encoding")
register_position.__doc__ = "Class decorator: declare a relative encoding's config name."
register_gate = _register(GATE_REGISTRY, "gate")
register_gate.__doc__ = "Class decorator: declare a gate's config name."
register_absolute = _register(ABSOLUTE_REGISTRY, "absolute encoding")
register_absolute.__doc__ = "Class decorator: declare an absolute encoding's config name."


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
