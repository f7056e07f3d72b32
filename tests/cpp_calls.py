"""Watching the C++ kernel's functions as its layers look them up: through torch's dispatcher
(`urpe.kernels.cpp.ops._op`, route "op") or the library's Python entry (`ops._entry`, route
"entry", the calls that need no gradient in plain eager mode)."""

from __future__ import annotations

from collections.abc import Callable


def wrap_cpp_calls(monkeypatch, wrap: Callable[[str, str, Callable], Callable]) -> None:
    """Replace each C++ function looked up from now on by `wrap(name, route, function)`. Calls
    prepared earlier keep theirs: clear the memos first (`urpe.kernels.dispatch.CALLS`)."""
    from urpe.kernels.cpp import ops

    for lookup, route in ((ops._op, "op"), (ops._entry, "entry")):

        def wrapped(name: str, lookup=lookup, route=route):
            function = lookup(name)
            return None if function is None else wrap(name, route, function)

        monkeypatch.setattr(ops, lookup.__name__, wrapped)
