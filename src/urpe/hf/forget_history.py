"""The forget gates of the tokens a transformers KV cache holds, kept beside the cache.

A FoX decay (`add_urpe(decay="fox")`) needs log f of every key a query sees, but a cache keeps
only keys and values. The log f of each layer's tokens are kept on the cache object itself (so
they live and die with it) and follow what `generate` does to the cache: beam search reorders
it, contrastive and assisted decoding repeat, select and crop its batch or its tail, `reset`
empties it. The cache's own methods for these are wrapped on that one object (its class is
untouched).

Two layouts, as the cache's layers store keys:
- growing layers (DynamicCache, sliding windows included, and StaticCache's sliding windows):
  c = cumsum(log f) of every token seen, (B, H, T), indexed by absolute position (`Cumulative`):
  a decoding step adds one sum per head, where recomputing the sums (and checking every log f
  again) would cost a pass over the history per layer and step; a call's keys are positions
  key_start .. key_start + Lk - 1 (slots past the last token: unwritten, masked).
- static layers (StaticCache): log f in a (B, H, max_cache_len) buffer written in place at the
  positions the new tokens take (unwritten slots hold 0: they are masked and never summed over).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer, StaticLayer, StaticSlidingWindowLayer

_HISTORY = "_urpe_log_forget"
FOLLOWED = ("reorder_cache", "batch_repeat_interleave", "batch_select_indices", "crop", "reset")


class Cumulative:
    """c_t = log f_0 + ... + log f_t of a growing layer's T tokens, in float64.

    Summed one token at a time in float64 and rounded to the call's dtype, as torch's CPU
    cumsum sums a float32 row (in double), so a step reads the c that summing the whole history
    gives. Kept in a buffer that grows geometrically (no copy of the history per step), behind
    one slot that holds c of the last token: a decoding step's query, read first as a
    `CrossDecay` wants it ([c of the queries | c of the keys], one tensor).

    Decoding steps read the sums in the call's dtype from a second buffer laid out the same way
    (`decoding_term`), which each step writes its one new sum into: a step converts one value
    per head, not the whole history (each small torch op costs ~5-25k instructions and a step
    runs a few per layer, issue 42). Built from the float64 sums when a step first reads them,
    and dropped by anything but a one-token step (a chunk, a crop, a buffer grown).

    A step is two torch ops: the float64 sum straight into its slot (from a view of the last
    slot, kept from the step before), then its rounding into both slots of `read`. The float64
    front slot is brought up to date only where it is read (a float64 call, `read` built anew).
    A step's views are made by as_strided (~11k instructions; narrow: ~16k) on buffers made
    here, which start at their storage's offset 0.
    """

    def __init__(self, values: Tensor) -> None:
        """values: (B, H, T) float64, the sums so far."""
        b, h, t = values.shape
        self.rows = values.shape[:-1]  # (B, H)
        self.buffer = values.new_empty(b, h, 1 + max(2 * t, 16))  # [last token | T tokens | room]
        self.front = self.buffer.narrow(-1, 0, 1)  # c of the last token (a view: kept, not made)
        self.last = self.front  # (B, H, 1) view of the last token's own slot (front while empty)
        self.stale = False  # whether steps wrote sums that `front` does not hold yet
        self.length = 0
        self.read: Tensor | None = None  # the sums in a step's dtype, the buffer's layout
        self._write(values)

    @property
    def values(self) -> Tensor:
        """(B, H, T): c of every token seen."""
        return self.buffer.narrow(-1, 1, self.length)

    def extend(self, log_forget: Tensor) -> None:
        """Add the sums of n new tokens' log f (B, H, n)."""
        t = self.length
        if t == 0:
            self._write(log_forget.to(torch.float64).cumsum(-1))
        elif log_forget.shape[-1] == 1 and not _tracked(log_forget, self.buffer):
            self.step(log_forget)
        else:  # a chunk, or gradients to keep: the sums continue from the last one
            last = self.buffer.narrow(-1, t, 1)
            new = torch.cat([last, log_forget.to(torch.float64)], -1).cumsum(-1)[..., 1:]
            self._write(new)

    def step(self, log_forget: Tensor) -> None:
        """One token's log f (B, H, 1), no gradient recorded: its sum (the float64 add rounds
        as the cumsum does) into its own slot, then rounded into both slots of `read`."""
        t = self.length
        b, h, capacity = self.buffer.shape
        if t + 2 > capacity:
            self._grow(t + 2)
            capacity = self.buffer.shape[-1]
        rows = (h * capacity, capacity, 1)
        slot = self.buffer.as_strided((b, h, 1), rows, 1 + t)  # (B, H, 1); as narrow, cheaper
        torch.add(self.last, log_forget, out=slot)
        self.last = slot
        self.stale = True
        read = self.read
        if read is not None:  # [front, slot 1 + t] as one view: one copy writes both
            pair = read.as_strided((b, h, 2), (h * capacity, capacity, 1 + t))
            pair.copy_(slot)
        self.length = t + 1

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens' sums (a cropped cache)."""
        if length < self.length:
            self.length = length
            self.read = None
            self.last = self.buffer.narrow(-1, length, 1)
            if length:
                self.front.copy_(self.last)
            self.stale = False

    def _front(self) -> None:
        """Bring the front slot up to the last token's sum, where steps left it behind."""
        if self.stale:
            self.front.copy_(self.last)
            self.stale = False

    def decoding_term(self, dtype: torch.dtype) -> Tensor:
        """[c of the last token | c of every token] (B, H, 1 + T) in `dtype`: the cumulative of
        a `CrossDecay` whose one query is the last token and whose keys are all T. A view
        (rows a buffer's capacity apart), not a copy, where no gradient is recorded."""
        n = 1 + self.length
        read = self.read
        if read is not None and read.dtype == dtype:  # (only ever built without gradients)
            b, h, capacity = read.shape
            return read.as_strided((b, h, n), (h * capacity, capacity, 1))  # narrow, cheaper
        self._front()
        if dtype == torch.float64 or _tracked(self.buffer):
            return self.buffer.narrow(-1, 0, n).to(dtype)
        read = self.read = self.buffer.to(dtype)
        return read.narrow(-1, 0, n)

    def _write(self, new: Tensor) -> None:
        t, n = self.length, new.shape[-1]
        if n == 0:
            return
        self.read = None
        self.stale = False
        if _tracked(new, self.buffer):  # out of place, so autograd sees every step
            self.buffer = torch.cat([new[..., -1:], self.values, new], -1)
            self.front = self.buffer.narrow(-1, 0, 1)
        else:
            if 1 + t + n > self.buffer.shape[-1]:
                self._grow(1 + t + n)
            self.buffer.narrow(-1, 1 + t, n).copy_(new)
            self.front.copy_(new[..., -1:])
        self.length = t + n
        self.last = self.buffer.narrow(-1, t + n, 1)

    def _grow(self, needed: int) -> None:
        b, h, capacity = self.buffer.shape
        grown = self.buffer.new_empty(b, h, max(2 * capacity, needed))
        grown.narrow(-1, 0, 1 + self.length).copy_(self.buffer.narrow(-1, 0, 1 + self.length))
        self.buffer = grown
        self.front = grown.narrow(-1, 0, 1)
        self.last = grown.narrow(-1, self.length, 1)
        self.read = None


