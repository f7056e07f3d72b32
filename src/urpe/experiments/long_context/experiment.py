"""The long-context experiment on the shared runner: run configs, `plan`, `run_one`, `EXPERIMENT`.

Per variant and seed there are two kinds of run, each a causal `LanguageModel` trained at one
length L and measured at factor x L (`evaluation.py`):

- "tasks": trained on a mixture of the preset's tasks at length L (each sample one task, needles
  at uniform depths), written in a closed word vocabulary (`TASK_WORDS`, one token per word),
  with the loss on answer tokens only; then the accuracy of every task at every length (and
  needle depth). Its tokenizer is saved in the run folder, so `urpe evaluate long-context` and
  `urpe generate` read the run like any language model.
- "text" (one per corpus): trained as `urpe reproduce lm` trains (contiguous segments of the
  corpus's training split, its own tokenizer); then perplexity on the head of the validation
  split in chunks of every length.

A learned absolute table (ape) ends at L: its longer lengths are recorded as None, with why.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ...cli_types import UsageError
from ...tasks.long_context import TASK_WORDS, TASKS, Pieces, TooShort
from ...training.optim import OptimConfig
from ..execution import RunContext
from ..experiment import Experiment
from ..lm.data_files import canonical_dataset, locate_data
from ..lm.experiment import CURVE_TOKENS, decoder_base, fit_stream, fit_text, load_run_corpus
from ..model_choices import apply_model_choices
from ..records import RunResult, RunSpec
from .evaluation import Reader, accuracies, perplexities, reading_limit
from .presets import COMMAND, Preset, parse_long_context_variant

TASK_STREAM = "task-mixture/1"  # step t's batch: drawn from (seed, t); see TaskStream
TEXT_STREAM = "contiguous-segments/1"  # `urpe reproduce lm`'s
VOCABULARY = "long-context-words/1"  # TASK_WORDS in order after <eos>, <unk>
HELD_OUT_SEED_OFFSET = 1_000_003
HELD_OUT_SAMPLES = 64  # validation during training (the learning curve), at length L
EVAL_BATCH = 8  # text runs: the validation curve's rows
GRADIENT_CLIP = 1.0
EVAL_SEED = 0  # every variant and seed meets the same evaluation samples


def task_tokenizer():
    """The closed word vocabulary of the tasks: a urpe `WordTokenizer`, ids in a fixed order."""
    import tokenizers

    from ...data.text import WordTokenizer

    words = [WordTokenizer.EOS, WordTokenizer.UNK, *TASK_WORDS]
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, WordTokenizer.UNK)
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return WordTokenizer(backend)


def text_encoder(tokenizer):
    """encode(text) -> ids for `Pieces`: a urpe tokenizer's ids of a text inside a line (no
    end-of-line token); ValueError for words a word vocabulary lacks (they would be <unk>)."""

    def encode(text: str) -> list[int]:
        unknown = tokenizer.unknown(text)
        if unknown:
            raise ValueError(f"not in the vocabulary: {', '.join(unknown[:5])}")
        return tokenizer.encode_prompt(text).tolist()

    return encode


def run_name(kind: str, variant: str, seed: int, preset: Preset, steps: int) -> str:
    return f"{kind}-{variant}-L{preset.train_length}-S{steps}-seed{seed}"


def _transformer(variant: str, preset: Preset, vocab_size: int) -> dict[str, Any]:
    base = decoder_base(vocab_size, preset.train_length, preset, dropout=0.0)
    config = parse_long_context_variant(variant).config(base)
    return apply_model_choices(config, preset).to_dict()


def _common(variant: str, seed: int, preset: Preset, vocab: int, steps: int) -> dict:
    warmup = round(preset.warmup * steps / preset.steps)  # the same share of training
    return {
        "experiment": "long-context",
        "variant": variant,
        "seed": seed,
        "model": {
            "transformer": _transformer(variant, preset, vocab),
            "segment_length": preset.train_length,
            "memory_length": 0,
        },
        "optim": OptimConfig(lr=preset.lr, warmup_steps=warmup, total_steps=steps).to_dict(),
        "lengths": [f * preset.train_length for f in preset.factors],
    }


def _train(preset: Preset, precision: str, stream: str, steps: int) -> dict[str, Any]:
    return {
        "steps": steps,
        "batch_size": preset.batch_size,
        "precision": precision,
        "gradient_clip": GRADIENT_CLIP,
        "stream": stream,
    }


def task_run_config(variant: str, seed: int, preset: Preset, precision: str) -> dict[str, Any]:
    """Everything that decides a task run's result, JSON-ready."""
    return {
        **_common(variant, seed, preset, len(TASK_WORDS) + 2, preset.steps),
        "kind": "tasks",
        "vocabulary": VOCABULARY,
        "tasks": list(preset.tasks),
        "train": _train(preset, precision, TASK_STREAM, preset.steps),
        "eval": {
            "depths": list(preset.depths),
            "samples": preset.samples,
            "seed": EVAL_SEED,
            "held_out": HELD_OUT_SAMPLES,
            "val_every": max(1, preset.steps // 4),
        },
    }


def text_run_config(
    corpus: str, variant: str, seed: int, preset: Preset, precision: str, vocab: int, metric: str
) -> dict[str, Any]:
    """Everything that decides a text run's result, JSON-ready (the keys `urpe reproduce lm`'s
    data and training helpers read)."""
    return {
        **_common(variant, seed, preset, vocab, preset.text_steps),
        "kind": "text",
        "dataset": corpus,
        "tokenizer": None,
        "tokenizer_vocab_size": None,
        "metric": metric,
        "train": _train(preset, precision, TEXT_STREAM, preset.text_steps),
        "eval": {
            "tokens": preset.eval_tokens,
            "val_every": max(1, preset.text_steps // 4),
            "curve_tokens": CURVE_TOKENS,
            "batch_size": EVAL_BATCH,
        },
    }


def corpora(preset: Preset) -> list[str]:
    return [c for c in preset.corpora if c != "none"]


def plan(preset: Preset, precision: str, progress: bool = False) -> list[RunSpec]:
    """Every run: per variant and seed one task run (if there are tasks) and one text run per
    corpus (each corpus read and cached here, before any worker starts)."""
    from ...data.text import DatasetError, load_corpus

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are spawned after it
    specs = []
    if preset.tasks:
        specs += [
            RunSpec(
                run_name("tasks", v, s, preset, preset.steps),
                task_run_config(v, s, preset, precision),
                preset.steps,
            )
            for v in preset.variants
            for s in preset.seeds
        ]
    for spec in corpora(preset):
        try:
            corpus_spec = canonical_dataset(spec)
            corpus = load_corpus(corpus_spec, progress=None)
        except DatasetError as error:
            raise UsageError("--corpora", str(error)) from None
        needed = preset.batch_size * preset.train_length + 1
        if len(corpus.train) < needed:
            raise UsageError(
                "--corpora",
                f"{spec}: the training split has {len(corpus.train)} tokens, fewer than one "
                f"update needs ({needed})",
            )
        name = corpus_spec.split(":")[0]
        specs += locate_data(
            [
                RunSpec(
                    run_name(f"text-{name}", v, s, preset, preset.text_steps),
                    text_run_config(
                        corpus_spec, v, s, preset, precision, corpus.vocab_size, corpus.metric
                    ),
                    preset.text_steps,
                )
                for v in preset.variants
                for s in preset.seeds
            ]
        )
    return specs


class TaskStream:
    """The training stream of a task run: step t's global batch is `batch_size` samples drawn
    from a generator seeded by (seed, t) (`GeneratedStream`): each sample a task chosen
    uniformly, its needle at a uniform depth; loss on the answer tokens only."""

    def __init__(self, tasks: list, pieces: Pieces, length: int, batch_size: int, seed: int):
        from ...training import GeneratedStream

        self.tasks, self.pieces, self.length = tasks, pieces, length
        self.batch_size = batch_size
        self.stream = GeneratedStream(self.draw, batch_size, seed)

    def draw(self, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each (count, length)."""
        chosen = torch.randint(len(self.tasks), (count,), generator=generator).tolist()
        samples = [self.tasks[i].sample(self.pieces, self.length, generator) for i in chosen]
        return torch.stack([s.tokens for s in samples]), torch.stack([s.targets() for s in samples])

    def batch(self, step: int, part: int, parts: int) -> dict[str, torch.Tensor]:
        from ...training.lm import segment_batch

        tokens, targets = self.stream.batch(step, part, parts)
        return segment_batch(tokens, targets, reset=True, part=part)


def _fit_tasks(config: dict, context: RunContext, objective, pieces: Pieces) -> None:
    from ...training.lm import segment_batch

    tasks = [TASKS[name] for name in config["tasks"]]
    length, train, ev = config["model"]["segment_length"], config["train"], config["eval"]
    stream = TaskStream(tasks, pieces, length, train["batch_size"], config["seed"])
    generator = torch.Generator().manual_seed(config["seed"] + HELD_OUT_SEED_OFFSET)
    held_out = [segment_batch(*stream.draw(ev["held_out"], generator), reset=True)]
    fit_stream(context, objective, stream, held_out, config, log_every=10)


def _task_run(config: dict, context: RunContext, model, objective_for) -> dict[str, Any]:
    tokenizer = task_tokenizer()
    tokenizer.save(context.run_dir / "tokenizer")
    encode = text_encoder(tokenizer)
    objective = objective_for(tokenizer, "perplexity")
    _fit_tasks(config, context, objective, Pieces(encode))
    model = model.cpu().float().eval()
    started = time.perf_counter()
    ev = config["eval"]
    tasks = [TASKS[name] for name in config["tasks"]]
    table, notes = accuracies(
        Reader(model, encode, reading_limit(model)),
        tasks,
        config["lengths"],
        ev["depths"],
        ev["samples"],
        ev["seed"],
    )
    return {
        "accuracy": table,
        "chance": {task.name: task.chance for task in tasks},
        "notes": notes,
        "eval_seconds": time.perf_counter() - started,
    }


def _text_run(config: dict, context: RunContext, model, objective_for) -> dict[str, Any]:
    from ...training.lm import SegmentStream

    corpus = load_run_corpus(config)
    corpus.tokenizer.save(context.run_dir / "tokenizer")
    objective = objective_for(corpus.tokenizer, config["metric"])
    length, train, ev = config["model"]["segment_length"], config["train"], config["eval"]
    stream = SegmentStream(corpus.train, train["batch_size"], length)
    fit_text(context, objective, stream, corpus.valid, config, length, log_every=10)
    model = model.cpu().float().eval()
    started = time.perf_counter()
    tokens = corpus.valid if ev["tokens"] <= 0 else corpus.valid[: ev["tokens"] + 1]
    reader = Reader(model, text_encoder(corpus.tokenizer), reading_limit(model))
    table, notes = perplexities(reader, tokens, config["lengths"])
    return {
        "perplexity": table,
        "scored_tokens": len(tokens) - 1,
        "notes": notes,
        "eval_seconds": time.perf_counter() - started,
    }


def run_one(config: dict[str, Any], context: RunContext) -> RunResult:
    """Train one run (a task mixture or a corpus) and measure it at every length."""
    from ...models.lm import LanguageModel
    from ...training.inputs import TextInputs
    from ...training.lm import CausalLM

    if config["kind"] not in ("tasks", "text"):
        raise ValueError(f"this urpe runs task and text runs, not {config['kind']!r}")
    expected = TASK_STREAM if config["kind"] == "tasks" else TEXT_STREAM
    if config["train"]["stream"] != expected:
        raise ValueError(f"this urpe trains stream {expected}, not {config['train']['stream']}")
    cpu_start, load_start = time.process_time(), os.getloadavg()[0]
    context.start(config["seed"])
    model = LanguageModel.from_model_config(config["model"])
    optim = OptimConfig.from_dict(config["optim"])

    def objective_for(tokenizer, metric: str) -> CausalLM:
        inputs = TextInputs(tokenizer, metric)  # in every checkpoint
        return CausalLM(model, optim, metric=metric, run=config, inputs=inputs)

    measure = _task_run if config["kind"] == "tasks" else _text_run
    record = measure(config, context, model, objective_for)
    record["params"] = sum(p.numel() for p in model.parameters())
    # What this process used, and how busy the machine was (other runs share its cores).
    record["cpu_seconds"] = time.process_time() - cpu_start
    record["load_average"] = [load_start, os.getloadavg()[0]]
    return RunResult(record)


def describe(record: dict) -> str:
    """The line printed when a run finishes."""
    result, config = record["result"], record["config"]
    if config["kind"] == "tasks":
        first = {}
        for task, cells in result["accuracy"].items():
            cell = cells.get(str(config["lengths"][0]))
            values = list(cell.values()) if isinstance(cell, dict) else [cell]
            values = [v for v in values if v is not None]
            if values:
                first[task] = sum(values) / len(values)
        shown = ", ".join(f"{task} {value:.2f}" for task, value in first.items())
        return f"at L: {shown}; {record['seconds']:.0f} s"
    values = ", ".join(
        f"{length}: {'n/a' if v is None else f'{v:.2f}'}"
        for length, v in result["perplexity"].items()
    )
    return f"perplexity {values}; {record['seconds']:.0f} s"


def check(preset: Preset) -> None:
    if not preset.tasks and not corpora(preset):
        raise UsageError("--tasks", "no tasks and no corpora: nothing to train")
    if preset.tasks:
        pieces = Pieces(text_encoder(task_tokenizer()))
        for name in preset.tasks:
            try:  # the fixed parts of a task must fit in a training sample
                TASKS[name].sample(pieces, preset.train_length, torch.Generator().manual_seed(0))
            except TooShort as error:
                raise UsageError("--train-length", f"{name}: {error}") from None


def report(records: list[dict], out, wall_seconds: float):
    """results.json, results.md and the figures; returns the markdown and the figures' paths."""
    from .plots import figures  # matplotlib, imported when a report is drawn
    from .report import results_of_records, write_results

    results = results_of_records(records)
    text = write_results(results, out, wall_seconds, records)
    return text, figures(results, out)


SWEEP = ("variants", "seeds")
EXPERIMENT = Experiment.of(COMMAND, plan, run_one, describe, report, sweep=SWEEP, check=check)
