"""A decoder language model with optional Transformer-XL segment recurrence, and its generation.

    model = LanguageModel(TransformerConfig(vocab_size=65, position="txl", gate="toeplitz"),
                          segment_length=64, memory_length=64)
    logits, memory = model(segment_1)                  # (B, L, V); memory: per layer (B, M, E)
    logits, memory = model(segment_2, memory)          # segment 2 attends to segment 1's states
    for token in model.generate(prompt, 100, temperature=0.8, top_k=20): ...

Segment recurrence (Dai et al. 2019): layer l of segment t + 1 attends to its own L inputs and to
the M layer-l inputs that preceded them (the end of segment t, and of earlier ones while M > L),
detached, so no gradient flows into earlier segments. Memory keys sit at their true positions:
segment t + 1's queries at M .. M + L - 1 over keys 0 .. M + L - 1 (`Positions.sequence(L,
past=M)`), which relative encodings see as offsets and the URPE gate indexes as key - query.

Generation streams one token at a time through a KV cache. It follows the training layout: the
current segment grows to L tokens; then, with memory, the last M layer inputs become the memory
of the next segment (the cache is refilled from them); without memory the context slides, the
last L // 2 tokens starting the next window. Every logit equals the uncached forward pass of the
same (memory, segment) (`generate(..., use_cache=False)` computes it that way), and, with memory,
the training forward over consecutive segments.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed import ContextParallel
from ..nn import KVCache
from .config import TransformerConfig
from .sampling import generate_tokens
from .transformer import TransformerDecoder, next_memory

Memory = list[Tensor]


class LanguageModel(nn.Module):
    """A causal `TransformerDecoder` trained on segments of `segment_length` tokens, with
    `memory_length` (M) hidden states per layer carried from segment to segment (0: none).

    The decoder is built with max_len = segment_length + memory_length (the span one query can
    see in training), which sizes learned absolute tables and per-offset bias and gate tables;
    relative tables clip beyond it, so longer contexts run (length extrapolation), while a
    learned absolute encoding refuses positions past its table.

    Args:
        config: the decoder's config; `config.max_len` is replaced as described above;
            `tie_embeddings` chooses a tied or untied output head.
        segment_length: L, tokens per training segment (and per generation window).
        memory_length: M, hidden states per layer kept as memory (Transformer-XL), 0 for none.
    """

    def __init__(self, config: TransformerConfig, segment_length: int, memory_length: int = 0):
        super().__init__()
        for name, value in (("segment_length", segment_length), ("memory_length", memory_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if segment_length < 1:
            raise ValueError(f"segment_length must be >= 1, got {segment_length}")
        if config.markers:
            raise ValueError("a language model takes no marker tokens (markers=False)")
        span = segment_length + memory_length
        if config.max_len != span:
            config = TransformerConfig.from_dict({**config.to_dict(), "max_len": span})
        self.config = config
        self.segment_length, self.memory_length = segment_length, memory_length
        self.decoder = TransformerDecoder(config)

    # ------------------------------------------------------------------------------- checkpoints
    def model_config(self) -> dict[str, Any]:
        return {
            "transformer": self.config.to_dict(),
            "segment_length": self.segment_length,
            "memory_length": self.memory_length,
        }

    @classmethod
    def from_model_config(cls, config: dict[str, Any]) -> LanguageModel:
        return cls(
            TransformerConfig.from_dict(config["transformer"]),
            int(config["segment_length"]),
            int(config.get("memory_length", 0)),
        )

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # ----------------------------------------------------------------------------------- forward
    def forward(
        self,
        tokens: Tensor,
        memory: Memory | None = None,
        *,
        use_memory: bool | None = None,
        document_ids: Tensor | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> tuple[Tensor, Memory | None]:
        """tokens (B, L) -> (logits (B, L, V), memory for the next segment or None).

        memory: the previous call's returned memory (per layer (B, m, E), m <= M), or None at the
            start of a stream. use_memory: default `memory_length > 0`; False evaluates a memory
            model without recurrence (returns None).
        document_ids: (B, L) ids of packed documents (see `urpe.TransformerDecoder`); a packed
            row carries no memory, so not with recurrence.
        context_parallel: a `urpe.distributed.ContextParallel`: tokens and document_ids are
            this rank's shards of sequences split across its group, the logits this rank's
            (no recurrence).
        """
        recurrent = self.memory_length > 0 if use_memory is None else use_memory
        if context_parallel is not None and recurrent and self.memory_length > 0:
            raise ValueError(
                "context parallelism carries no segment memory: use a model with "
                "memory_length=0, or use_memory=False"
            )
        if document_ids is not None and recurrent and self.memory_length > 0:
            raise ValueError(
                "packed documents (document_ids) carry no memory: use a model with "
                "memory_length=0, or use_memory=False"
            )
        if not recurrent or self.memory_length == 0:
            logits = self.decoder(
                tokens, document_ids=document_ids, context_parallel=context_parallel
            )
            return logits, None
        if memory is not None and memory[0].shape[1] == 0:
            memory = None
        logits, layer_inputs = self.decoder(tokens, memory=memory, return_layer_inputs=True)
        return logits, next_memory(memory, layer_inputs, self.memory_length)

    # -------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Iterator[Tensor]:
        """Stream `max_new_tokens` tokens (each (B,) int64) continuing `prompt` (B, P).

        Sampling as `urpe.models.sampling.sample` (temperature 0 = greedy). Runs without
        gradients and in the model's current mode: call `model.eval()` first for dropout-free
        sampling (`load_model` returns the model in eval mode). use_cache=False
        recomputes every step from the (memory, segment) without a KV cache (same numbers,
        slower; a reference for tests).
        """
        state = IncrementalState(self, use_cache=use_cache)
        with torch.no_grad():
            yield from generate_tokens(
                state.next_logits,
                prompt,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                generator=generator,
            )


class IncrementalState:
    """The decoding state of a `LanguageModel`: memory, the current segment's tokens (and layer
    inputs, to form the next memory) and, with `use_cache`, the KV cache of memory + segment.

    `next_logits(tokens (B, n)) -> (B, n, V)` feeds n more tokens and returns their logits,
    rolling to a new segment whenever the current one holds `segment_length` tokens.
    """

    def __init__(self, model: LanguageModel, use_cache: bool = True):
        self.model, self.use_cache = model, use_cache
        self.memory: Memory | None = None
        self.tokens: Tensor | None = None  # (B, n) of the current segment
        self.layer_inputs: list[Tensor] | None = None  # per layer (B, n, E)
        self.cache: list[KVCache] | None = None

    def _new_segment(self, tokens: Tensor | None) -> None:
        self.tokens, self.layer_inputs = None, None
        self.cache = self.model.decoder.memory_cache(self.memory) if self.use_cache else None
        if tokens is not None:  # the slid window's kept tokens are fed again
            self._feed(tokens)

    def _roll(self) -> None:
        model = self.model
        if model.memory_length > 0:
            self.memory = next_memory(self.memory, self.layer_inputs, model.memory_length)
            self._new_segment(None)
        else:
            keep = max(1, model.segment_length // 2)
            self._new_segment(self.tokens[:, self.tokens.shape[1] - keep :])

    def _feed(self, chunk: Tensor) -> Tensor:
        decoder = self.model.decoder
        if self.use_cache:
            if self.cache is None:
                self.cache = self.model.decoder.memory_cache(self.memory)
            logits, inputs = decoder(chunk, cache=self.cache, return_layer_inputs=True)
            self.tokens = chunk if self.tokens is None else torch.cat([self.tokens, chunk], 1)
        else:
            self.tokens = chunk if self.tokens is None else torch.cat([self.tokens, chunk], 1)
            logits, inputs = decoder(self.tokens, memory=self.memory, return_layer_inputs=True)
            logits = logits[:, -chunk.shape[1] :]
            inputs = [h[:, -chunk.shape[1] :] for h in inputs]
        if self.layer_inputs is None:
            self.layer_inputs = inputs
        else:
            pairs = zip(self.layer_inputs, inputs, strict=True)
            self.layer_inputs = [torch.cat([a, b], 1) for a, b in pairs]  # (B, n, E) each
        return logits

    def feed(self, tokens: Tensor) -> Tensor:
        """tokens (B, n) -> their logits (B, n, V)."""
        length = self.model.segment_length
        out = []
        start = 0
        while start < tokens.shape[1]:
            held = 0 if self.tokens is None else self.tokens.shape[1]
            if held >= length:
                self._roll()
                held = self.tokens.shape[1] if self.tokens is not None else 0
            chunk = tokens[:, start : start + length - held]
            out.append(self._feed(chunk))
            start += chunk.shape[1]
        return torch.cat(out, dim=1)

    def next_logits(self, tokens: Tensor) -> Tensor:
        """For `generate_tokens`: the logits (B, V) after feeding `tokens` (B, n)."""
        return self.feed(tokens)[:, -1]
