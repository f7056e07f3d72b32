"""Registries that say when they change, so that what was decided from them can be forgotten.

`BACKENDS`, `AUTO_ORDER` and `NORMALIZATIONS` are a `WatchedDict` / `WatchedList`: every
mutation, through the register functions or by hand (a test's monkeypatch, a user's `pop`),
calls the functions in `LISTENERS` (dispatch's remembered calls, see `plans`).

`registered(register, entry)` scopes a registration to a `with` block (tests, examples), and
`restored(*registries)` is what it and the encodings' `registered` share: on exit each registry
is exactly what it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

LISTENERS: list[Callable[[], None]] = []


def changed() -> None:
    for listener in LISTENERS:
        listener()


def _then_changed(original: Callable) -> Callable:
    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        changed()
        return result

    method.__name__ = original.__name__
    return method


class WatchedDict(dict):
    """A dict that calls `changed()` after every mutation."""


class WatchedList(list):
    """A list that calls `changed()` after every mutation."""


for _name in (
    "__setitem__",
    "__delitem__",
    "__ior__",
    "pop",
    "popitem",
    "clear",
    "update",
    "setdefault",
):
    setattr(WatchedDict, _name, _then_changed(getattr(dict, _name)))
for _name in (
    "__setitem__",
    "__delitem__",
    "__iadd__",
    "__imul__",
    "append",
    "extend",
    "insert",
    "remove",
    "pop",
    "clear",
    "sort",
    "reverse",
):
    setattr(WatchedList, _name, _then_changed(getattr(list, _name)))


@contextmanager
def restored(*registries: dict | list) -> Iterator[None]:
    """On exit (also when the block raises), each dict or list holds exactly what it held on
    entry, in the same order; whatever the block added, replaced or removed is undone."""
    saved = [registry.copy() for registry in registries]
    try:
        yield
    finally:
        for registry, before in zip(registries, saved, strict=True):
            if registry != before or list(registry) != list(before):
                if isinstance(registry, dict):
                    registry.clear()
                    registry.update(before)
                else:
                    registry[:] = before


@contextmanager
def registered(register: Callable, *args, **kwargs):
    """`register(*args, **kwargs)` for the `with` block only; yields what it returns. Works
    with `urpe.kernels.register_backend` and `register_normalization` (a register function
    names the registries it changes in its `registries` attribute):

        with registered(register_normalization, Normalization("sigmoid", ...)):
            attention(q, k, v, normalization="sigmoid")
    """
    with restored(*register.registries):
        yield register(*args, **kwargs)