def _tracked(*tensors: Tensor) -> bool:
    """Whether autograd records operations on these tensors here (written out of place then)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class ForgetHistory:
    """Per layer index: `Cumulative` sums (growing) or the static buffer of log f."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.layers: dict[int, Cumulative | Tensor] = {}

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

    def extend(self, layer: int, log_forget: Tensor, query_start) -> Cumulative | Tensor:
        """Record log f (B, H, L) of the call's new tokens, before the cache stores their keys;
        returns the layer's `Cumulative` (growing) or its static buffer of log f by position.
        NotImplementedError for cache layers whose token slots urpe cannot follow."""
        kind = _layer_of(self.cache, layer)
        past = self.layers.get(layer)
        if type(kind) is DynamicLayer:  # (a plain DynamicCache's: no other question)
            seen = kind.get_seq_length()  # what the cache's get_seq_length(layer) asks it
            if (
                past is not None
                and past.length == seen
                and log_forget.shape[-1] == 1
                and past.rows == log_forget.shape[:-1]
                and not _tracked(log_forget, past.buffer)
            ):  # a decoding step, the history in line with the cache: no other question
                past.step(log_forget)
                return past
        else:
            _check_layer(kind)
            if _in_place(kind):
                return self._write_static(layer, kind.max_cache_len, log_forget, query_start)
            seen = int(self.cache.get_seq_length(layer))
        if past is None:
            if seen:
                raise ValueError(
                    f"the cache already holds {seen} tokens whose forget gates urpe never saw "
                    "(filled before add_urpe(decay=...) or by another model): a FoX decay needs "
                    "them; start from an empty cache"
                )
            empty = log_forget.new_zeros(*log_forget.shape[:-1], 0, dtype=torch.float64)
            past = self.layers[layer] = Cumulative(empty)
        past.truncate(seen)  # where something cropped the cache without going through `crop`
        if past.length < seen or past.rows != log_forget.shape[:-1]:
            raise ValueError(
                f"the cache's layer {layer} holds {seen} tokens of batch/heads "
                f"{tuple(log_forget.shape[:-1])}, but urpe kept forget gates for "
                f"{past.length} of {tuple(past.buffer.shape[:-1])}: the cache was changed in a "
                "way urpe cannot follow; start from an empty cache"
            )
        past.extend(log_forget)
        return past

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
                t.truncate(int(self.cache.get_seq_length(layer)))

    def _reset(self) -> None:
        self.layers.clear()

    def _apply(self, change) -> None:
        for layer, t in list(self.layers.items()):
            if _in_place(_layer_of(self.cache, layer)):
                t.copy_(change(t))  # in place: a static buffer keeps its address
            else:
                self.layers[layer] = Cumulative(change(t.values))


def _check_layer(kind) -> None:
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
