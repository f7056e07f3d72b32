"""Which argument of an attention module's call holds its KV cache.

transformers' families name it differently: `cache` (most, from 5.2x on), `past_key_values` or
`past_key_value` (older releases and some families), `layer_past` (GPT-NeoX, GPTBigCode). The
hooks that place a call's queries among its keys (`positions`) and keep the forget gates of
cached tokens (`decay`) must see it whatever its name, or they take a cached call for an uncached
one: the known names are read first, then any argument that is a transformers `Cache`.
"""

from __future__ import annotations

from transformers.cache_utils import Cache

CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")


def cache_argument(args: tuple, kwargs: dict) -> Cache | None:
    """The cache passed to an attention module's forward, or None when the call has none.

    args, kwargs: the call's arguments as a forward pre-hook receives them (args[0], if any, is
    the hidden states)."""
    for name in CACHE_NAMES:
        value = kwargs.get(name)
        if value is not None:
            return value
    for value in (*kwargs.values(), *args[1:]):
        if isinstance(value, Cache):
            return value
    return None
