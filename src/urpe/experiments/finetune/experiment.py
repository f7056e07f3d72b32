"""`urpe finetune` on the shared runner: run configs, `plan`, `run_one` and `EXPERIMENT`.

A run is (variant, seed) on one model folder and data set. `run_one` loads the folder's causal
LM (float32, "sdpa" attention), adds URPE gates as the variant says (`urpe.hf.add_urpe`, C = 1,
so every variant starts from the same function), and trains it with `FineTuningLM` (urpe's
`CausalLM`, the gates at their own peak lr) through `context.fit` (checkpoints, resume,
progress). Training batches are windows of L + 1 tokens at random offsets of the training split,
drawn from (seed, step), so the seed sets the data order and a resumed run sees exactly the
windows it would have seen. It then measures, on
the first `eval_tokens` tokens of the validation and test splits:

- val/test loss at the training length (consecutive chunks of L), and the val loss of the
  model as loaded, before any update (the same for every variant: the gates start at 1);
- length extrapolation as `urpe reproduce lm` reports it: the same weights at contexts of
  factor x L, in "chunks" (consecutive chunks, full context inside each) and "sliding" (windows
  advancing by half their length). A context beyond the model's table of learned absolute
  positions (GPT-2, OPT) is left out, and so is one that fails (out of memory, ...): both are
  noted in the record (`extrapolation_skipped`) and the report, and the trained run is kept;
- how far the gates moved from 1 (max |C - 1|), and the gate tensors, saved beside the record.

The fine-tuned model is saved with `save_pretrained` in `runs/<id>/model/`
(`urpe.hf.from_pretrained(path, AutoModelForCausalLM)` loads it, gates included), with the
tokenizer that made its training ids (`data.save_tokenizer`), so that the folder fine-tunes or
generates as the model folder did.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import torch

from ...cli_types import UsageError
from ...training.optim import OptimConfig
from ..execution import RunContext
from ..experiment import Experiment
from ..lm.experiment import EVAL_BATCH, fit_text, held_out_scores, schedule_sections
from ..recipes import preset_optim
from ..records import RunResult, RunSpec
from .presets import COMMAND, VARIANTS, Preset

DATA_STREAM = "random-windows/1"


def run_config(
    variant: str, seed: int, preset: Preset, precision: str, model: dict, tokens: Any
) -> dict[str, Any]:
    """Everything that decides this run's result, JSON-ready."""
    v = VARIANTS[variant]
    return {
        "experiment": "finetune",
        "dataset": preset.dataset,
        "tokenizer": preset.tokenizer,
        "tokenizer_vocab_size": preset.vocab_size,
        "tokens": tokens.tokenizer,
        "data_digest": tokens.digest,
        "metric": tokens.metric,
        "variant": variant,
        "seed": seed,
        "model": {
            **model,
            "urpe": v.urpe,
            "trains": v.trains,
            "segment_length": preset.segment_length,
            "memory_length": 0,
            **({"pack": True} if preset.pack else {}),  # unpacked runs keep their identity
        },
        "optim": preset_optim(preset).to_dict(),
        "gate_lr": preset.gate_lr if v.urpe is not None else None,
        **schedule_sections(preset, precision, DATA_STREAM),
    }


def describe_folder(path: Path, config) -> dict[str, Any]:
    from .model_folder import folder_digest

    return {
        "path": str(path.resolve()),
        "digest": folder_digest(path),
        "class": (config.architectures or [type(config).__name__])[0],
        "model_type": config.model_type,
    }


