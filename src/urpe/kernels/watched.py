"""Registries that say when they change, so that what was decided from them is decided again.

`BACKENDS`, `AUTO_ORDER`, `BROKEN` and `NORMALIZATIONS` are a `WatchedDict` / `WatchedList`:
every mutation, through the register functions or by hand (a test's monkeypatch, a user's
`pop`), counts one more `generation()`. A prepared call remembers the generation it chose its
backend in and chooses again when that is no longer the current one (`prepared`).

`registered(register, entry)` scopes a registration to a `with` block (tests, examples), and
`restored(*registries)` is what it and the encodings' `registered` share: on exit each registry
is exactly what it was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_GENERATION = [0]
_COUNTING = threading.Lock()


def generation() -> int:
    """How many times a watched registry has changed in this process."""
    return _GENERATION[0]


def changed() -> None:
    with _COUNTING:  # two threads changing registries at once count two, never one
        _GENERATION[0] += 1


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
            if not _same_entries(registry, before):
                if isinstance(registry, dict):
                    registry.clear()
                    registry.update(before)
                else:
                    registry[:] = before


def _same_entries(now: dict | list, before: dict | list) -> bool:
    """The same entries, the very objects, in the same order (an equal copy registered in a
    block is still undone: the kernels tell a built-in entry by identity)."""
    if isinstance(now, dict):
        return list(now) == list(before) and all(now[k] is before[k] for k in before)
    return len(now) == len(before) and all(
        a is b or (type(a) is str and a == b) for a, b in zip(now, before, strict=True)
    )


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
