"""The LM experiment on the shared runner: run configs, `run_one` and `EXPERIMENT`.

A run is (dataset, variant, seed) under a preset's settings. `run_one` trains a `LanguageModel`
with `CausalLM` on contiguous segments of the training split (with `--pack`, the same segments as
packed documents, cut at blank lines: `urpe.data.text.documents`), then measures, on the first
`eval_tokens` tokens of the validation and test splits:

- val/test loss at the training length (memory models with their memory, as trained);
- the extrapolation table: the same weights at contexts of 1x, 2x, 4x, 8x the segment length,
  "chunks" (consecutive chunks of that length, no memory: full context within a chunk),
  "sliding" (windows of that length advancing by half of it, no memory) and, for memory models,
  "memory" (chunks of that length with the trained memory length carried across);
- throughput: median wall time of one update and training tokens per second.

The tokenizer is saved in the run folder (`runs/<id>/tokenizer/`), beside the checkpoints, so
`urpe generate runs/<id>` finds it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ...cli_types import UsageError
from ...models import TransformerConfig
from ...training.optim import OptimConfig
from ..execution import Execution, RunContext
from ..experiment import Experiment
from ..model_choices import apply_model_choices
from ..recipes import preset_optim, sized_transformer
from ..records import RunResult, RunSpec
from .data_files import canonical_dataset, dataset_spec, locate_data
from .presets import COMMAND, Preset
from .report import write_report
from .variants import parse_variant

DATA_STREAM = "contiguous-segments/1"
PACKED_STREAM = "packed-documents/1"  # the same rows as documents (--pack)
DOCUMENT_SEPARATOR = "\n\n"  # a blank line ends a document
EVAL_BATCH = 8
CURVE_TOKENS = 8192  # validation during training (the learning curves) reads this many tokens


def run_name(variant: str, seed: int, preset: Preset) -> str:
    dataset = preset.dataset.split(":")[0]
    packed = "-packed" if preset.pack else ""
    return f"{dataset}-{variant}{packed}-L{preset.segment_length}-S{preset.steps}-seed{seed}"


def decoder_base(vocab_size: int, length: int, preset: Any, dropout: float) -> TransformerConfig:
    """The decoder a text run starts from, before its variant's fields: pre-LN, tied input and
    output embeddings, no LayerNorm on the embeddings (Transformer-XL's); sizes from the preset."""
    layout = dict(norm_first=True, embedding_norm=False, tie_embeddings=True)
    return sized_transformer(preset, vocab_size, max_len=length, dropout=dropout, **layout)


def run_config(
    variant: str, seed: int, preset: Preset, precision: str, vocab_size: int, metric: str
) -> dict[str, Any]:
    """Everything that decides this run's result, JSON-ready."""
    v = parse_variant(variant)
    base = decoder_base(vocab_size, preset.segment_length, preset, preset.dropout)
    memory = preset.memory_length if v.memory else 0
    config = {
        "experiment": "lm",
        "dataset": preset.dataset,
        "tokenizer": preset.tokenizer,
        "tokenizer_vocab_size": preset.vocab_size,
        "metric": metric,
        "variant": variant,
        "seed": seed,
        "model": {
            "transformer": apply_model_choices(v.config(base), preset).to_dict(),
            "segment_length": preset.segment_length,
            "memory_length": memory,
        },
        "optim": preset_optim(preset).to_dict(),
        **schedule_sections(preset, precision, PACKED_STREAM if preset.pack else DATA_STREAM),
    }
    if preset.pack:
        config["train"]["document_separator"] = DOCUMENT_SEPARATOR
    return config


def fit_text(context, objective, stream, valid, config: dict, length: int, log_every: int) -> None:
    """Train on `stream` for the config's steps, validating on the head of the `valid` tokens
    (the learning curves); shared with `urpe finetune`."""
    from ...training.lm import held_out_segments

    ev = config["eval"]
    curve = held_out_segments(_head(valid, ev["curve_tokens"]), ev["batch_size"], length)
    fit_stream(context, objective, stream, curve, config, log_every)


def fit_stream(context, objective, stream, held_out: list, config: dict, log_every: int) -> None:
    """Train on `stream` for the config's steps, validating every `config["eval"]["val_every"]`
    updates on `held_out` (a list of `CausalLM` batches); shared by the text experiments."""
    from ...training import StepDataModule

    train = config["train"]
    context.fit(
        objective,
        StepDataModule(stream, held_out, eval_batch_size=None),
        max_steps=train["steps"],
        val_every=config["eval"]["val_every"],
        seed=config["seed"],
        precision=train["precision"],
        gradient_clip_val=train["gradient_clip"],
        log_every=log_every,
    )


def schedule_sections(preset, precision: str, stream: str = DATA_STREAM) -> dict[str, dict]:
    """The "train" and "eval" parts of a text run's config (also `urpe finetune`'s, whose
    training `stream` differs)."""
    return {
        "train": {
            "steps": preset.steps,
            "batch_size": preset.batch_size,
            "precision": precision,
            "gradient_clip": preset.gradient_clip,
            "stream": stream,
        },
        "eval": {
            "tokens": preset.eval_tokens,
            "factors": list(preset.factors),
            "val_every": preset.val_every,
            "curve_tokens": CURVE_TOKENS,
            "batch_size": EVAL_BATCH,
        },
    }


def specs(preset: Preset, precision: str, vocab_size: int, metric: str) -> list[RunSpec]:
    """Every (variant, seed) of the preset on a corpus of `vocab_size` tokens."""
    return [
        RunSpec(
            run_name(v, s, preset),
            run_config(v, s, preset, precision, vocab_size, metric),
            preset.steps,
        )
        for v in preset.variants
        for s in preset.seeds
    ]


def plan(preset: Preset, precision: str, progress: bool = False) -> list[RunSpec]:
    """Build (and cache) the corpus once, here, before any worker starts; then every run. A
    user's file is named by an absolute path (a bare path is `text:`), so every run writes
    inside --out, and enters the runs' identity by its content (see data_files.py)."""
    from ...data.text import DatasetError, load_corpus

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are spawned after it
    try:
        preset = preset.override(dataset=canonical_dataset(preset.dataset))
        corpus = load_corpus(
            preset.dataset, tokenizer=preset.tokenizer, vocab_size=preset.vocab_size, progress=None
        )
    except DatasetError as error:
        flag = f"--{error.setting.replace('_', '-')}" if error.setting else "--dataset"
        raise UsageError(flag, str(error)) from None
    if preset.pack:
        check_packing(preset, corpus.tokenizer)
    needed = (preset.batch_size * preset.segment_length) + 1
    if len(corpus.train) < needed:
        raise UsageError(
            "--dataset",
            f"the training split has {len(corpus.train)} tokens, "
            f"fewer than one update needs ({needed})",
        )
    return locate_data(specs(preset, precision, corpus.vocab_size, corpus.metric))


def refuse_memory(preset: Preset, flag: str, why: str) -> None:
    """UsageError naming `flag` where the preset's variants carry segment memory."""
    recurrent = [v for v in preset.variants if parse_variant(v).memory]
    if recurrent:
        raise UsageError(
            flag,
            f"{why}; variants {', '.join(recurrent)} use it: choose variants without +mem or txl",
        )


def check_packing(preset: Preset, tokenizer) -> None:
    """UsageError naming --pack where it cannot run: variants with memory, or a tokenizer that
    has no tokens for the document separator."""
    refuse_memory(preset, "--pack", "packed rows carry no memory")
    if tokenizer.encode(DOCUMENT_SEPARATOR).numel() == 0:
        raise UsageError(
            "--pack",
            "this tokenizer has no tokens for a blank line, which ends a "
            "document: choose --tokenizer char, byte or bpe",
        )


def document_separator(config: dict[str, Any], tokenizer) -> torch.Tensor | None:
    """The token ids that end a document in a packed run, or None."""
    train = config["train"]
    if train["stream"] not in (DATA_STREAM, PACKED_STREAM):
        raise ValueError(
            f"this urpe trains streams {DATA_STREAM} and {PACKED_STREAM}, not {train['stream']}"
        )
    if train["stream"] == DATA_STREAM:
        return None
    return tokenizer.encode(train["document_separator"])


def load_run_corpus(config: dict[str, Any]):
    from ...data.text import load_corpus

    return load_corpus(
        dataset_spec(config),
        tokenizer=config["tokenizer"],
        vocab_size=config["tokenizer_vocab_size"],
        progress=False,
    )


def _head(tokens: torch.Tensor, count: int) -> torch.Tensor:
    return tokens if count <= 0 else tokens[: count + 1]  # count targets need count + 1 tokens


def held_out_scores(metric: str, val: dict, test: dict) -> dict[str, Any]:
    """What a text run records of its scores on the validation and test splits (mean loss in
    nats, tokens scored), shared with `urpe finetune`."""
    splits = {"val": val, "test": test}
    return {
        "metric": metric,
        **{f"{name}_loss": split["loss"] for name, split in splits.items()},
        **{f"{name}_tokens": int(split["tokens"]) for name, split in splits.items()},
    }


def extrapolation(model, tokens: torch.Tensor, factors: list[int]) -> dict[str, dict[str, float]]:
    """{mode: {factor: loss in nats}} at contexts factor x segment_length (see the module doc).
    A context the model cannot run (a learned absolute table too short) is left out."""
    from ...training.lm import evaluate

    out: dict[str, dict[str, float]] = {"chunks": {}, "sliding": {}}
    if model.memory_length > 0:
        out["memory"] = {}
    for factor in factors:
        context = factor * model.segment_length
        for mode in out:
            try:
                result = evaluate(
                    model,
                    tokens,
                    context,
                    mode="sliding" if mode == "sliding" else "chunks",
                    use_memory=mode == "memory",
                    batch_size=EVAL_BATCH,
                )
            except ValueError as error:
                if "absolute" not in str(error):
                    raise
                continue
            out[mode][str(factor)] = result["loss"]
    return out


def run_one(config: dict[str, Any], context: RunContext) -> RunResult:
    """Train one LM run and evaluate it."""
    import statistics

    from ...models.lm import LanguageModel
    from ...training.inputs import TextInputs
    from ...training.lm import CausalLM, SegmentStream, evaluate

    cpu_start, load_start = time.process_time(), os.getloadavg()[0]
    seed = config["seed"]
    corpus = load_run_corpus(config)
    separator = document_separator(config, corpus.tokenizer)
    corpus.tokenizer.save(context.run_dir / "tokenizer")
    context.start(seed)
    model = LanguageModel.from_model_config(config["model"])
    inputs = TextInputs(corpus.tokenizer, config["metric"])  # in every checkpoint
    objective = CausalLM(
        model,
        OptimConfig.from_dict(config["optim"]),
        metric=config["metric"],
        run=config,
        inputs=inputs,
        context_parallel=context.execution.context_parallel,
    )
    train, ev = config["train"], config["eval"]
    length = model.segment_length
    stream = SegmentStream(corpus.train, train["batch_size"], length, separator)
    # the curve's points: every 10 updates, every update for runs of up to 20
    log_every = min(10, max(1, train["steps"] // 20))
    fit_text(context, objective, stream, corpus.valid, config, length, log_every=log_every)
    model = model.cpu().float().eval()
    val_tokens, test_tokens = _head(corpus.valid, ev["tokens"]), _head(corpus.test, ev["tokens"])
    recurrent = model.memory_length > 0
    val = evaluate(model, val_tokens, length, use_memory=recurrent, batch_size=ev["batch_size"])
    test = evaluate(model, test_tokens, length, use_memory=recurrent, batch_size=ev["batch_size"])
    steps = objective.step_seconds
    median = statistics.median(steps) if steps else float("nan")
    tokens_per_step = train["batch_size"] * length
    record = {
        **held_out_scores(config["metric"], val, test),
        "params": sum(p.numel() for p in model.parameters()),
        "step_seconds_median": median,
        "train_seconds": sum(steps),
        "tokens_per_second": tokens_per_step / median if steps else None,
        "tokens_per_second_mean": tokens_per_step * len(steps) / sum(steps) if steps else None,
        "train_tokens": tokens_per_step * train["steps"],
        "curve": objective.curve,
        "extrapolation": extrapolation(model, val_tokens, ev["factors"]),
    }
    # What this process used, and how busy the machine was (other runs share its cores).
    record["cpu_seconds"] = time.process_time() - cpu_start
    record["load_average"] = [load_start, os.getloadavg()[0]]
    return RunResult(record)


def describe(record: dict) -> str:
    from ...training.lm import report_metric

    r = record["result"]
    metric = r["metric"]
    value = report_metric(r["val_loss"], metric)
    return (
        f"val {metric} {value:.3f}, {r['tokens_per_second'] or 0:.0f} tokens/s, "
        f"{record['seconds']:.0f} s"
    )


def check_execution(preset: Preset, execution: Execution) -> None:
    """UsageError naming --context-parallel where the runs cannot split their rows."""
    n = execution.context_parallel
    if n == 1:
        return
    refuse_memory(preset, "--context-parallel", "context parallelism carries no memory")
    if preset.segment_length % (2 * n):
        raise UsageError(
            "--context-parallel",
            f"segments of {preset.segment_length} tokens do not split into the {2 * n} equal "
            f"chunks of {n} processes (zigzag): choose --segment-length a multiple of {2 * n}",
        )


def check(preset: Preset) -> None:
    if preset.dataset == "wikitext-103":
        raise UsageError(
            "--dataset",
            "WikiText-103 (the paper preset's corpus) is read from its "
            "folder: give it, --dataset wikitext-103:DIR",
        )


EXPERIMENT = Experiment.of(
    COMMAND,
    plan,
    run_one,
    describe,
    write_report,
    sweep=("variants", "seeds"),
    check=check,
    check_execution=check_execution,
)