def plan(preset: Preset, precision: str, progress: bool = False) -> list[RunSpec]:
    """Check the model folder and the data once, here, before any worker starts."""
    from ...data.text import DatasetError
    from ...hf import UnsupportedModelError
    from .data import DataError, load_tokens
    from .model_folder import ModelFolderError, check_model, context_limit, read_config

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if preset.model is None:  # checked here, not in resolve: --report-only needs no model
        raise UsageError(
            "--model",
            "give the model folder to fine-tune: --model PATH (a folder "
            "written by save_pretrained)",
        )
    path = Path(preset.model).expanduser()
    try:
        config = read_config(path)
        check_model(config, any(VARIANTS[v].urpe is not None for v in preset.variants), path)
    except (ModelFolderError, UnsupportedModelError) as error:
        raise UsageError("--model", str(error)) from None
    limit = context_limit(config)
    if limit is not None and preset.segment_length > limit:
        raise UsageError(
            "--segment-length",
            f"{preset.segment_length} exceeds the model's context of {limit} positions",
        )
    model = describe_folder(path, config)
    try:
        tokens = load_tokens(
            preset.dataset,
            preset.tokenizer,
            preset.vocab_size,
            path,
            model["digest"],
            config.get_text_config().vocab_size,
        )
    except (DataError, DatasetError) as error:
        raise UsageError("--dataset", str(error)) from None
    if len(tokens.train) < preset.segment_length + 2:
        raise UsageError(
            "--dataset",
            f"the training split has {len(tokens.train)} tokens, "
            f"fewer than one window needs ({preset.segment_length + 1})",
        )
    packed = "-packed" if preset.pack else ""
    return [
        RunSpec(
            f"{v}-L{preset.segment_length}-S{preset.steps}{packed}-seed{s}",
            run_config(v, s, preset, precision, model, tokens),
            preset.steps,
        )
        for v in preset.variants
        for s in preset.seeds
    ]


class RandomWindows:
    """Step t's global batch: `batch_size` windows of L + 1 tokens at offsets drawn from
    (seed, t); part p of P holds rows [p B / P, (p + 1) B / P)."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, length: int, seed: int):
        from ...training import GeneratedStream

        self.batch_size, self.length, self.tokens = batch_size, length, tokens
        self.windows = GeneratedStream(self._sample, batch_size, seed)

    def _sample(self, count: int, generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.length, (count,), generator=generator)
        return self.tokens[starts[:, None] + torch.arange(self.length + 1)]  # (B, L + 1)

    def batch(self, step: int, part: int, parts: int) -> dict[str, torch.Tensor]:
        from ...training.lm import segment_batch

        rows = self.windows.batch(step, part, parts)  # (B / P, L + 1)
        return segment_batch(rows[:, :-1], rows[:, 1:], True, part)


def _head(tokens: torch.Tensor, count: int) -> torch.Tensor:
    return tokens if count <= 0 else tokens[: count + 1]


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def extrapolation(
    model, tokens: torch.Tensor, factors: list[int]
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """({mode: {factor: loss in nats}}, {factor: why it was left out}) at contexts factor x L.
    Contexts beyond a table of learned positions are left out unrun; a context that fails
    (out of memory, ...) is left out with its error, so the trained run is kept."""
    from ...training.lm import evaluate
    from .model_folder import position_table_limit

    limit = position_table_limit(model.model)
    out: dict[str, dict[str, float]] = {"chunks": {}, "sliding": {}}
    skipped: dict[str, str] = {}
    for factor in factors:
        context = factor * model.segment_length
        if limit is not None and context > limit:
            skipped[str(factor)] = (
                f"{context} tokens exceed the {limit} positions of "
                f"{type(model.model).__name__}'s position table"
            )
            continue
        try:
            for mode in out:
                result = evaluate(model, tokens, context, mode=mode, batch_size=EVAL_BATCH)
                out[mode][str(factor)] = result["loss"]
        except Exception as error:  # a measurement after training: noted, never fatal
            for mode in out:
                out[mode].pop(str(factor), None)
            skipped[str(factor)] = _first_line(error)
    return out, skipped


def quiet_transformers() -> None:
    """No progress bars of transformers' own (saving shards) under the sweep's bar."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def _freeze_all_but_gates(model: torch.nn.Module) -> None:
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("urpe" in name)


