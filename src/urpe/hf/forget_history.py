"""The forget gates of the tokens a transformers KV cache holds, kept beside the cache.

A FoX decay (`add_urpe(decay="fox")`) needs log f of every key a query sees, but a cache keeps
only keys and values. The log f of each layer's tokens are kept on the cache object itself (so
they live and die with it) and follow what `generate` does to the cache: beam search reorders
it, contrastive and assisted decoding repeat, select and crop its batch or its tail, `reset`
empties it. The cache's own methods for these are wrapped on that one object (its class is
untouched).

Two layouts, as the cache's layers store keys:
- growing layers (DynamicCache, sliding windows included, and StaticCache's sliding windows):
  log f of every token seen, (B, H, T), indexed by absolute position; a call's keys are positions
  key_start .. key_start + Lk - 1 (slots past the last token: unwritten, masked).
- static layers (StaticCache): a (B, H, max_cache_len) buffer written in place at the positions
  the new tokens take (unwritten slots hold 0: they are masked and never summed over).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer, StaticLayer, StaticSlidingWindowLayer

_HISTORY = "_urpe_log_forget"
FOLLOWED = ("reorder_cache", "batch_repeat_interleave", "batch_select_indices", "crop", "reset")


class ForgetHistory:
    """Per layer index: log f of the cached tokens (growing) or the static buffer."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.layers: dict[int, Tensor] = {}

    @classmethod
    def of(cls, cache) -> ForgetHistory:
        """The history kept on `cache`, created (and the cache's methods followed) on first use."""
        history = cache.__dict__.get(_HISTORY)
        if history is None:
            history = cls(cache)
            cache.__dict__[_HISTORY] = history
            for name in FOLLOWED:
                _follow(cache, history, name)
        return history

    def extend(self, layer: int, log_forget: Tensor, query_start) -> Tensor:
        """Record log f (B, H, L) of the call's new tokens, before the cache stores their keys;
        returns log f by cache position: every token so far (growing) or the whole buffer."""
        kind = _layer_of(self.cache, layer)
        if _in_place(kind):
            return self._write_static(layer, kind.max_cache_len, log_forget, query_start)
        seen = int(self.cache.get_seq_length(layer))
        past = self.layers.get(layer)
        if past is None:
            if seen:
                raise ValueError(
                    f"the cache already holds {seen} tokens whose forget gates urpe never saw "
                    "(filled before add_urpe(decay=...) or by another model): a FoX decay needs "
                    "them; start from an empty cache"
                )
            past = log_forget.new_zeros(*log_forget.shape[:-1], 0)
        if past.shape[-1] > seen:  # cropped by something that did not go through `crop`
            past = past[..., :seen]
        if past.shape[-1] < seen or past.shape[:-1] != log_forget.shape[:-1]:
            raise ValueError(
                f"the cache's layer {layer} holds {seen} tokens of batch/heads "
                f"{tuple(log_forget.shape[:-1])}, but urpe kept forget gates for "
                f"{past.shape[-1]} of {tuple(past.shape[:-1])}: the cache was changed in a way "
                "urpe cannot follow; start from an empty cache"
            )
        self.layers[layer] = torch.cat([past, log_forget], -1)
        return self.layers[layer]

    def _write_static(self, layer: int, length: int, log_forget: Tensor, query_start) -> Tensor:
        buffer = self.layers.get(layer)
        if buffer is None or buffer.shape[:-1] != log_forget.shape[:-1]:
            buffer = log_forget.new_zeros(*log_forget.shape[:-1], length)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(buffer)  # updated in place, as the keys are
            self.layers[layer] = buffer
        slots = torch.arange(log_forget.shape[-1], device=buffer.device) + query_start
        buffer.index_copy_(-1, slots, log_forget.to(buffer.dtype))
        return buffer

    # What the cache's own methods do to its keys, done to the gates of the same tokens.
    def _reorder_cache(self, beam_idx: Tensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def _batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def _batch_select_indices(self, indices: Tensor) -> None:
        self._apply(lambda t: t[indices])

    def _crop(self, tokens_to_remove: int) -> None:
        for layer, t in list(self.layers.items()):
            if not _in_place(_layer_of(self.cache, layer)):
                self.layers[layer] = t[..., : int(self.cache.get_seq_length(layer))]

    def _reset(self) -> None:
        self.layers.clear()

    def _apply(self, change) -> None:
        for layer, t in list(self.layers.items()):
            if _in_place(_layer_of(self.cache, layer)):
                t.copy_(change(t))  # in place: a static buffer keeps its address
            else:
                self.layers[layer] = change(t)


def check_cache_layer(cache, layer: int) -> None:
    """NotImplementedError for cache layers whose token slots urpe cannot follow."""
    kind = _layer_of(cache, layer)
    if not isinstance(kind, (DynamicLayer, StaticLayer, type(None))):
        raise NotImplementedError(
            f"a FoX decay (add_urpe(decay=...)) cannot follow a {type(kind).__name__} cache "
            "layer: use a DynamicCache or a StaticCache"
        )


def _in_place(kind) -> bool:
    """A static layer whose slots are absolute positions, written in place. A static sliding
    window rolls its slots, but counts its tokens in a Python int and hands the attention the
    keys from position key_start on: its gates are kept as a growing layer's."""
    return isinstance(kind, StaticLayer) and not isinstance(kind, StaticSlidingWindowLayer)


def _layer_of(cache, layer: int):
    # An encoder-decoder's cache: self-attention keys live in its self_attention_cache.
    cache = getattr(cache, "self_attention_cache", cache)
    layers = getattr(cache, "layers", None)
    if layers is None or layer >= len(layers):
        return None
    return layers[layer]


def _follow(cache, history: ForgetHistory, name: str) -> None:
    if callable(getattr(cache, name, None)):
        cache.__dict__[name] = _Followed(cache, history, name)


class _Followed:
    """The cache's method `name`, then the history's `_<name>` with the same arguments.

    It holds the objects and the name, never a closure or a bound method: copy.deepcopy(cache)
    (transformers' recipe for reusing a prompt's cache) then binds the copy's method to the
    copy, so cropping or reordering it leaves the original and its gates alone, and a cache
    made inside torch.compile can be handed back out of the graph."""

    def __init__(self, cache, history: ForgetHistory, name: str) -> None:
        self.cache = cache
        self.history = history
        self.name = name
        self.replaced = cache.__dict__.get(name)  # a method set on this object, if any

    def __call__(self, *args, **kwargs):
        if self.replaced is None:
            result = getattr(type(self.cache), self.name)(self.cache, *args, **kwargs)
        else:
            result = self.replaced(*args, **kwargs)
        getattr(self.history, "_" + self.name)(*args, **kwargs)
        return result
