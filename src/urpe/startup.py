"""A command's start-up without Python's cyclic garbage collector at work.

Importing PyTorch creates some 150,000 objects that the collector tracks, and each full
collection walks them all: the collections that fall while a command imports torch and urpe and
builds a model cost `urpe predict` half a second of CPU on a busy 2-core machine (0.4 s of it in
torch's own import), and none of those objects is garbage.
`loading()` pauses the collector while it runs and then freezes what exists (`gc.freeze`: later
collections skip it), so collections during the command's work scan only what that work makes.

    with loading():                 # in a command: the imports and the model
        model = load_model(path)
    ...
    thaw()                          # when the command ends (`urpe.cli.main` calls it)
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loading() -> Iterator[None]:
    """No collections inside; what exists at the end is frozen (long-lived: modules, a model)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def thaw() -> None:
    """Collect the frozen objects again, as before `loading` (for callers that outlive a command:
    tests, notebooks running `urpe.cli.main`)."""
    gc.unfreeze()