def run_one(config: dict[str, Any], context: RunContext) -> RunResult:
    """Fine-tune one variant and evaluate it."""
    from ...hf import gate_parameters
    from ...training.lm import evaluate
    from .data import load_tokens, save_tokenizer
    from .model_folder import HuggingFaceLM, folder_digest, load_model
    from .objective import FineTuningLM

    if config["train"]["stream"] != DATA_STREAM:
        raise ValueError(f"this urpe trains stream {DATA_STREAM}, not {config['train']['stream']}")
    m, train, ev = config["model"], config["train"], config["eval"]
    path = Path(m["path"])
    if folder_digest(path) != m["digest"]:
        raise ValueError(f"{path} changed since this run was planned; run the command again")
    seed = config["seed"]
    context.start(seed)
    quiet_transformers()
    hf_model = load_model(path, m["urpe"]).train()  # from_pretrained returns it in eval mode
    tokens = load_tokens(
        config["dataset"],
        config["tokenizer"],
        config["tokenizer_vocab_size"],
        path,
        m["digest"],
        hf_model.config.get_text_config().vocab_size,
    )
    if tokens.digest != config["data_digest"]:
        raise ValueError(f"the data of {config['dataset']} changed since this run was planned")
    if m["trains"] == "gates":
        _freeze_all_but_gates(hf_model)
    model = HuggingFaceLM(hf_model, m["segment_length"], m.get("pack", False))
    objective = FineTuningLM(
        model,
        OptimConfig.from_dict(config["optim"]),
        config["gate_lr"],
        metric=config["metric"],
        run=config,
    )
    length = m["segment_length"]
    val_tokens, test_tokens = _head(tokens.valid, ev["tokens"]), _head(tokens.test, ev["tokens"])
    # Evaluations run on the run's GPU, if it has one (Lightning hands the model back on the CPU).
    device = (
        "cuda" if context.execution.accelerator == "gpu" and torch.cuda.is_available() else "cpu"
    )
    start = evaluate(model.to(device), val_tokens, length, batch_size=ev["batch_size"])  # C = 1
    stream = RandomWindows(tokens.train, train["batch_size"], length, seed)
    fit_text(context, objective, stream, tokens.valid, config, length, log_every=5)
    model = model.float().eval()
    hf_model.save_pretrained(context.run_dir / "model")  # first: no measurement can lose it
    save_tokenizer(
        path,
        config["dataset"],
        config["tokenizer"],
        config["tokenizer_vocab_size"],
        context.run_dir / "model",
    )
    model = model.to(device)
    val = evaluate(model, val_tokens, length, batch_size=ev["batch_size"])
    test = evaluate(model, test_tokens, length, batch_size=ev["batch_size"])
    gates = {n: p.detach() for n, p in hf_model.named_parameters() if "urpe" in n}
    # How far C moved from 1 (forget-gate projections of a decay start elsewhere).
    moved = max(
        ((g - 1).abs().max().item() for n, g in gates.items() if "urpe_gate" in n), default=None
    )
    steps = objective.step_seconds
    median = statistics.median(steps) if steps else float("nan")
    record = {
        **held_out_scores(config["metric"], val, test),
        "val_loss_start": start["loss"],
        "params": sum(p.numel() for p in hf_model.parameters()),
        "trained_params": sum(p.numel() for p in hf_model.parameters() if p.requires_grad),
        "gate_params": sum(p.numel() for p in gate_parameters(hf_model)),
        "gate_max_change": moved,
        "step_seconds_median": median,
        "tokens_per_second": train["batch_size"] * length / median if steps else None,
        "curve": objective.curve,
    }
    record["extrapolation"], record["extrapolation_skipped"] = extrapolation(
        model, val_tokens, ev["factors"]
    )
    return RunResult(record, tensors=gates or None)


def describe(record: dict) -> str:
    from ...training.lm import report_metric

    r = record["result"]
    value = report_metric(r["val_loss"], r["metric"])
    moved = "" if r["gate_max_change"] is None else f", max |C - 1| {r['gate_max_change']:.3f}"
    return f"val {r['metric']} {value:.3f}{moved}, {record['seconds']:.0f} s"


def write_report(records: list[dict], out: Path, seconds: float) -> tuple[str, list[Path]]:
    from .report import write_report as write

    return write(records, out, seconds)


EXPERIMENT = Experiment.of(
    COMMAND, plan, run_one, describe, write_report, sweep=("variants", "seeds")
)
