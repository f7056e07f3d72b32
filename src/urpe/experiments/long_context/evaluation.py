"""Measuring one causal model on the long-context tasks and on text: what `urpe reproduce
long-context` does after training and `urpe evaluate long-context` does to any trained model.

A `Reader` is the model under test: a module mapping tokens (B, L) to (logits (B, L, V), _) (a
urpe `LanguageModel`, or a Hugging Face causal LM behind `HuggingFaceLM`), its tokenizer's
`encode`, and the longest context it can read (None: any; a table of learned absolute positions
ends somewhere). Lengths it cannot read are recorded as None with the reason, never run.

- `accuracies`: {task: {length: accuracy, or {depth: accuracy} for the tasks with a needle
  depth}}; each cell scores `samples` samples drawn from a generator seeded by (seed, task,
  length, depth) alone, so every model meets the same samples.
- `perplexities`: {length: perplexity per token} of a token stream, in consecutive chunks of the
  length (each token sees the earlier tokens of its chunk; no memory).

Keys are strings (JSON): lengths as "512", depths as "0.25".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...tasks.long_context import TASK_WORDS, LongContextTask, Pieces, TooShort
from ...training.data import derive_seed

LOGIT_BUDGET = 2**26  # logits per forward pass (B * L * V floats): 256 MB
TOKEN_BUDGET = 8192  # tokens per forward pass
PERPLEXITY_BATCH = 8


def depth_key(depth: float) -> str:
    return f"{depth:g}"


@dataclass
class Reader:
    """The model under test (see the module docstring)."""

    module: nn.Module
    encode: Callable[[str], Sequence[int]]
    limit: int | None = None  # longest context it can read; None: any

    @property
    def vocab_size(self) -> int:
        return int(self.module.vocab_size)

    def rows(self, length: int) -> int:
        """Samples per forward pass at `length` tokens."""
        budget = min(TOKEN_BUDGET, LOGIT_BUDGET // max(1, self.vocab_size))
        return max(1, budget // length)

    @torch.no_grad()
    def predictions(self, tokens: Tensor) -> Tensor:
        """tokens (B, L) -> the argmax next token after each position, (B, L), on the CPU."""
        device = next(self.module.parameters()).device
        logits, _ = self.module(tokens.to(device), None, use_memory=False)  # (B, L, V)
        return logits.argmax(-1).cpu()

    def unreadable(self, length: int) -> str | None:
        """Why `length` tokens cannot be read, or None."""
        if self.limit is not None and length > self.limit:
            return f"learned absolute positions end at {self.limit} tokens"
        return None


def cell_generator(seed: int, task: str, length: int, depth: float | None) -> torch.Generator:
    key = "any" if depth is None else depth_key(depth)
    return torch.Generator().manual_seed(derive_seed("long-context", seed, task, length, key))


def task_accuracy(
    reader: Reader,
    task: LongContextTask,
    pieces: Pieces,
    length: int,
    depth: float | None,
    samples: int,
    seed: int,
) -> float:
    """The share of answer units the model gets right in every token (teacher forcing) over
    `samples` samples of `task` at `length` tokens (and `depth`)."""
    generator = cell_generator(seed, task.name, length, depth)
    drawn = [task.sample(pieces, length, generator, depth) for _ in range(samples)]
    hits: list[bool] = []
    was_training = reader.module.training
    reader.module.eval()
    try:
        step = reader.rows(length)
        for start in range(0, samples, step):
            chunk = drawn[start : start + step]
            predicted = reader.predictions(torch.stack([s.tokens for s in chunk]))  # (B, L)
            for sample, row in zip(chunk, predicted, strict=True):
                hits.extend(sample.hits(row))
    finally:
        reader.module.train(was_training)
    return sum(hits) / len(hits)


def accuracies(
    reader: Reader,
    tasks: Iterable[LongContextTask],
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int,
    on_cell: Callable[[], None] = lambda: None,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """({task: {length: accuracy or {depth: accuracy}}}, {what could not run: why}). With a
    tokenizer that cannot write every task word nothing runs (the note says why); a length the
    model cannot read, or too short for the task, is None. `on_cell()` is called after each
    (task, length, depth)."""
    pieces = Pieces(reader.encode)
    table: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    try:
        for word in TASK_WORDS:
            pieces(word)
    except ValueError as error:
        return table, {"tasks": str(error)}
    for task in tasks:
        cells: dict[str, Any] = {}
        for length in lengths:
            why = reader.unreadable(length)
            cell: dict[str, float | None] = {}
            for depth in depths if task.uses_depth else [None]:
                value = None
                if why is None:
                    try:
                        value = task_accuracy(reader, task, pieces, length, depth, samples, seed)
                    except TooShort as error:
                        notes[f"{task.name} at {length}"] = str(error)
                cell["any" if depth is None else depth_key(depth)] = value
                on_cell()
            if why is not None:
                notes[f"length {length}"] = why
            cells[str(length)] = cell if task.uses_depth else cell["any"]
        table[task.name] = cells
    return table, notes


def cells(tasks: Iterable[LongContextTask], lengths: Sequence[int], depths: Sequence[float]) -> int:
    """How many (task, length, depth) cells `accuracies` measures (for a progress bar)."""
    return sum(len(lengths) * (len(depths) if t.uses_depth else 1) for t in tasks)


def perplexities(
    reader: Reader, tokens: Tensor, lengths: Sequence[int]
) -> tuple[dict[str, float | None], dict[str, str]]:
    """({length: perplexity per token}, notes): `tokens` (N,) scored in consecutive chunks of
    each length; None where the model cannot read the length or the text is shorter."""
    from ...training.lm import evaluate

    out: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    for length in lengths:
        why = reader.unreadable(length)
        if why is None and len(tokens) <= length:
            why = f"the text has {len(tokens)} tokens, not more than {length}"
        if why is not None:
            out[str(length)], notes[f"perplexity at {length}"] = None, why
            continue
        rows = max(1, min(PERPLEXITY_BATCH, reader.rows(length)))
        loss = evaluate(reader.module, tokens, length, mode="chunks", batch_size=rows)["loss"]
        out[str(length)] = math.exp(min(loss, 700.0))
    return out, notes


def reading_limit(module: nn.Module) -> int | None:
    """The longest context `module` can read: the size of its table of learned absolute
    positions (urpe's `LearnedAbsolute`, or a Hugging Face model's, such as GPT-2's), else None."""
    from ...encodings import LearnedAbsolute

    for part in module.modules():
        if isinstance(part, LearnedAbsolute):
            return part.max_len
    hf_model = getattr(module, "model", None)
    if hasattr(hf_model, "get_input_embeddings"):
        from ..finetune.model_folder import position_table_limit

        return position_table_limit(hf_model)
    return None
