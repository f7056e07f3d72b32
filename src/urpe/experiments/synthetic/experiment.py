"""The synthetic experiment on the shared runner: its run configs, `run_one` and `EXPERIMENT`.

A run is (task, variant, vocabulary, seed) under a preset's settings; `run_config` resolves it to
the full configuration that is its identity, and `run_one(config, context)` trains it and
returns its record: held-out token accuracy and loss, chance level, parameter count, and the
learned B and C of the first attention layer (as tensors, saved beside the record).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from ...cli_types import UsageError
from ...encodings import Positions
from ...kernels import dense_term
from ...tasks import get_task
from ...training.optim import OptimConfig
from ..execution import RunContext
from ..experiment import Experiment
from ..model_choices import apply_model_choices
from ..recipes import preset_optim, sized_transformer
from ..records import RunResult, RunSpec
from .presets import COMMAND, Preset
from .report import rows, write_report
from .variants import variant_config

# The training data of step t is drawn from (seed, t) (`urpe.training.data.GeneratedStream`).
# Records written before this stream existed carry "per-process/0" (see migrate.py): they used
# other batches, so they are never taken for a run of this stream.
DATA_STREAM = "seed-step/1"
# The held-out set: `eval_sequences` sequences from a generator seeded with seed + this offset.
HELD_OUT_OFFSET = 1_000_003
EVAL_BATCH = 256


def run_name(task: str, variant: str, vocab: int, seed: int, preset: Preset) -> str:
    return f"{task}-{variant}-V{vocab}-L{preset.seq_len}-S{preset.steps}-seed{seed}"


def run_config(
    task: str,
    variant: str,
    vocab: int,
    seed: int,
    preset: Preset,
    precision: str,
    stream: str = DATA_STREAM,
) -> dict[str, Any]:
    """Everything that decides this run's result, JSON-ready."""
    base = sized_transformer(preset, vocab, max_len=preset.seq_len, dropout=0.0, norm_first=False)
    model = apply_model_choices(variant_config(variant, base), preset)
    return {
        "experiment": "synthetic",
        "task": task,
        "variant": variant,
        "vocab_size": vocab,
        "seq_len": preset.seq_len,
        "seed": seed,
        "model": {
            "transformer": model.to_dict(),
            "num_classes": get_task(task).num_classes(preset.seq_len, vocab),
        },
        "optim": preset_optim(preset).to_dict(),
        "train": {"steps": preset.steps, "batch_size": preset.batch_size, "precision": precision},
        "data": {
            "stream": stream,
            "held_out": preset.eval_sequences,
            "held_out_seed_offset": HELD_OUT_OFFSET,
        },
    }


def plan(preset: Preset, precision: str, progress: bool = False) -> list[RunSpec]:
    """Every (task, variant, vocabulary, seed) of the preset, in that nesting order."""
    return [
        RunSpec(
            run_name(t, v, vocab, s, preset),
            run_config(t, v, vocab, s, preset, precision),
            preset.steps,
        )
        for t in preset.tasks
        for v in preset.variants
        for vocab in preset.vocab_sizes
        for s in preset.seeds
    ]


def _sample(task: str, length: int, vocab: int, batch_size: int, generator: torch.Generator):
    return get_task(task)(batch_size, length, vocab, generator)


def learned_matrices(model: torch.nn.Module, length: int) -> dict[str, torch.Tensor]:
    """Dense B and C, (H, n, n), of the first attention layer (n: length plus markers); absent
    keys for a variant without them."""
    encoder = model.encoder
    n = length + (encoder.markers.count if encoder.markers is not None else 0)
    mixer = encoder.layers[0].mixer
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        position = getattr(mixer, "position", None)
        if position is not None:
            h, d = mixer.num_heads, mixer.head_dim
            q = torch.zeros(1, h, n, d)
            term = dense_term(position.bias(q, Positions.sequence(n), d**-0.5), n, n)
            if term is not None:
                out["B"] = term.expand(1, h, n, n)[0].detach().float().cpu().clone()
        gate = getattr(mixer, "gate", None)
        if gate is not None:
            out["C"] = gate(Positions.sequence(n)).dense(n, n)[0].detach().float().cpu().clone()
    return out


def run_one(config: dict[str, Any], context: RunContext) -> RunResult:
    """Train one synthetic run and measure it on its held-out set."""
    from torch.utils.data import TensorDataset

    from ...training import (
        EncoderTokenClassifier,
        GeneratedStream,
        StepDataModule,
        TokenClassification,
    )

    task, length, vocab, seed = (
        config["task"],
        config["seq_len"],
        config["vocab_size"],
        config["seed"],
    )
    if config["data"]["stream"] != DATA_STREAM:
        raise ValueError(
            f"this urpe trains data stream {DATA_STREAM}, not {config['data']['stream']}"
        )
    context.start(seed)
    model = EncoderTokenClassifier.from_model_config(config["model"])
    num_classes = config["model"]["num_classes"]
    objective = TokenClassification(
        model, num_classes, OptimConfig.from_dict(config["optim"]), run=config
    )
    sample = functools.partial(_sample, task, length, vocab)
    held_out_size = config["data"]["held_out"]
    generator = torch.Generator().manual_seed(seed + config["data"]["held_out_seed_offset"])
    held_out = TensorDataset(*sample(held_out_size, generator))
    train = config["train"]
    data = StepDataModule(
        GeneratedStream(sample, train["batch_size"], seed),
        held_out,
        eval_batch_size=min(held_out_size, EVAL_BATCH),
    )
    metrics = context.fit(
        objective,
        data,
        max_steps=train["steps"],
        val_every=max(1, train["steps"] // 4),
        precision=train["precision"],
        seed=seed,
    )
    record = {
        "accuracy": metrics["val/acc"],
        "loss": metrics["val/loss"],
        "chance": get_task(task).chance(length, vocab),
        "params": sum(p.numel() for p in model.parameters()),
    }
    return RunResult(record, learned_matrices(model.cpu(), length))


def describe(record: dict) -> str:
    """The line printed when a run finishes."""
    r = record["result"]
    return f"accuracy {r['accuracy']:.3f} (chance {r['chance']:.3f}) in {record['seconds']:.0f} s"


def check(preset: Preset) -> None:
    if preset.seq_len < 2:
        # At length 1 every position task is trivially solved (one class) or undefined (etp).
        raise UsageError(
            "--seq-len", f"{', '.join(preset.tasks)} need a length >= 2, got {preset.seq_len}"
        )
    if "etp" in preset.tasks and min(preset.vocab_sizes) < 2:
        raise UsageError(
            "--vocab-size",
            "etp needs a vocabulary of at least 2 tokens (with one token there is nothing to copy)",
        )


def report(records: list[dict], out_dir: Path, wall_seconds: float) -> tuple[str, list[Path]]:
    """results.json, results.md and the figures; returns the markdown and the figures' paths."""
    from .plots import figures  # matplotlib, imported when a report is drawn

    text = write_report(records, out_dir, wall_seconds)
    return text, figures(records, rows(records), out_dir)


# the preset fields whose values multiply into runs
SWEEP = ("tasks", "variants", "vocab_sizes", "seeds")
EXPERIMENT = Experiment.of(COMMAND, plan, run_one, describe, report, sweep=SWEEP, check=check)
