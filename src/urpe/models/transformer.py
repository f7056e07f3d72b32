"""Transformer encoder and causal decoder assembled from a `TransformerConfig`.

Each forward pass builds one `urpe.Positions` (where queries and keys sit) and hands it to every
layer; encodings and gates compute their terms from it. A KV cache, segment memory
(Transformer-XL) and caller-given positions (per-row, offset, graph relations) all go through it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..distributed import ContextParallel
from ..encodings import Positions
from ..kernels import AttentionCalls
from ..nn import AttentionContext, KVCache, MultiheadAttention
from ..nn.attention import split_memory_padding
from .builders import build_absolute, build_layers, uses_relation
from .config import TransformerConfig
from .markers import MarkerTokens


def check_tokens(
    tokens: Tensor, vocab_size: int, key_padding_mask: Tensor | None, memory: int = 0
) -> None:
    """ValueError for anything but integer (B, L) token ids in [0, vocab_size) and a matching
    bool padding mask ((B, L), or (B, M + L) over `memory` earlier keys too). The range check
    syncs in eager mode; under torch.compile it becomes an asynchronous device assertion, so the
    compiled graph does not break."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError("tokens must be an integer tensor of shape (B, L)")
    b, length = tokens.shape
    shapes = {(b, length), (b, memory + length)}
    if key_padding_mask is not None and (
        not isinstance(key_padding_mask, Tensor)
        or key_padding_mask.dtype != torch.bool
        or tuple(key_padding_mask.shape) not in shapes
    ):
        expected = " or ".join(str(s) for s in sorted(shapes))
        raise ValueError(f"key_padding_mask must be bool of shape {expected} (True = padded)")
    if torch.compiler.is_compiling():
        inside = ((tokens >= 0) & (tokens < vocab_size)).all()
        torch._assert_async(inside, f"token ids must lie in [0, {vocab_size})")
        return
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}), got {tokens.min()}..{tokens.max()}"
        )


