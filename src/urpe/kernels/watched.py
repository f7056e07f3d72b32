"""Registries that say when they change, so that what was decided from them can be forgotten.

`BACKENDS`, `AUTO_ORDER` and `NORMALIZATIONS` are a `WatchedDict` / `WatchedList`: every
mutation, through the register functions or by hand (a test's monkeypatch, a user's `pop`),
calls the functions in `LISTENERS` (dispatch's remembered calls, see `plans`).
"""

from __future__ import annotations

from collections.abc import Callable

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


for _name in ("__setitem__", "__delitem__", "__ior__", "pop", "popitem", "clear", "update",
              "setdefault"):  # fmt: skip
    setattr(WatchedDict, _name, _then_changed(getattr(dict, _name)))
for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert",
              "remove", "pop", "clear", "sort", "reverse"):  # fmt: skip
    setattr(WatchedList, _name, _then_changed(getattr(list, _name)))
