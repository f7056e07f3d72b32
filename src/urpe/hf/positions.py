"""Where the queries and keys of one transformers attention call sit, for the gate's offsets.

Positions are slots in the key sequence the layer sees. Without a cache, queries and keys are the
same L tokens. With a KV cache, transformers' own mask code places the new queries at
`cache.get_query_offset(layer)` and the keys at `cache.get_mask_sizes(Lq, layer)[1]` onwards; a
forward pre-hook on each gated module records both before the cache is updated, so the gate sees
exactly the layout the mask was built for: dynamic caches (queries = the last Lq keys: a Toeplitz
gate), sliding-window caches (the window's keys, still ending at the queries) and static caches
(queries inside a longer, partly empty key buffer: offsets shifted by the queries' start, a
tensor under torch.compile, so a Toeplitz gate stays Toeplitz over its shifted table).

Left or right padding does not change offsets between real tokens (they stay contiguous), and the
mask hides the padded ones, so slots give the same offsets as counting real tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..encodings import Positions
from .cache_argument import cache_argument

# Where the pre-hook leaves the layout for the attention call (dropped when the call ends).
LAYOUT = "_urpe_cache_layout"


def record_cache_layout(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: store (query start, key start) for this call, or None where the keys
    start at 0 and end with the queries (no cache, or a plain dynamic cache: the usual
    `generate`, asked nothing more, as this runs in every layer of every step)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    module.__dict__[LAYOUT] = cache_layout(
        cache_argument(args, kwargs), getattr(module, "layer_idx", None), hidden
    )


def cache_layout(cache, layer: int | None, hidden: torch.Tensor | None):
    """(query start, key start) of a call with `cache` on layer `layer` whose new tokens are
    `hidden` (B, L, ...), before the cache is updated; None where the keys start at 0 and end
    with the queries (see `record_cache_layout`)."""
    if cache is None or layer is None or hidden is None or _plain(cache, layer):
        return None
    # get_query_offset (transformers >= 5.13 or so) equals get_seq_length but for MTP caches.
    query_start = getattr(cache, "get_query_offset", cache.get_seq_length)(layer)
    key_start = cache.get_mask_sizes(hidden.shape[1], layer)[1]
    # Static caches keep their length in a tensor that the update increments in place.
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in (query_start, key_start))


def _plain(cache, layer: int) -> bool:
    """A DynamicCache whose layer keeps every key from position 0 on (not a sliding window)."""
    if type(cache) is not DynamicCache:
        return False
    layers = cache.layers
    return layer < len(layers) and type(layers[layer]) is DynamicLayer


def call_positions(
    module: nn.Module, query_length: int, key_length: int, device: torch.device
) -> Positions:
    """Positions of this call's queries and keys (see the module docstring)."""
    layout = module.__dict__.get(LAYOUT)
    if layout is None:
        return Positions.aligned(query_length, key_length, device=device)
    query_start, key_start = layout
    if isinstance(query_start, int) and isinstance(key_start, int):
        if query_start + query_length == key_start + key_length:
            return Positions.aligned(query_length, key_length, start=key_start, device=device)
    # A static buffer (queries inside it) or a compiled cache with tensor offsets: still one
    # shift for every pair, so the gate stays Toeplitz (its table shifted, no (Lq, Lk) index).
    return Positions.contiguous(query_length, key_length, query_start, key_start, device=device)