class _LoadGuard:
    """Mixin: refuse state dicts saved with the other `share_position` setting.

    A shared model holds one B and C under every layer's keys; a per-layer state dict matches
    all of those keys, and without a check only the last layer's tables would survive the load.
    The setting travels in the state dict as `_extra_state` (a tensor, so safetensors can hold
    it), and a shared model also refuses keys of one shared table that carry different values.
    """

    def get_extra_state(self) -> Tensor:
        return torch.tensor(int(self.config.share_position))

    def set_extra_state(self, state) -> None:
        saved = bool(int(state)) if isinstance(state, (Tensor, int, bool)) else None
        if saved is None:
            raise ValueError(f"unrecognised extra state in the state dict: {state!r}")
        if saved != self.config.share_position:
            raise ValueError(
                f"this state dict was saved with share_position={saved}, but the model has "
                f"share_position={self.config.share_position}: its position and gate tables "
                "would not load one to one; build the model with the saving config"
            )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Runs before this module's own tensors load, children after: check the recorded
        # setting first (the clearest message), then the values of shared keys.
        if prefix + "_extra_state" in state_dict:
            self.set_extra_state(state_dict[prefix + "_extra_state"])
        self._check_shared_keys(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _check_shared_keys(self, state_dict, prefix: str) -> None:
        aliases: dict[int, list[str]] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(prefix + name)
        for names in aliases.values():
            present = [n for n in names if n in state_dict]
            if len(present) > 1 and not all(
                torch.equal(state_dict[present[0]], state_dict[n]) for n in present[1:]
            ):
                raise ValueError(
                    f"the state dict holds different values under {present}, which this model "
                    "shares as one parameter (share_position=True): it was saved from a model "
                    "with one table per layer"
                )


class _Transformer(_LoadGuard, nn.Module):
    causal: bool = False

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = c = config
        self.markers = MarkerTokens(c.dim, append_end=not self.causal) if c.markers else None
        length = c.max_len + (self.markers.count if self.markers else 0)
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.absolute = build_absolute(c, length)
        self.embed_norm = nn.LayerNorm(c.dim) if c.embedding_norm else nn.Identity()
        self.embed_dropout = nn.Dropout(c.dropout)
        self.layers = build_layers(c, self.causal, length)
        self.final_norm = nn.LayerNorm(c.dim) if c.norm_first else nn.Identity()
        # the layers' attention calls, prepared once per kind and kept from pass to pass
        self.attention_calls = AttentionCalls()

    def _context(
        self,
        positions: Positions | None,
        length: int,
        past: int,
        batch: int,
        device,
        calls=None,
        **masks,
    ) -> AttentionContext:
        """The one context of this forward pass, for `length` queries after `past` keys; its
        positions are shape-checked here, once for every layer. calls: the layers' attention
        function (default: the model's own prepared calls)."""
        if positions is None:
            if uses_relation(self.config):
                raise ValueError(
                    f"this model (position={str(self.config.position)!r}, "
                    f"gate={self.config.gate and str(self.config.gate)!r}) "
                    "reads a relation index: pass positions=urpe.Positions.graph(relation)"
                )
            positions = Positions.sequence(length, past=past, device=device)
        context = AttentionContext(
            positions=positions,
            is_causal=self.causal,
            calls=self.attention_calls if calls is None else calls,
            **masks,
        )
        context.positions_for(length, past + length, batch, device)
        return context

    def _run(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None,
        *,
        cache: list[KVCache] | None = None,
        positions: Positions | None = None,
        memory: list[Tensor] | None = None,
        attn_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        layer_inputs: list[Tensor] | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> Tensor:
        """tokens (B, L) -> hidden states (B, L, E) of the input tokens.

        document_ids: (B, L) ids of packed documents (see `_packed_positions`).
        layer_inputs: if a list, each layer's input (B, L', E) is appended to it (L' includes
        marker tokens when they were added).
        context_parallel: tokens (and padding, documents) are this rank's shard of sequences
        split across its group (`_shard_positions`).
        """
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            raise ValueError("tokens must be an integer tensor of shape (B, L)")
        b = tokens.shape[0]
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache must hold one KVCache per layer ({len(self.layers)})")
        past = cache[0].length if cache else 0
        if memory is not None:
            if cache is not None:
                raise ValueError("memory cannot be combined with a KVCache")
            past = self._check_memory(memory, b)
        check_tokens(tokens, self.config.vocab_size, key_padding_mask, past if memory else 0)
        wrap = self.markers is not None and past == 0  # later chunks find it in cache or memory
        if wrap and (positions is not None or attn_mask is not None or document_ids is not None):
            raise ValueError(
                "marker tokens place themselves around each row's real tokens; positions, "
                "attn_mask and document_ids cannot be given with markers=True"
            )
        if context_parallel is not None:
            refused = dict(cache=cache, memory=memory, positions=positions, attn_mask=attn_mask)
            positions = self._shard_positions(tokens, document_ids, context_parallel, refused)
        elif document_ids is not None:
            positions = self._packed_positions(tokens, document_ids, cache, memory, positions)
        x = self.embed(tokens)  # (B, L, E)
        slot = None
        if wrap:
            x, key_padding_mask, slot = self.markers.wrap(x, key_padding_mask)
        memory_padding = None
        if memory is not None:
            memory_padding, key_padding_mask = split_memory_padding(
                key_padding_mask, past, x.shape[1]
            )
        context = self._context(
            positions,
            x.shape[1],
            past,
            b,
            x.device,
            calls=context_parallel,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            document_ids=document_ids,
        )
        positions = context.positions
        if self.absolute is not None:
            start = positions.query_start  # a Python int when aligned: no gather, no sync
            x = self.absolute(x, start if start is not None else positions.query)
        x = self.embed_dropout(self.embed_norm(x))
        for index, layer in enumerate(self.layers):
            if layer_inputs is not None:
                layer_inputs.append(x)
            if memory is not None:
                layer_past = layer.memory_cache(
                    memory[index].to(x.dtype), positions.key[..., :past], memory_padding
                )
            else:
                layer_past = cache[index] if cache is not None else None
            x = layer(x, context, past=layer_past)
        x = self.final_norm(x)
        return self.markers.unwrap(x, slot) if wrap else x

    def _shard_positions(
        self, tokens: Tensor, document_ids: Tensor | None, cp: ContextParallel, refused: dict
    ) -> Positions:
        """Where this rank's tokens sit in the whole sequence (`Positions.sharded`): their
        global positions, or with packed documents the positions counted from each document's
        start (from the whole rows' ids, gathered: a document may cross shards)."""
        given = [name for name, value in refused.items() if value is not None]
        if self.markers is not None:
            given.append("marker tokens")
        if given:
            raise ValueError(
                "context_parallel runs whole sequences split across processes: it takes no "
                f"{', '.join(given)}"
            )
        for module in self.modules():
            position = getattr(module, "position", None)
            if isinstance(module, MultiheadAttention) and not position.takes_calls:
                raise ValueError(
                    f"position {type(position).__name__} computes its attention itself and "
                    "cannot run context-parallel; choose one that adds a term (rpe, t5, alibi, "
                    "rope, fox, ...)"
                )
        length = tokens.shape[1]
        if document_ids is None:
            local = cp.positions(length, tokens.device)
        else:
            whole = cp.unshard(document_ids.long(), dim=-1)  # (B, L): ids of the whole rows
            local = cp.shard(Positions.from_document_ids(whole).query, dim=-1)
        return Positions.sharded(local, length * cp.size)

    def _packed_positions(
        self,
        tokens: Tensor,
        document_ids: Tensor,
        cache: list[KVCache] | None,
        memory: list[Tensor] | None,
        positions: Positions | None,
    ) -> Positions:
        """The positions of packed documents: restarting with every document, over the cached
        keys' documents too; `positions` when the caller gave their own."""
        if (
            not isinstance(document_ids, Tensor)
            or document_ids.is_floating_point()
            or tuple(document_ids.shape) != tuple(tokens.shape)
        ):
            raise ValueError(
                f"document_ids must be an integer tensor shaped like tokens {tuple(tokens.shape)}"
            )
        if memory is not None:
            raise ValueError("document_ids cannot be combined with memory (segment recurrence)")
        if positions is not None:
            return positions
        held = cache[0].documents if cache else None
        if cache and cache[0].length and held is None:
            raise ValueError(
                f"the cache holds {cache[0].length} keys without document ids: give "
                "document_ids from the first call on, or none"
            )
        ids = document_ids if held is None else torch.cat([held, document_ids], dim=-1)
        return Positions.from_document_ids(ids, query_length=tokens.shape[1])

    def memory_cache(self, memory: list[Tensor] | None) -> list[KVCache]:
        """One `KVCache` per layer holding the keys and values that `memory` (one (B, M, E)
        tensor per layer) gives at positions 0 .. M - 1: decoding after it equals the forward
        pass with `memory=`."""
        if memory is None or memory[0].shape[1] == 0:
            return [KVCache() for _ in self.layers]
        m = memory[0].shape[1]
        keys = torch.arange(m, device=memory[0].device)
        return [
            layer.memory_cache(states, keys)
            for layer, states in zip(self.layers, memory, strict=True)
        ]

    def _check_memory(self, memory: list[Tensor], batch: int) -> int:
        if not isinstance(memory, (list, tuple)) or len(memory) != len(self.layers):
            raise ValueError(
                f"memory must be a list of one (B, M, E) tensor per layer ({len(self.layers)})"
            )
        sizes = {tuple(m.shape) for m in memory}
        if len(sizes) != 1:
            raise ValueError(f"every layer's memory must have the same shape, got {sorted(sizes)}")
        shape = sizes.pop()
        if len(shape) != 3 or shape[0] != batch or shape[2] != self.config.dim:
            raise ValueError(f"memory tensors must be (B, M, E) = ({batch}, M, {self.config.dim})")
        return shape[1]


class TransformerEncoder(_Transformer):
    """Bidirectional encoder: tokens (B, L) -> hidden states (B, L, E)."""

    def forward(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        positions: Positions | None = None,
        attn_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> Tensor:
        """tokens (B, L) int; key_padding_mask (B, L) bool, True = padded.

        positions: where the L tokens sit (default `Positions.sequence(L)`); e.g.
            `Positions.from_padding(mask)` counts positions over real tokens, `Positions.graph`
            carries a relation for relation-indexed encodings.
        attn_mask: SDPA's meaning, broadcastable to (B, H, L, L), given to every layer.
        document_ids: (B, L) integer ids of packed documents (runs of equal ids): each token
            attends only within its document, at positions counted from the document's start
            (`Positions.from_document_ids`, unless `positions` are given).
        context_parallel: a `urpe.distributed.ContextParallel`: tokens, key_padding_mask and
            document_ids are this rank's shards (`cp.shard(x)`) of sequences split across its
            group, and so are the hidden states returned (context parallelism).
        """
        return self._run(
            tokens,
            key_padding_mask,
            positions=positions,
            attn_mask=attn_mask,
            document_ids=document_ids,
            context_parallel=context_parallel,
        )


class TransformerDecoder(_Transformer):
    """Causal language model: tokens (B, L) -> next-token logits (B, L, V).

    Pass `cache=model.new_cache()` and feed tokens a chunk at a time to decode incrementally;
    the result equals the full forward pass. Pass `document_ids` to train on packed rows
    (documents concatenated without padding): each document's logits equal it run alone. Or
    pass `memory` (one (B, M, E) tensor per layer, the layer inputs of M earlier positions, see
    `return_layer_inputs` and `next_memory`) to attend to a previous segment without a cache,
    Transformer-XL style.
    """

    causal = True

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def new_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def forward(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None = None,
        cache: list[KVCache] | None = None,
        positions: Positions | None = None,
        memory: list[Tensor] | None = None,
        *,
        attn_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        return_layer_inputs: bool = False,
        context_parallel: ContextParallel | None = None,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """tokens (B, L) -> logits (B, L, V); with return_layer_inputs, (logits, layer_inputs).

        key_padding_mask: (B, L) for the tokens of this call (with memory also (B, M + L)).
        cache: one `KVCache` per layer, appended to in place.
        positions: where the tokens (and the cached or memory keys) sit; default
            `Positions.sequence(L, past=cache length or M)`.
        memory: one (B, M, E) tensor per layer: that layer's inputs at M earlier positions.
            Cannot be combined with a cache.
        attn_mask: SDPA's meaning over all keys, given to every layer.
        document_ids: (B, L) integer ids of packed documents for the tokens of this call (runs
            of equal ids; a cache keeps the earlier ones): each token attends only within its
            document, at positions counted from the document's start. Not with memory.
        return_layer_inputs: also return each layer's input (B, L, E) (markers included when
            they were added), from which `next_memory` forms the next segment's memory.
        context_parallel: a `urpe.distributed.ContextParallel`: tokens, key_padding_mask and
            document_ids are this rank's shards of sequences split across its group, and the
            logits returned are this rank's (B, L/N, V) (context parallelism; no cache or
            memory).
        """
        layer_inputs: list[Tensor] | None = [] if return_layer_inputs else None
        hidden = self._run(
            tokens,
            key_padding_mask,
            cache=cache,
            positions=positions,
            memory=memory,
            attn_mask=attn_mask,
            document_ids=document_ids,
            layer_inputs=layer_inputs,
            context_parallel=context_parallel,
        )
        logits = self.head(hidden)
        return (logits, layer_inputs) if return_layer_inputs else logits


def next_memory(
    memory: list[Tensor] | None, layer_inputs: list[Tensor], size: int, detach: bool = True
) -> list[Tensor]:
    """The memory for the next segment: per layer, the last `size` of [memory, layer inputs].

    memory: this segment's memory (or None); layer_inputs: from `return_layer_inputs=True`.
    detach (Transformer-XL's default) stops gradients flowing into earlier segments.
    """
    if size < 0:
        raise ValueError(f"memory size must be >= 0, got {size}")
    out = []
    for index, h in enumerate(layer_inputs):
        full = h if memory is None else torch.cat([memory[index], h], dim=1)  # (B, M + L, E)
        kept = full[:, full.shape[1] - min(size, full.shape[1]) :]
        out.append(kept.detach() if detach else kept)
    return out
