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

from ..kernels.cpp.ops import forget_step
from ..kernels.host import dispatcher_free, records_grad

_HISTORY = "_urpe_log_forget"
FOLLOWED = ("reorder_cache", "batch_repeat_interleave", "batch_select_indices", "crop", "reset")


class Cumulative:
    """c_t = log f_0 + ... + log f_t of a growing layer's T tokens, in float64.

    Summed one token at a time in float64, as torch's CPU cumsum sums a float32 row (in double):
    rounded to float32, a sum is the c that summing the whole history gives, and a float32
    call's `CrossDecay` reads these float64 sums as they are, each rounded as it is read. Kept
    in a buffer that grows geometrically (no copy of the history per step), behind one slot
    that holds c of the last token: a decoding step's query, read first as a `CrossDecay`
    wants it ([c of the queries | c of the keys], one tensor, a view of the buffer).

    A step is two torch ops (each small torch op costs ~5-25k instructions and a step runs a few
    per layer, issue 42): a view of [front slot, the new token's slot] (as_strided: ~11k
    instructions; narrow: ~16k), and one add of log f to the view of the step before, which
    writes the new sum into both slots. Views are made on buffers made here, which start at
    their storage's offset 0. Where the C++ kernel is loaded, a transformers model's step is
    one call instead, which also computes log f (`fused_step`).
    """

    def __init__(self, values: Tensor) -> None:
        """values: (B, H, T) float64, the sums so far."""
        b, h, t = values.shape
        self.rows = values.shape[:-1]  # (B, H)
        self.buffer = values.new_empty(b, h, 1 + max(2 * t, 16))  # [last token | T tokens | room]
        self.front = self.buffer.narrow(-1, 0, 1)  # c of the last token
        self.length = 0
        self.last = self._pair(0)  # (B, 2, H): [front, the last token's slot]
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
            self.step(log_forget.mT)
        else:  # a chunk, or gradients to keep: the sums continue from the last one
            last = self.buffer.narrow(-1, t, 1)
            new = torch.cat([last, log_forget.to(torch.float64)], -1).cumsum(-1)[..., 1:]
            self._write(new)

    def step(self, log_forget: Tensor) -> None:
        """One token's log f (B, 1, H), as the projection gives it, no gradient recorded: the
        float64 add (which rounds as the cumsum does) of it to the last sum, written to the
        front and to its own slot."""
        t = self.length
        if t + 2 > self.buffer.shape[-1]:
            self._grow(t + 2)
        pair = self._pair(t + 1)
        # last: [front, slot t] (B, 2, H), both c_(t-1): the front is read and written in place
        last = self.last if self.last is not None else self._pair(t)
        torch.add(last, log_forget, out=pair)
        self.last = pair
        self.length = t + 1

    def fused_step(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
        """`step` with the token's log f = log_sigmoid(F.linear(x, weight, bias)) computed in
        the same call, x (B, 1, D): one call into the C++ kernel (`urpe_cpp::forget_step`: the
        products as plain loops, log f rounded to x's dtype, the same float64 add) in place of
        three torch ops. Returns log f (B, 1, H) as `step`'s caller has them (float32 for half
        dtypes), or None where that call does not apply (not CPU, no kernel, gradients
        recorded, tensor subclasses or modes, compiling; what the kernel refuses: mixed dtypes,
        strided parameters): nothing is changed then."""
        tensors = (x, weight, bias, self.buffer)
        if not x.is_cpu or records_grad(*tensors) or torch.compiler.is_compiling():
            return None  # (on another device the CPU library is not even loaded)
        fused = forget_step()
        if fused is None or not dispatcher_free(tensors):
            return None
        t = self.length
        if t + 2 > self.buffer.shape[-1]:
            self._grow(t + 2)
        rows = fused(x, weight, bias, self.buffer, t)
        if rows is not None:
            self.length = t + 1
            self.last = None  # (made when a Python step needs it)
        return rows

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens' sums (a cropped cache)."""
        if length < self.length:
            self.length = length
            if length:
                self.front.copy_(self.buffer.narrow(-1, length, 1))
            self.last = self._pair(length)

    def decoding_term(self, dtype: torch.dtype) -> Tensor:
        """[c of the last token | c of every token] (B, H, 1 + T): the cumulative of a
        `CrossDecay` whose one query is the last token and whose keys are all T. Where no
        gradient is recorded, a float64 view (rows a buffer's capacity apart), not a copy,
        which a float32 call reads as it is; else in `dtype`."""
        buffer = self.buffer
        b, h, capacity = buffer.shape
        if not buffer.requires_grad:
            return buffer.as_strided((b, h, 1 + self.length), (h * capacity, capacity, 1))
        return buffer.narrow(-1, 0, 1 + self.length).to(dtype)

    def _pair(self, slot: int) -> Tensor:
        """(B, 2, H): the front slot and slot `slot`, one view (one add writes both), laid out
        as a step's log f (B, 1, H); zeros, apart from the buffer, before the first token (a
        step then sums from 0)."""
        b, h, capacity = self.buffer.shape
        if slot == 0:
            return self.buffer.new_zeros(b, 2, h)
        return self.buffer.as_strided((b, 2, h), (h * capacity, slot, capacity))

    def _write(self, new: Tensor) -> None:
        t, n = self.length, new.shape[-1]
        if n == 0:
            return
        if _tracked(new, self.buffer):  # out of place, so autograd sees every step
            self.buffer = torch.cat([new[..., -1:], self.values, new], -1)
            self.front = self.buffer.narrow(-1, 0, 1)
        else:
            if 1 + t + n > self.buffer.shape[-1]:
                self._grow(1 + t + n)
            self.buffer.narrow(-1, 1 + t, n).copy_(new)
            self.front.copy_(new[..., -1:])
        self.length = t + n
        self.last = self._pair(t + n)

    def _grow(self, needed: int) -> None:
        b, h, capacity = self.buffer.shape
        grown = self.buffer.new_empty(b, h, max(2 * capacity, needed))
        grown.narrow(-1, 0, 1 + self.length).copy_(self.buffer.narrow(-1, 0, 1 + self.length))
        self.buffer = grown
        self.front = grown.narrow(-1, 0, 1)
        self.last = self._pair(self.length)


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

    def decoding_step(
        self, layer: int, x: Tensor, projection: tuple[Tensor, Tensor | None]
    ) -> tuple[Tensor, Cumulative] | None:
        """A decoding step of a growing layer in line with its cache, its gates computed from
        the layer's input x (B, 1, D) by `projection` (W, b) in the same call as their sums
        (`Cumulative.fused_step`): (log f (B, 1, H), the layer's sums). None where that does
        not apply; the caller then computes log f and calls `extend`."""
        if x.dim() != 3 or x.shape[1] != 1:
            return None
        past = self._stepping(layer, x.shape[0], projection[0].shape[0])
        if past is None:
            return None
        rows = past.fused_step(x, *projection)
        return None if rows is None else (rows, past)

    def _stepping(self, layer: int, batch: int, heads: int) -> Cumulative | None:
        """The layer's sums where a one-token call adds one sum to them: a growing layer (a
        plain DynamicCache's) whose history is in line with the cache, of (B, H) rows."""
        past = self.layers.get(layer)
        if past is None:
            return None
        kind = _layer_of(self.cache, layer)
        if type(kind) is not DynamicLayer or past.length != kind.get_seq_length():
            return None  # (a static layer's history is a buffer of log f)
        return past if past.rows == (batch, heads) else None

    def extend(self, layer: int, rows: Tensor, query_start) -> Cumulative | Tensor:
        """Record log f (B, L, H) of the call's new tokens (as the projection gives them),
        before the cache stores their keys; returns the layer's `Cumulative` (growing) or its
        static buffer of log f by position. NotImplementedError for cache layers whose token
        slots urpe cannot follow."""
        b, n, h = rows.shape
        if n == 1:  # a decoding step, the history in line with the cache: no other question
            past = self._stepping(layer, b, h)
            if past is not None and not _tracked(rows, past.buffer):
                past.step(rows)
                return past
        kind = _layer_of(self.cache, layer)
        past = self.layers.get(layer)
        if type(kind) is DynamicLayer:  # (a plain DynamicCache's: no other question)
            seen = kind.get_seq_length()  # what the cache's get_seq_length(layer) asks it
        else:
            _check_layer(kind)
            if _in_place(kind):
                return self._write_static(layer, kind.max_cache_len, rows.mT, query_start)
            seen = int(self.cache.get_seq_length(layer))
        log_forget = rows.mT  # (B, H, L)
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
